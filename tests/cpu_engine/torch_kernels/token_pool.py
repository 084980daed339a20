"""Request -> KV-slot table writes (every model). Replaces sgl-kernel's CPU op
`assign_req_to_token_pool_cpu` (the Triton `assign_req_to_token_pool` of
`sglang.srt.mem_cache.allocation` on GPUs)."""

from __future__ import annotations


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, pool_len=None):
    """For each request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i] - start[i] entries of out_cache_loc (requests consume it in batch order)."""
    consumed = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = max(end - start, 0)
        req_to_token[row, start:end] = out_cache_loc[consumed:consumed + count].to(req_to_token.dtype)
        consumed += count

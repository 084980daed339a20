"""Speculative decoding's bookkeeping ops (EAGLE / NEXTN), in plain torch: sgl-kernel's CPU ops
that SGLang 0.5.23 calls on CPU (`sglang.kernels.ops.speculative.{cache_locs,eagle,spec_tree}`,
`sglang.kernels.ops.kvcache.cache_move`), and the Triton state scatters that commit a verified
draft's Mamba states (`sglang.kernels.ops.mamba.mamba_state_scatter_triton`), which SGLang
launches on every device.

Each is a line-by-line port of SGLang's own Triton kernel (named in its docstring), written as
Python loops over the (tiny) batch. Checked by `tests/server/test_cpu_kernels.py`: the cache-slot,
bonus-token, tree-building and greedy-verification ops against SGLang's Triton kernels run by the
Triton interpreter on the same inputs (`cpu_kernel_references.speculative_cases`); the state
scatters against SGLang's own torch path for them
(`HybridLinearAttnBackend._scatter_speculative_state_with_mask`); the KV slot copy against
indexing. Index tensors may be int32 or int64, as SGLang passes them.
"""

from __future__ import annotations

import ctypes

import torch


# ---- KV slots ---------------------------------------------------------------------------------

def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """`copy_all_layer_kv_cache_tiled`: in every buffer (base address `data_ptrs[i]`, `strides[i]`
    bytes per slot) slot `tgt_loc[j]` takes slot `src_loc[j]`'s bytes. All sources are read before
    any target is written (safe in place), as the Triton kernel's tiles are."""
    sources, targets = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in sources]
        for t, row in zip(targets, rows):
            ctypes.memmove(base + t * stride, row, stride)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                           pool_len, topk, num_cols):
    """`assign_draft_cache_locs_contiguous`: request b's `topk * num_cols` slots from
    `seq_lens[b]` on go to out_cache_loc[b * topk * num_cols:]."""
    width = topk * num_cols
    for b, (req, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * width:(b + 1) * width] = req_to_token[req, start:start + width]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """`assign_extend_cache_locs`: request b's slots [start_offset[b], end_offset[b]) packed back
    to back into out_cache_loc."""
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = max(end - start, 0)
        out_cache_loc[at:at + n] = req_to_token[req, start:end]
        at += n


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """`fill_bonus_tokens`: request b's bonus token is its last accepted one."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """`fill_accept_out_cache_loc`: the slots of the accepted tokens (accept_index != -1), packed
    in order."""
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[src]
            dst += 1


# ---- draft trees ------------------------------------------------------------------------------

QLEN_ONLY_BITPACKING = 2


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
    """`sgl_build_tree_kernel_efficient_triton` (the XPU path's kernel), tree mask modes
    FULL_MASK and QLEN_ONLY. retrieve_* arrive filled with -1, the mask with True."""
    if tree_mask_mode == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("build_tree_kernel_efficient stand-in: QLEN_ONLY_BITPACKING")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    parents = parent_list.reshape(len(seq_lens), -1).tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    mask = tree_mask.view(-1)
    prefix_sum = 0
    for b, seq_len in enumerate(seq_lens):
        sel, par = selected[b], parents[b]
        seq_tree_idx = n * n * b + prefix_sum * n
        positions[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            retrieve_index[b, i] = b * n + i
            parent_tb = sel[i - 1] // topk
            parent_position, found = 0, parent_tb == 0
            if not found:
                parent_token = par[parent_tb]
                for pp in range(n - 1):
                    if sel[pp] == parent_token:
                        parent_position, found = pp + 1, True
                        break
            if found:
                first_child = int(retrieve_next_token[b, parent_position])
                retrieve_next_token[b, parent_position] = i
                if first_child != -1:
                    retrieve_next_sibling[b, i] = first_child
        retrieve_index[b, 0] = b * n
        for token in range(n):
            if tree_mask_mode == 0:  # FULL_MASK
                row = seq_tree_idx + (seq_len + n) * token + seq_len + 1
            else:  # QLEN_ONLY
                row = n * n * b + n * token + 1
            mask[row - 1] = True
            mask[row:row + n - 1] = False
            if token == 0:
                continue
            cur, position = token - 1, 0
            for _ in range(depth):
                position += 1
                mask[row + cur] = True
                parent_tb = sel[cur] // topk
                if parent_tb == 0:
                    break
                parent_token = par[parent_tb]
                nxt = next((cp for cp in range(n - 1) if sel[cp] == parent_token), None)
                if nxt is None:
                    break
                cur = nxt
            positions[b * n + token] = position + seq_len
        prefix_sum += seq_len


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """`verify_tree_greedy_kernel_triton`: walk each request's draft tree from its root, at each
    level taking the child whose token is the target's greedy choice after the last accepted one;
    records the accepted tokens (`predicts`), their indices (`accept_index`) and how many drafts
    were accepted (`accept_token_num`, the bonus token not counted)."""
    num_spec = accept_index.shape[1]
    num_draft = candidates.shape[1]
    target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for j in range(1, num_spec):
            cur = int(retrive_next_token[b, cur])
            token = int(target[last])
            matched = False
            while cur != -1:
                if int(candidates[b, cur]) == token:
                    predicts[last] = token
                    accepted += 1
                    last = int(retrive_index[b, cur])
                    accept_index[b, accepted] = last
                    matched = True
                    break
                cur = int(retrive_next_sibling[b, cur])
            if not matched:
                break
        accept_token_num[b] = accepted
        predicts[last] = target[last]


# ---- committing a verified draft's Mamba states ----------------------------------------------

def _rows(indices, n, device):
    return torch.arange(n, device=device) if indices is None else indices.to(device=device, dtype=torch.long)


def fused_mamba_state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    """`fused_mamba_state_scatter_with_mask`: dst[:, dst_indices[i]] = src[:, src_indices[i],
    step_indices[i]] ([layers, slots, ...] <- [layers, slots, steps, ...]) for every i whose step
    and indices are in range (a step of -1: nothing to commit). SGLang's own torch fallback for
    the same scatter is `HybridLinearAttnBackend._scatter_speculative_state_with_mask`."""
    if dst is None or src is None or step_indices_raw.numel() == 0:
        return
    dst_indices = dst_indices_raw.to(device=dst.device, dtype=torch.long)
    steps = step_indices_raw.to(device=dst.device, dtype=torch.long)
    src_indices = _rows(src_indices_raw, steps.shape[0], dst.device)
    valid = ((steps >= 0) & (steps < src.shape[2]) & (dst_indices >= 0) & (dst_indices < dst.shape[1])
             & (src_indices >= 0) & (src_indices < src.shape[1]))
    keep = valid.nonzero(as_tuple=True)[0]
    if keep.numel():
        dst[:, dst_indices[keep]] = src[:, src_indices[keep], steps[keep]].to(dst.dtype)


def fused_conv_window_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    """`fused_conv_window_scatter_with_mask`: the same scatter for conv windows (dst: conv states
    [layers, slots, dim, width - 1]; src: the windows after each verified step [layers, slots,
    steps, dim, width - 1], an overlapping strided view, read through its strides)."""
    fused_mamba_state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw)


def fused_conv_window_scatter_multi(pairs, dst_indices_raw, step_indices_raw, dst_indices2_raw=None,
                                    step_indices2_raw=None):
    """`fused_conv_window_scatter_multi`: the conv-window scatter for every (conv states, windows)
    pair, for the accepted steps, then for the optional second set (the track slots)."""
    for dst, src in pairs:
        fused_conv_window_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw)
        if step_indices2_raw is not None and step_indices2_raw.numel():
            fused_conv_window_scatter_with_mask(dst, src, dst_indices2_raw, step_indices2_raw)

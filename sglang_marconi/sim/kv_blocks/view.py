"""The hash-id view of a workload: per request, its block hash ids and input length.

A trace that carries hash ids (Mooncake's `hash_ids`, 512-token blocks) is read as is, whatever
`--mooncake-tokens` mode rebuilds its tokens for the hybrid policies. A token-only workload (the
authors' JSONL, synthetic ones) gets ids derived from its tokens, chained by prefix as vLLM's and
SGLang's block hashes are: the id of block i identifies ``input[: (i + 1) * block_size]``, and the
partial last block gets the id of the whole input (`baselines.vllm_plus.block_keys`, 64-bit keys
that are deterministic across processes), so requests share an id exactly when they share the
whole prefix up to the end of that block.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.baselines.vllm_plus import block_keys
from sglang_marconi.sim.units import format_bytes
from sglang_marconi.sim.workload import Workload


@dataclass(frozen=True)
class BlockTrace:
    name: str
    block_size: int  # tokens per block
    requests: list[tuple[list[int], int]]  # (hash ids, input length) per request, arrival order
    derived: bool  # True: ids derived from tokens (the workload has none of its own)

    def __len__(self) -> int:
        return len(self.requests)


def block_trace(workload: Workload, block_size: int, limit: int | None = None) -> BlockTrace:
    """The hash-id view of `workload` (the first `limit` requests). `block_size` is used only
    to derive ids for a token-only workload; a hash-id trace keeps its own block size."""
    native = workload.block_hashes()
    if native is not None:
        size, requests = native
        return BlockTrace(workload.name, size, requests[:limit], derived=False)
    if block_size < 1:
        raise MarconiError(f"block size must be >= 1, got {block_size}")
    requests = [(block_keys(r.input_tokens, block_size, partial_tail=True), r.input_len)
                for r in islice(workload, limit)]
    return BlockTrace(workload.name, block_size, requests, derived=True)


def kv_capacities(trace: BlockTrace, profile, capacities: list[int], blocks: list[int] | None) -> list[tuple[int, int]]:
    """(blocks, bytes) per capacity of a kv-* policy: `blocks` as given (bytes: their KV on
    `profile`), else each byte capacity holds floor(bytes / KV bytes of one block) blocks."""
    block_bytes = profile.kv_bytes_per_token * trace.block_size
    if blocks:
        return [(b, b * block_bytes) for b in blocks]
    if block_bytes <= 0:
        raise MarconiError(f"model {profile.name} has no KV cache (0 bytes per token): size kv-* policies "
                           "with --capacity-blocks")
    out = []
    for capacity in capacities:
        if capacity < block_bytes:
            raise MarconiError(f"capacity {format_bytes(capacity)} holds no KV block of {trace.block_size} tokens "
                               f"({format_bytes(block_bytes)} on {profile.name})")
        out.append((capacity // block_bytes, capacity))
    return out

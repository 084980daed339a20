"""One simulated server per worker, stepped one request at a time, with a peek.

A router asks every worker two questions about a request before it picks one, and neither may
change the worker's cache: how much of the input's KV the worker holds (what a router fed
SGLang's full-KV block events believes it can reuse), and how much it can actually reuse (the
deepest point with KV *and* an SSM state, capped like a hit so one input token is prefilled).
`peek` answers both; `serve` then runs the request through the worker's policy exactly as the
single-server replay does, so one worker fed every request reproduces `sim.replay`'s result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tree.radix_tree import as_token_array
from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy
from sglang_marconi.sim.baselines.infinite import InfiniteCache
from sglang_marconi.sim.baselines.no_cache import NoCache
from sglang_marconi.sim.baselines.vllm_plus import VllmPlusCache, block_keys
from sglang_marconi.sim.kv_blocks.base import BlockCache


@dataclass(frozen=True, slots=True)
class Match:
    """What a worker holds of one request's input, capped at input length - 1 (a hit's cap)."""

    kv_tokens: int  # leading input tokens whose KV is cached, reusable or not
    reusable_tokens: int  # leading input tokens reusable now: KV and a state at that point


def peek_policy(policy, tokens: np.ndarray) -> Match:
    """`Match` of `tokens` (an input) against a token-level policy, without touching it."""
    limit = len(tokens) - 1
    if isinstance(policy, HybridRadixPolicy):
        cache = policy.cache
        walk = cache.tree.walk(as_token_array(tokens))
        kv = min(walk.overlap, limit)
        if cache.attention_only:  # no SSM layers: every cached token is reusable (HybridPrefixCache.lookup)
            return Match(kv, cache.tree.page_aligned(kv))
        reusable = 0
        for node in walk.path:  # the deepest state at or before the cap, as `lookup` finds it
            if node.end > limit:
                break
            if node.has_state:
                reusable = node.end
        return Match(kv, reusable)
    if isinstance(policy, VllmPlusCache):
        bs = policy.block_size
        blocks = policy._blocks  # read-only membership tests: LRU order is untouched
        full = 0
        for key in block_keys(tokens, bs):
            if key not in blocks:
                break
            full += 1
        kv = min(full * bs, limit)
        # every vLLM+ block carries a checkpoint: reusable up to the last whole block under the cap
        return Match(kv, min(full, max(0, limit // bs)) * bs)
    if isinstance(policy, InfiniteCache):
        kv = min(policy.tree.walk(as_token_array(tokens)).overlap, limit)
        return Match(kv, kv)
    if isinstance(policy, NoCache):
        return Match(0, 0)
    raise MarconiError(f"policy {getattr(policy, 'name', policy)!r} has no peek for cluster replay")


class TokenWorker:
    """A worker running a token-level policy (`sim.policies.build_policy`)."""

    def __init__(self, policy):
        self.policy = policy

    def peek(self, request) -> Match:
        return peek_policy(self.policy, request.input_tokens)

    def serve(self, request) -> int:
        return int(self.policy.serve(request).hit_tokens)

    def close(self) -> None:
        if hasattr(self.policy, "close"):
            self.policy.close()


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """A request in the hash-id view (kv-* caches): its ids, input length, session and arrival."""

    session_id: str
    arrival_s: float
    hash_ids: list
    input_len: int


class BlockWorker:
    """A worker running a KV-only block cache (`kv_blocks`): hits as `kv_blocks.replay` counts
    them (leading resident blocks, `min(k * block, input length)` tokens); KV-only, so every
    cached block is reusable."""

    def __init__(self, cache: BlockCache, block_size: int):
        self.cache, self.block_size = cache, block_size

    def _leading(self, ids) -> int:
        resident, k = self.cache.resident, 0
        for h in ids:
            if h not in resident:
                break
            k += 1
        return k

    def peek(self, request: BlockRequest) -> Match:
        hit = min(self._leading(request.hash_ids) * self.block_size, request.input_len)
        return Match(hit, hit)

    def serve(self, request: BlockRequest) -> int:
        hit = min(self._leading(request.hash_ids) * self.block_size, request.input_len)
        for h in request.hash_ids:
            self.cache.access(h)
        return hit

    def close(self) -> None:
        pass

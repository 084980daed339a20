"""Prefix cache for hybrid models: KV per edge token, SSM checkpoints at node ends (paper §4).

A configuration of `core.TreeCore` (the tree's mechanics, written once) with copied edges
(`radix_tree.RadixTree`) and token-array requests.

Admission (§4.1): a request admits at most two SSM states, the one after its last decoded
token and one at the branch point that speculative insertion of its input finds (on the
checkpoint grid, as chunked prefill produces states). Eviction (§4.2) is delegated to an
`EvictionPolicy`; candidates live in a numpy `CandidateIndex` kept current incrementally, so
choosing a victim never walks the tree. The index's value column is kept current under every
choice (`set_eviction` may switch to one that ranks by it).

Probation (`probation=True`): a prefix that recurs exactly twice in a row (a request, then one that
shares its input and not what followed: SGLang's mooncake generator sends each round with a
placeholder reply) finds no state at the second use: the branch it reveals is checkpointed then
and pays from the third. With probation each admission also keeps, best effort, the state at
the end of the request's input (the prefill computes it anyway) as a probationary state: a
later hit on it confirms it (a regular state from then on), and pressure evicts probationary
states first, oldest first, before the eviction policy is asked for a victim.

Bytes: `kv_bytes_per_token` per cached token plus `ssm_state_bytes` per checkpoint, both from
the model profile; `used_bytes` never exceeds `capacity_bytes` once an admission returns. With
`state_slots` (two budgets, as a serving engine's KV pool and SSM-state pool), `capacity_bytes`
bounds the KV alone and at most `state_slots` states are cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction
from sglang_marconi.policy.tree.core import CacheCounters, TokenArrayRequests, TreeCore, TreeSnapshot, check_capacity
from sglang_marconi.policy.tree.radix_tree import Node, RadixTree, as_token_array

__all__ = ["CacheCounters", "HybridPrefixCache", "Lookup"]


@dataclass(frozen=True, slots=True)
class Lookup:
    """The result of matching a request's input before prefill."""

    hit_tokens: int  # prefix reusable now: KV and an SSM state at exactly this length
    overlap_tokens: int  # tokens of the input whose KV is cached (reusable or not)
    checkpoint_at: int | None  # branch position to checkpoint during prefill, if any
    hit_node: Node


class HybridPrefixCache(TokenArrayRequests, TreeCore):
    def __init__(
        self,
        profile,
        capacity_bytes: int,
        eviction: EvictionPolicy | None = None,
        *,
        checkpoint_grid: int = 1,
        page_size: int = 1,
        state_slots: int | None = None,
        probation: bool = False,
    ):
        check_capacity(profile, capacity_bytes, state_slots)
        self._configure(profile, capacity_bytes, eviction if eviction is not None else FlopAwareEviction(0.0),
                        RadixTree(page_size), CandidateIndex(tie_key=CandidateIndex.node_id),
                        checkpoint_grid=checkpoint_grid, state_slots=state_slots, probation=probation)

    # -- request API -----------------------------------------------------------------------------
    def lookup(self, input_tokens) -> Lookup:
        """Match the input (refreshing timestamps) and speculatively insert it to find the branch
        checkpoint. At least one input token is always left to prefill."""
        seq = as_token_array(input_tokens)
        walk = self.tree.walk(seq)
        hit, checkpoint_at, hit_node = self._hit(walk.path, walk.partial, walk.overlap, len(seq))
        return Lookup(hit, walk.overlap, checkpoint_at, hit_node)

    def admit(self, sequence, checkpoint_at: int | None = None, probation_at: int | None = None) -> int:
        """Cache a finished request's sequence (input + output) with an SSM state at its end and
        at `checkpoint_at`; evict to make room. Returns the number of states admitted (<= 2, plus
        a probationary one at `probation_at`, the end of its input, with probation)."""
        seq = as_token_array(sequence)
        n = self.tree.page_aligned(len(seq))
        if n == 0:
            return 0
        seq = seq[:n]
        return self._admit(seq, n, self._walk(seq, n), checkpoint_at, probation_at)

    def serve(self, input_tokens, output_tokens=()) -> tuple[Lookup, int]:
        """Simulate one request end to end: lookup, prefill, decode, admit."""
        inp = as_token_array(input_tokens)
        lookup = self.lookup(inp)
        seq = np.concatenate((inp, np.asarray(output_tokens, dtype=np.int64)))
        return lookup, self.admit(seq, lookup.checkpoint_at, len(inp) if self.probation else None)

    # -- snapshots (alpha tuning replays a window from one) ---------------------------------------
    @classmethod
    def from_snapshot(cls, profile, snap: TreeSnapshot, eviction: EvictionPolicy, capacity_bytes: int | None = None):
        cache = HybridPrefixCache(
            profile, capacity_bytes or snap.capacity_bytes, eviction, checkpoint_grid=snap.checkpoint_grid,
            page_size=snap.page_size, state_slots=snap.state_slots, probation=snap.keeps_probation,
        )
        cache._load_snapshot(snap)
        return cache

"""SGLang's radix-cache LRU as the paper's SGLang+ baseline: evict the least recently used
unlocked leaf; a hit refreshes every node on the matched path."""

from __future__ import annotations

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.rules.eviction.base import EvictionPolicy


class LruLeafEviction(EvictionPolicy):
    name = "lru-leaves"
    evicts_single_child_nodes = False
    refresh_matched_path = True

    def choose(self, candidates: CandidateIndex):
        return candidates.lowest(0.0)

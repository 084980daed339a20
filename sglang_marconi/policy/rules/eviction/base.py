"""The interface a cache consults to pick what to evict."""

from __future__ import annotations

from abc import ABC, abstractmethod

from sglang_marconi.policy.tree.candidate_index import CandidateIndex


class EvictionPolicy(ABC):
    name: str
    # Evicting a single-child node that holds a checkpoint frees the checkpoint and merges its
    # edge into the child; policies that only evict leaves never consider such nodes.
    evicts_single_child_nodes: bool
    # On a hit, refresh every node of the matched path (SGLang's LRU) or only the node hit.
    refresh_matched_path: bool
    # The per-node value (`node_value`) depends on the node's subtree: an edit below a node
    # re-scores its nearest ancestor holding a state (`CoverageEviction`).
    value_reaches_up: bool = False

    def observe_request(self, cache, request, n: int) -> None:
        """Called by the cache once per admitted request, after its admission (cached or skipped):
        `request` in the cache's request form (a token array, or a `SharedMatch` whose `seq` holds
        the tokens), its first `n` tokens what the cache was asked to keep. Most rules need nothing."""

    @abstractmethod
    def choose(self, candidates: CandidateIndex):
        """Return the candidate to evict next (the index is never empty)."""

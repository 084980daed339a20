"""SegLen-style eviction: recency plus the prefill a hit at the node would save, in tokens.

S(n) = norm(recency) + weight * norm(replay length), the replay length being the tokens from the
node's parent (the nearest node a hit could fall back to) to the node's end, for nodes holding a
state (0 for the others: nothing can hit there). Unlike Marconi's FLOP efficiency it does not
divide by the bytes the eviction frees, so a long segment is kept however much KV it holds.
(After a public SGLang fork's score, reported at -29.5% TTFT vs LRU on prefix-heavy data.)
Candidates and refresh are Marconi's: nodes with at most one child, only the node hit refreshed.
"""

from __future__ import annotations

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.rules.eviction.base import EvictionPolicy
from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha


class SegLenEviction(EvictionPolicy):
    name = "seglen"
    evicts_single_child_nodes = True
    refresh_matched_path = False

    def __init__(self, weight: float = 1.0):
        self.alpha = check_alpha(weight)  # the weight of the replay-length column, as alpha is of efficiency's

    @staticmethod
    def node_value(cache, node) -> float:
        if not (node.has_state or cache.attention_only):
            return 0.0
        return float(node.end - node.parent.end)

    def choose(self, candidates: CandidateIndex):
        return candidates.lowest(self.alpha)

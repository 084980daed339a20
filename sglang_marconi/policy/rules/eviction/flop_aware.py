"""Marconi's FLOP-aware eviction (paper §4.2): lowest recency + alpha * flop_efficiency.

Candidates are all unlocked nodes with at most one child; only the node hit is refreshed.
alpha = 0 is LRU over those candidates; `alpha` may be changed at any time (alpha tuning).
"""

from __future__ import annotations

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction.base import EvictionPolicy


def check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise MarconiError(f"alpha must be a number >= 0, got {alpha!r}")
    return float(alpha)


class FlopAwareEviction(EvictionPolicy):
    name = "marconi"
    evicts_single_child_nodes = True
    refresh_matched_path = False

    def __init__(self, alpha: float = 0.0):
        self.alpha = check_alpha(alpha)

    def choose(self, candidates: CandidateIndex):
        return candidates.lowest(self.alpha)

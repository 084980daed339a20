"""The host tier's eviction candidates: `CandidateIndex` plus the host bytes each one frees.

The bytes let a ranked demotion (Marconi's) ask, before evicting anything, whether the host can
make room for an incoming node by evicting only candidates that rank below it: a vectorized sum
over the candidates, instead of a trial eviction that may displace content and then drop the
incoming node anyway.
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.candidate_index import _TIE_BREAK, CandidateIndex


class HostCandidateIndex(CandidateIndex):
    def __init__(self, initial_capacity: int = 1024):
        super().__init__(initial_capacity)
        self._bytes = np.zeros(initial_capacity)

    def add(self, item, last_access: float, efficiency: float, freed_bytes: int = 0) -> int:
        slot = super().add(item, last_access, efficiency)
        if slot == len(self._bytes):
            grown = np.zeros(self._columns.shape[1])
            grown[:slot] = self._bytes
            self._bytes = grown
        self._bytes[slot] = freed_bytes
        return slot

    def update(self, slot: int, last_access: float, efficiency: float, freed_bytes: int = 0) -> None:
        super().update(slot, last_access, efficiency)
        self._bytes[slot] = freed_bytes

    def remove(self, slot: int):
        last = len(self.items) - 1
        if slot != last:
            self._bytes[slot] = self._bytes[last]
        return super().remove(slot)

    def bytes_ranked_below(self, alpha: float, last_access: float, efficiency: float) -> float:
        """Host bytes held by the candidates whose utility (recency + alpha x efficiency, min-max
        normalized over the candidates and the incoming node together, `CandidateIndex.lowest`'s
        weights) is strictly below an incoming node's."""
        if not len(self.items):
            return 0.0
        return float(self._bytes[:len(self.items)][self.ranked_below(alpha, last_access, efficiency)].sum())

    def ranked_below(self, alpha: float, last_access: float, efficiency: float) -> np.ndarray:
        """Which candidates (a mask over `items`) rank strictly below an incoming node: the only
        ones a ranked admission may displace."""
        n = len(self.items)
        if not n:
            return np.zeros(0, dtype=bool)
        t, e = self._columns[0, :n], self._columns[1, :n]
        lo_t, hi_t = min(float(t.min()), last_access), max(float(t.max()), last_access)
        w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
        scores = (t - lo_t) * w_t
        incoming = (last_access - lo_t) * w_t
        if alpha:
            lo_e, hi_e = min(float(e.min()), efficiency), max(float(e.max()), efficiency)
            w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
            scores = scores + (e - lo_e) * w_e
            incoming += (efficiency - lo_e) * w_e
        return scores < incoming

    def freed_bytes(self, slot: int) -> float:
        return float(self._bytes[slot])

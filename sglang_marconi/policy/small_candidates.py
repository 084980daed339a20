"""`CandidateIndex` for the shadow caches: the same entries in the same slots, so that every
victim is the one `CandidateIndex.lowest` picks, for less per operation.

- The columns live in Python lists (a store is cheaper than a numpy scalar store). The numpy
  columns that `CandidateIndex.lowest` scores are kept in step only while the index is large
  (from SMALL entries up, down to half that), and built from the lists when a small index needs
  them (a near-tie, below): same values, same slots.
- `lowest` on a few candidates (a contended cache holds a handful: the shadows of a 1 GB cache
  hold about six) scores them in plain Python instead of eight numpy calls. The reference
  computes the scores with a BLAS dot whose rounding depends on a value's position in the array,
  so the Python scores may differ from it in the last bits; the Python path therefore keeps its
  answer only when the best score leads the second by far more than any such rounding (1e-12 x
  the largest possible score, against errors of a few 1e-16), and otherwise asks the reference
  itself, on the same slots. The victim is thus always the reference's, ties included.
"""

from __future__ import annotations

import math

import numpy as np

from sglang_marconi.policy.candidate_index import _TIE_BREAK, CandidateIndex

SMALL = 32  # up to this many candidates the Python scores are cheaper than numpy's calls
_GAP = 1e-12  # x (the largest possible score): a lead no rounding of the reference's dot can reverse


class SmallCandidateIndex(CandidateIndex):
    def __init__(self, initial_capacity: int = 64):
        super().__init__(initial_capacity)
        self.recency: list[float] = []  # the two columns, slot by slot
        self.value: list[float] = []
        self._mirrored = False  # whether the numpy columns (`_t`, `_e`) are kept in step

    @property
    def last_access(self) -> np.ndarray:
        return np.array(self.recency)

    @property
    def efficiency(self) -> np.ndarray:
        return np.array(self.value)

    def _mirror(self) -> None:
        n = len(self.items)
        self._columns = np.zeros((2, max(2 * n, 64)))
        self._columns[0, :n] = self.recency
        self._columns[1, :n] = self.value
        self._t, self._e = self._columns[0], self._columns[1]
        self._mirrored = True

    def add(self, item, last_access: float, efficiency: float) -> int:
        slot = len(self.items)
        self.items.append(item)
        self.recency.append(last_access)
        self.value.append(efficiency)
        if self._mirrored:
            if slot == self._columns.shape[1]:
                self._mirror()
            else:
                self._t[slot] = last_access
                self._e[slot] = efficiency
        elif slot >= SMALL:
            self._mirror()
        return slot

    def update(self, slot: int, last_access: float, efficiency: float) -> None:
        self.recency[slot] = last_access
        self.value[slot] = efficiency
        if self._mirrored:
            self._t[slot] = last_access
            self._e[slot] = efficiency

    def touch(self, slot: int, last_access: float) -> None:
        self.recency[slot] = last_access
        if self._mirrored:
            self._t[slot] = last_access

    def remove(self, slot: int):
        items, recency, value = self.items, self.recency, self.value
        last = len(items) - 1
        moved = None
        if slot != last:
            moved = items[last]
            items[slot] = moved
            recency[slot] = recency[last]
            value[slot] = value[last]
            if self._mirrored:
                self._t[slot] = self._t[last]
                self._e[slot] = self._e[last]
        items.pop()
        recency.pop()
        value.pop()
        if self._mirrored and last <= SMALL // 2:
            self._mirrored = False
        return moved

    def lowest(self, alpha: float):
        n = len(self.items)
        if n > SMALL:
            return super().lowest(alpha)
        recency = self.recency
        lo_t = min(recency)
        if not alpha:
            return self.items[recency.index(lo_t)]  # numpy's argmin: the first of equals
        value = self.value
        hi_t, lo_e, hi_e = max(recency), min(value), max(value)
        w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
        w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
        if not (math.isinf(w_t) or math.isinf(w_e)):
            scores = [w_t * (t - lo_t) + w_e * (e - lo_e) for t, e in zip(recency, value)]
            best = min(scores)
            slot = scores.index(best)
            scores[slot] = math.inf
            if min(scores) - best > _GAP * (2.0 + alpha):
                return self.items[slot]
        # a near-tie (or a subnormal span): the reference's own arithmetic decides, on these slots
        if not self._mirrored:
            self._columns = np.array((recency, value))
        return super().lowest(alpha)

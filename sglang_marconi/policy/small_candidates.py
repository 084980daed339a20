"""`CandidateIndex` for the shadow caches: the same entries in the same slots, so that every
victim is the one `CandidateIndex.lowest` picks, for less per operation.

- Slot writes go through cached 1-D row views (a scalar store each, not a 2-D column copy).
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

from sglang_marconi.policy.candidate_index import _TIE_BREAK, CandidateIndex

SMALL = 24  # up to this many candidates the Python scores are cheaper than numpy's calls
_GAP = 1e-12  # x (the largest possible score): a lead no rounding of the reference's dot can reverse


class SmallCandidateIndex(CandidateIndex):
    def __init__(self, initial_capacity: int = 64):
        super().__init__(initial_capacity)
        self._t, self._e = self._columns[0], self._columns[1]

    def add(self, item, last_access: float, efficiency: float) -> int:
        slot = len(self.items)
        if slot == self._columns.shape[1]:
            slot = super().add(item, last_access, efficiency)
            self._t, self._e = self._columns[0], self._columns[1]
            return slot
        self.items.append(item)
        self._t[slot] = last_access
        self._e[slot] = efficiency
        return slot

    def update(self, slot: int, last_access: float, efficiency: float) -> None:
        self._t[slot] = last_access
        self._e[slot] = efficiency

    def remove(self, slot: int):
        items = self.items
        last = len(items) - 1
        moved = None
        if slot != last:
            moved = items[last]
            items[slot] = moved
            self._t[slot] = self._t[last]
            self._e[slot] = self._e[last]
        items.pop()
        return moved

    def lowest(self, alpha: float):
        n = len(self.items)
        if not alpha:
            return self.items[int(self._t[:n].argmin())]  # what the reference computes, first of equals
        if n > SMALL:
            return super().lowest(alpha)
        t, e = self._t[:n].tolist(), self._e[:n].tolist()
        lo_t, hi_t, lo_e, hi_e = min(t), max(t), min(e), max(e)
        w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
        w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
        if math.isinf(w_t) or math.isinf(w_e):
            return super().lowest(alpha)
        best = second = math.inf
        best_slot = 0
        for slot in range(n):
            score = w_t * (t[slot] - lo_t) + w_e * (e[slot] - lo_e)
            if score < best:
                best, second, best_slot = score, best, slot
            elif score < second:
                second = score
        if second - best > _GAP * (2.0 + alpha):
            return self.items[best_slot]
        return super().lowest(alpha)  # a near-tie: the reference's own rounding decides

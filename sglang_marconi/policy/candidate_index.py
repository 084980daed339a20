"""Struct-of-arrays index of eviction candidates, scored with numpy.

Marconi's utility (Eq. 2) min-max normalizes recency and FLOP efficiency over the current
candidates, so every eviction needs the extremes of both columns; keeping them dense in two
float arrays makes that one vectorized pass instead of a walk over the tree. Removal swaps the
last entry into the hole so the arrays stay dense.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def marconi_scores(last_access: np.ndarray, efficiency: np.ndarray, alpha: float) -> np.ndarray:
    """S = norm(recency) + alpha * norm(flop_efficiency), each min-max normalized to [0, 1].

    A column whose values are all equal normalizes to 0 (it cannot rank anything)."""
    scores = minmax(last_access)
    if alpha:
        scores += alpha * minmax(efficiency)
    return scores


def minmax(values: np.ndarray) -> np.ndarray:
    """Min-max normalized to [0, 1]; all equal: zeros."""
    lo = values.min()
    span = values.max() - lo
    if span <= 0:
        return np.zeros(len(values))
    return (values - lo) / span


_TIE_BREAK = 1e-12


class CandidateIndex:
    """Candidates with their recency and FLOP efficiency, dense in the two rows of one array."""

    def __init__(self, initial_capacity: int = 1024):
        self._columns = np.zeros((2, initial_capacity))  # row 0: recency, row 1: efficiency
        self.items: list[Any] = []

    @property
    def last_access(self) -> np.ndarray:
        return self._columns[0]

    @property
    def efficiency(self) -> np.ndarray:
        return self._columns[1]

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any, last_access: float, efficiency: float) -> int:
        slot = len(self.items)
        if slot == self._columns.shape[1]:
            grown = np.zeros((2, 2 * slot))
            grown[:, :slot] = self._columns
            self._columns = grown
        self.items.append(item)
        self._columns[0, slot] = last_access
        self._columns[1, slot] = efficiency
        return slot

    def update(self, slot: int, last_access: float, efficiency: float) -> None:
        self._columns[0, slot] = last_access
        self._columns[1, slot] = efficiency

    def remove(self, slot: int) -> Any | None:
        """Drop the entry at `slot`; return the item moved into `slot` (its slot changed), if any."""
        last = len(self.items) - 1
        moved = None
        if slot != last:
            moved = self.items[last]
            self.items[slot] = moved
            self._columns[:, slot] = self._columns[:, last]
        self.items.pop()
        return moved

    def lowest(self, alpha: float) -> Any:
        """The candidate with the lowest Marconi utility (alpha = 0 is LRU).

        Same ranking as `marconi_scores`, in fewer numpy calls (this runs once per evicted node):
        norm(t) + alpha * norm(e) = w . (x - lo) with w = (1/span_t, alpha/span_e), 0 for a
        column whose span is 0. Exact ties (common: with alpha = 1 the oldest, most efficient
        candidate and the newest, least efficient one both score 1) go to the older candidate:
        recency's weight is raised by a relative 1e-12, far below any real score difference."""
        n = len(self.items)
        columns = self._columns[:, :n]
        if not alpha:
            return self.items[int(columns[0].argmin())]
        lo = columns.min(axis=1)
        (lo_t, lo_e), (hi_t, hi_e) = lo.tolist(), columns.max(axis=1).tolist()
        w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
        w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
        if math.isinf(w_t) or math.isinf(w_e):  # a subnormal span: divide, as the reference does
            return self.items[int(marconi_scores(columns[0], columns[1], alpha).argmin())]
        return self.items[int(np.array((w_t, w_e)).dot(columns - lo[:, None]).argmin())]


def lowest_across(indexes, alpha: float):
    """The lowest-utility candidate over several indexes, each column min-max normalized over
    their union (the cross-kind byte-budget choice: KV leaves and SSM states in one ranking).
    Reads each index's extremes and scores in place, never concatenating them. Returns
    `(position of the index, item)`, or None when all are empty; exact ties go to the earlier
    index, then to the older candidate, as in `CandidateIndex.lowest`."""
    live = [(i, index._columns[:, :len(index)]) for i, index in enumerate(indexes) if len(index)]
    if not live:
        return None
    if not alpha:
        best = min(((float(cols[0].min()), i, int(cols[0].argmin())) for i, cols in live), key=lambda t: t[:2])
        return best[1], indexes[best[1]].items[best[2]]
    lo_t = min(float(cols[0].min()) for _, cols in live)
    hi_t = max(float(cols[0].max()) for _, cols in live)
    lo_e = min(float(cols[1].min()) for _, cols in live)
    hi_e = max(float(cols[1].max()) for _, cols in live)
    w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
    w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
    weights, lo = np.array((w_t, w_e)), np.array((lo_t, lo_e))
    divide = math.isinf(w_t) or math.isinf(w_e)  # a subnormal span: divide, as the reference does

    def scores_of(cols):
        if not divide:
            return weights.dot(cols - lo[:, None])
        scores = (cols[0] - lo_t) / (hi_t - lo_t) if hi_t > lo_t else np.zeros(cols.shape[1])
        return scores + alpha * (cols[1] - lo_e) / (hi_e - lo_e) if hi_e > lo_e else scores

    best = None
    for i, cols in live:
        scores = scores_of(cols)
        j = int(scores.argmin())
        if best is None or scores[j] < best[0]:
            best = (float(scores[j]), i, j)
    return best[1], indexes[best[1]].items[best[2]]

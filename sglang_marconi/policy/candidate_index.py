"""Struct-of-arrays index of eviction candidates, scored with numpy.

Marconi's utility (Eq. 2) min-max normalizes recency and FLOP efficiency over the current
candidates, so every eviction needs the extremes of both columns; keeping them dense in two
float arrays makes that one vectorized pass instead of a walk over the tree. Removal swaps the
last entry into the hole so the arrays stay dense.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def marconi_scores(last_access: np.ndarray, efficiency: np.ndarray, alpha: float) -> np.ndarray:
    """S = norm(recency) + alpha * norm(flop_efficiency), each min-max normalized to [0, 1].

    A column whose values are all equal normalizes to 0 (it cannot rank anything)."""
    scores = _minmax(last_access)
    if alpha:
        scores += alpha * _minmax(efficiency)
    return scores


def _minmax(values: np.ndarray) -> np.ndarray:
    lo = values.min()
    span = values.max() - lo
    if span <= 0:
        return np.zeros(len(values))
    return (values - lo) / span


class CandidateIndex:
    def __init__(self, initial_capacity: int = 1024):
        self.last_access = np.zeros(initial_capacity)
        self.efficiency = np.zeros(initial_capacity)
        self.items: list[Any] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any, last_access: float, efficiency: float) -> int:
        slot = len(self.items)
        if slot == len(self.last_access):
            self.last_access = np.resize(self.last_access, 2 * slot)
            self.efficiency = np.resize(self.efficiency, 2 * slot)
        self.items.append(item)
        self.last_access[slot] = last_access
        self.efficiency[slot] = efficiency
        return slot

    def update(self, slot: int, last_access: float, efficiency: float) -> None:
        self.last_access[slot] = last_access
        self.efficiency[slot] = efficiency

    def remove(self, slot: int) -> Any | None:
        """Drop the entry at `slot`; return the item moved into `slot` (its slot changed), if any."""
        last = len(self.items) - 1
        moved = None
        if slot != last:
            moved = self.items[last]
            self.items[slot] = moved
            self.last_access[slot] = self.last_access[last]
            self.efficiency[slot] = self.efficiency[last]
        self.items.pop()
        return moved

    def lowest(self, alpha: float) -> Any:
        """The candidate with the lowest Marconi utility (alpha = 0 is LRU)."""
        n = len(self.items)
        t = self.last_access[:n]
        if not alpha:
            return self.items[int(t.argmin())]
        return self.items[int(marconi_scores(t, self.efficiency[:n], alpha).argmin())]

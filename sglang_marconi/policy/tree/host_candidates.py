"""The host tier's eviction candidates: `CandidateIndex` plus what each one frees on the host.

Two columns beside recency and value: the host bytes a candidate frees (`freed_bytes`) and the
units of one host pool it frees (`units`: KV tokens or SSM states, per index). They let a ranked
demotion (Marconi's) ask, before evicting anything, whether the host can make room for an
incoming node by evicting only candidates that rank below it: a vectorized sum over the
candidates, instead of a trial eviction that may displace content and then drop the incoming
node anyway. Scores are `policy/rules/score.py`'s; under the continuation signal (an order that
is a `tier_rules.DepthOrder`, the value column holding each candidate's depth) its keep score.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.rules.tier_rules import DepthOrder
from sglang_marconi.policy.tree.candidate_index import CandidateIndex


class HostCandidateIndex(CandidateIndex):
    """`CandidateIndex` with two more columns per candidate: host bytes freed, pool units freed.
    `tie_key` breaks exact score ties in `lowest` (`CandidateIndex`)."""

    def __init__(self, initial_capacity: int = 1024, tie_key: Optional[Callable[[Any], Any]] = None):
        super().__init__(initial_capacity, tie_key=tie_key)
        self._bytes = np.zeros(initial_capacity)
        self._units = np.zeros(initial_capacity)

    def add(self, item, last_access: float, efficiency: float, freed_bytes: int = 0, units: int = 0) -> int:
        slot = super().add(item, last_access, efficiency)
        if slot == len(self._bytes):
            size = self._columns.shape[1]
            self._bytes = np.concatenate((self._bytes, np.zeros(size - len(self._bytes))))
            self._units = np.concatenate((self._units, np.zeros(size - len(self._units))))
        self._bytes[slot] = freed_bytes
        self._units[slot] = units
        return slot

    def update(self, slot: int, last_access: float, efficiency: float, freed_bytes: int = 0, units: int = 0) -> None:
        super().update(slot, last_access, efficiency)
        self._bytes[slot] = freed_bytes
        self._units[slot] = units

    def remove(self, slot: int):
        last = len(self.items) - 1
        if slot != last:
            self._bytes[slot] = self._bytes[last]
            self._units[slot] = self._units[last]
        return super().remove(slot)

    def lowest(self, order) -> Any:
        """The candidate to evict first under `order`: an alpha (`CandidateIndex.lowest`) or a
        `DepthOrder` (lowest keep score, age from the newest candidate); exact ties to the
        smallest tie key."""
        if not isinstance(order, DepthOrder):
            return super().lowest(order)
        n = len(self.items)
        recency = self._columns[0, :n]
        keep = order.keep(recency, self._columns[1, :n], float(recency.max()))
        return self.items[score.lowest_slot(keep, self.least_key)]

    def bytes_ranked_below(self, order, last_access: float, efficiency: float) -> float:
        """Host bytes held by the candidates ranking strictly below an incoming node under `order`
        (`ranked_below_across`)."""
        if not len(self.items):
            return 0.0
        return float(self._bytes[:len(self.items)][self.ranked_below(order, last_access, efficiency)].sum())

    def ranked_below(self, order, last_access: float, efficiency: float) -> np.ndarray:
        """Which candidates (a mask over `items`) rank strictly below an incoming node: the only
        ones a ranked admission may displace."""
        return ranked_below_across((self,), order, last_access, efficiency)[0]

    def freed_bytes(self, slot: int) -> float:
        return float(self._bytes[slot])

    def units(self, slot: int) -> float:
        return float(self._units[slot])

    def units_where(self, mask: np.ndarray) -> int:
        return int(self._units[:len(self.items)][mask].sum())


def ranked_below_across(indexes, order, last_access: float, efficiency: float) -> list[np.ndarray]:
    """Per index, which candidates rank strictly below an incoming node. `order` an alpha: by
    `policy/rules/score.py`'s utility, both columns min-max normalized over the union of the
    indexes and the incoming node (a candidate listed in two indexes counts once in the extremes,
    as it would in one); a `DepthOrder` (`efficiency` then the depth): by keep score, ages from
    the newest of the candidates and the incoming node. One vectorized pass per index."""
    live = [index._columns[:, :len(index)] for index in indexes]
    if isinstance(order, DepthOrder):
        newest = max([float(c[0].max()) for c in live if c.shape[1]] + [last_access])
        incoming = float(order.keep(last_access, efficiency, newest))
        return [order.keep(c[0], c[1], newest) < incoming for c in live]
    alpha = order
    scale = score.LRU_SCALE
    if alpha:
        t = [float(c[0].min()) for c in live if c.shape[1]] + [float(c[0].max()) for c in live if c.shape[1]]
        e = [float(c[1].min()) for c in live if c.shape[1]] + [float(c[1].max()) for c in live if c.shape[1]]
        scale = score.scale(min(t + [last_access]), max(t + [last_access]),
                            min(e + [efficiency]), max(e + [efficiency]), alpha)
    scorer = score.scorer(scale)
    incoming = scorer(last_access, efficiency)
    return [scorer(c[0], c[1]) < incoming for c in live]

"""Marconi's lowest-utility candidate in a changing set, without scoring every candidate per choice.

Contract: `lowest(alpha)` returns the key of the candidate with the lowest score
(`policy/rules/score.py`, normalized over the whole set), exact ties to the lowest tie id: the
candidate a from-scratch `score.scores` over all of them, sorted by (score, tie id), puts first.
Each candidate's score is `score.scorer` under the set's `score.scale`, the same floating-point
operations as there, so the choice is the same bit for bit, not merely close.

How: candidates live in the slots of dense arrays, grouped in blocks of `block` slots; each block
keeps the extremes of both columns over its slots, and the min-max normalization (the scale)
reads the global extremes off them. Under one scale every candidate's score is fixed, so each
block keeps a front: its FRONT lowest (score, tie id, slot), sorted, with the score below which
nothing else in the block lies; changes update fronts in O(FRONT), a block rescored (numpy) only
when its front runs empty. A block without a front holds a lower bound instead: the score of (its
oldest recency, its lowest efficiency), never above any of its candidates' scores (the score is
monotone in both columns, and so is its floating-point evaluation). A choice takes the block
with the lowest value and rescores it while that value is only a bound. When the scale moves
(the oldest or newest candidate, or the least or most efficient, changed) every block falls back
to its bound. A candidate whose recency changes moves to a fresh slot at the end: recency stamps
only grow, so slots stay close to recency order, a block spans a narrow range of recency and the
bounds stay tight. Dead slots are compacted away once they outnumber live ones; a compaction
sorts the slots by recency (`compact()` after filling the set in another order).

Cost of a choice while the scale stands: O(slots / block) numpy work on per-block values;
otherwise also rescoring the blocks whose bound is below the answer (usually one). Changes: O(1)
amortized.
"""

from __future__ import annotations

from bisect import insort
from typing import Any, Iterator

import numpy as np

from sglang_marconi.policy.rules import score

BLOCK = 256
FRONT = 8
_INF = float("inf")
_T, _E = 0, 1  # rows: recency, efficiency


class RankedCandidates:
    """Keyed candidates (recency, efficiency, tie id, payload), lowest Marconi score on demand."""

    def __init__(self, block: int = BLOCK):
        self._block = block
        self._entries: dict[Any, tuple] = {}  # key -> (slot, recency, efficiency, tie, payload)
        self._allocate(4 * block)

    def _allocate(self, capacity: int) -> None:
        self._cols = np.full((2, capacity), _INF)  # dead slots hold +inf in both rows
        self._tie = np.zeros(capacity, dtype=np.int64)
        self._keys: list = []  # by slot; None where dead
        blocks = capacity // self._block
        # Per block, over its live slots (kept as Python floats: read one at a time): lowest and
        # highest recency and efficiency. Only ever too wide between refreshes (still bounds).
        self._lo_t, self._lo_e = [_INF] * blocks, [_INF] * blocks
        self._hi_t, self._hi_e = [-_INF] * blocks, [-_INF] * blocks
        self._stale: set[int] = set()  # blocks whose extremes may be too wide
        self._extremes = None  # global (lo_t, lo_e, hi_t, hi_e), exact; None: to recompute
        self._scale = None  # the `score.Scale` the per-block values hold for
        self._scorer = None  # `score.scorer(self._scale)`
        self._best = np.full(blocks, _INF)  # per block: its front's first score, else a lower bound
        self._front: list = [None] * blocks  # per block: [(score, tie, slot), ...] sorted, or None
        self._floor = [_INF] * blocks  # per block with a front: no other slot scores below this

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def payload(self, key) -> Any:
        return self._entries[key][4]

    def entry(self, key) -> tuple[float, float, int]:
        _, t, e, tie, _ = self._entries[key]
        return t, e, tie

    def keys(self) -> Iterator:
        return iter(self._entries)

    # -- changes ---------------------------------------------------------------------------
    def put(self, key, recency: float, efficiency: float, tie: int, payload: Any = None) -> None:
        """Add `key` or replace its entry."""
        recency, efficiency, tie = float(recency), float(efficiency), int(tie)
        old = self._entries.get(key)
        if old is None:
            self._append(key, recency, efficiency, tie, payload)
        elif old[1] != recency:
            self.remove(key)
            self._append(key, recency, efficiency, tie, payload)
        elif old[2] != efficiency or old[3] != tie:  # same recency: stays in place
            slot = old[0]
            self._forget_slot(slot, recency, old[2])
            self._cols[_E, slot] = efficiency
            self._tie[slot] = tie
            self._entries[key] = (slot, recency, efficiency, tie, payload)
            self._admit_slot(slot, recency, efficiency, tie)
        elif old[4] is not payload:
            self._entries[key] = old[:4] + (payload,)

    def set_recency(self, key, recency: float) -> None:
        """`key`'s recency only (no-op for an unknown key)."""
        old = self._entries.get(key)
        if old is not None and old[1] != recency:
            self.remove(key)
            self._append(key, float(recency), old[2], old[3], old[4])

    def remove(self, key) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._kill(old)

    def _append(self, key, recency: float, efficiency: float, tie: int, payload) -> None:
        if len(self._keys) == self._cols.shape[1]:
            self._make_room()
        slot = len(self._keys)
        self._keys.append(key)
        self._entries[key] = (slot, recency, efficiency, tie, payload)
        self._cols[_T, slot] = recency
        self._cols[_E, slot] = efficiency
        self._tie[slot] = tie
        self._admit_slot(slot, recency, efficiency, tie)

    def _kill(self, entry) -> None:
        slot = entry[0]
        self._forget_slot(slot, entry[1], entry[2])
        cols = self._cols
        cols[_T, slot] = _INF
        cols[_E, slot] = _INF
        self._keys[slot] = None

    def _admit_slot(self, slot: int, recency: float, efficiency: float, tie: int) -> None:
        """A value entered `slot`: block extremes, global extremes, the block's front or bound."""
        b = slot // self._block
        if recency < self._lo_t[b]:
            self._lo_t[b] = recency
        if recency > self._hi_t[b]:
            self._hi_t[b] = recency
        if efficiency < self._lo_e[b]:
            self._lo_e[b] = efficiency
        if efficiency > self._hi_e[b]:
            self._hi_e[b] = efficiency
        g = self._extremes
        if g is not None and not (g[0] <= recency <= g[2] and g[1] <= efficiency <= g[3]):
            self._extremes = None
        scale = self._scale
        if scale is None:
            return
        value = self._scorer(recency, efficiency)
        front = self._front[b]
        if front is None:
            if value < self._best[b]:
                self._best[b] = value  # still a lower bound
        elif value < self._floor[b]:
            insort(front, (value, tie, slot))
            if len(front) > FRONT:
                floor = self._floor[b] = front.pop()[0]
                while front and front[-1][0] >= floor:  # the front holds only scores below its floor
                    front.pop()
            if front:
                self._best[b] = front[0][0]
            else:
                self._front[b] = None
                self._best[b] = self._floor[b]

    def _forget_slot(self, slot: int, recency: float, efficiency: float) -> None:
        """`slot`'s value is leaving: extremes it may have held, the block's front."""
        b = slot // self._block
        g = self._extremes
        if g is not None and (recency == g[0] or recency == g[2] or efficiency == g[1] or efficiency == g[3]):
            self._extremes = None
        self._stale.add(b)
        front = self._front[b]
        if front is None:
            return
        for i, entry in enumerate(front):
            if entry[2] == slot:
                del front[i]
                if i == 0:
                    if front:
                        self._best[b] = front[0][0]
                    else:  # nothing known below the floor: a bound again
                        self._front[b] = None
                        self._best[b] = self._floor[b]
                return

    def _make_room(self) -> None:
        if 2 * len(self._entries) <= len(self._keys):  # mostly dead: compact in place
            self._compact(self._cols.shape[1])
        else:
            self._compact(2 * self._cols.shape[1])

    def compact(self) -> None:
        """Drop dead slots and sort the live ones by recency (what keeps the bounds tight)."""
        self._compact(self._cols.shape[1])

    def _compact(self, capacity: int) -> None:
        live = sorted(self._entries.items(), key=lambda item: (item[1][1], item[1][0]))
        self._allocate(capacity)
        for slot, (key, (_, t, e, tie, payload)) in enumerate(live):
            self._keys.append(key)
            self._entries[key] = (slot, t, e, tie, payload)
        n = len(live)
        if n:
            self._cols[_T, :n] = [v[1] for _, v in live]
            self._cols[_E, :n] = [v[2] for _, v in live]
            self._tie[:n] = [v[3] for _, v in live]
        self._stale = set(range((n + self._block - 1) // self._block))

    def _refresh_extremes(self) -> None:
        for b in self._stale:
            start = b * self._block
            cols = self._cols[:, start:start + self._block]
            lo = cols.min(axis=1).tolist()
            if lo[_T] == _INF:  # no live slot left
                self._lo_t[b] = self._lo_e[b] = _INF
                self._hi_t[b] = self._hi_e[b] = -_INF
                continue
            hi = np.where(cols < _INF, cols, -_INF).max(axis=1).tolist()
            self._lo_t[b], self._lo_e[b], self._hi_t[b], self._hi_e[b] = lo[_T], lo[_E], hi[_T], hi[_E]
        self._stale.clear()

    # -- the choice ------------------------------------------------------------------------
    def lowest(self, alpha: float):
        """The key of the candidate with the lowest score (ties: lowest tie id), or None."""
        if not self._entries:
            return None
        used = (len(self._keys) + self._block - 1) // self._block
        g = self._extremes
        if g is None:
            self._refresh_extremes()
            g = self._extremes = (min(self._lo_t[:used]), min(self._lo_e[:used]),
                                  max(self._hi_t[:used]), max(self._hi_e[:used]))
        if alpha and not g[2] > g[0]:  # one recency: the block bounds would read dead slots as 0 * inf
            return self._lowest_degenerate(alpha, g)
        scale = score.scale(g[0], g[2], g[1], g[3], alpha)
        if scale != self._scale:  # every block back to its bound
            self._scale, self._scorer = scale, score.scorer(scale)
            self._best[:used] = self._scorer(np.array(self._lo_t[:used]), np.array(self._lo_e[:used]))
            self._front[:used] = [None] * used
        values = self._best[:used]
        while True:
            b = int(values.argmin())
            front = self._front[b]
            if front is None:
                if values[b] == _INF:
                    return None
                self._score_block(b)
                continue
            low = values[b]
            values[b] = _INF  # is the runner-up as low? (exact ties: the lowest tie id)
            unique = values.min() > low
            values[b] = low
            if unique:
                return self._keys[front[0][2]]
            ties = [int(t) for t in np.flatnonzero(values == low)]
            pending = [t for t in ties if self._front[t] is None]
            if pending:  # bounds equal to the best: score them, then look again
                for t in pending:
                    self._score_block(t)
                continue
            b = min(ties, key=lambda t: self._front[t][0][1])
            return self._keys[self._front[b][0][2]]

    def _score_block(self, b: int) -> None:
        """Score block `b` under the current scale: its front and floor."""
        start = b * self._block
        cols = self._cols[:, start:start + self._block]
        s = self._scorer(cols[_T], cols[_E])  # dead slots: +inf
        k = min(FRONT + 1, len(s))
        low = np.argpartition(s, k - 1)[:k] if k < len(s) else np.arange(len(s))
        entries = sorted(zip(s[low].tolist(), self._tie[start + low].tolist(), (start + low).tolist()))
        floor = entries[-1][0]  # nothing outside `low` scores below it
        if entries[0][0] == _INF:  # no live slot
            self._front[b], self._floor[b], self._best[b] = None, _INF, _INF
            return
        if len(entries) < k or floor == _INF:  # every live slot is in `low`
            floor = _INF
        front = [entry for entry in entries if entry[0] < floor]
        if not front:  # FRONT + 1 slots or more tie at the lowest score: take all of them
            at = np.flatnonzero(s == floor)
            front = sorted(zip([floor] * len(at), self._tie[start + at].tolist(), (start + at).tolist()))
            above = s[s > floor]
            floor = float(above.min()) if len(above) else _INF
        self._front[b], self._floor[b], self._best[b] = front, floor, front[0][0]

    def _lowest_degenerate(self, alpha: float, extremes):
        """All candidates have one recency (it cannot rank them): rank them directly, by
        `score.scorer` on each (in practice: one candidate)."""
        scorer = score.scorer(score.scale(extremes[0], extremes[2], extremes[1], extremes[3], alpha))
        best = min(self._entries.values(), key=lambda v: (scorer(v[1], v[2]), v[3]))
        return self._keys[best[0]]

"""Marconi's lowest-utility candidate in a changing set, without scoring every candidate per choice.

Contract: `lowest(alpha)` returns the key of the candidate with the lowest
`marconi_scores(recency, efficiency, alpha)` over the whole set, exact ties to the lowest tie id:
the candidate a from-scratch `marconi_scores` over all of them, sorted by (score, tie id), puts
first. Each candidate's score is computed with the same floating-point operations as there, so
the choice is the same bit for bit, not merely close.

How: candidates live in the slots of dense arrays, grouped in blocks of `block` slots; each block
keeps the extremes of both columns over its live slots. The min-max normalization reads the
global extremes off the block extremes; a block's lower bound is the score of (its oldest
recency, its lowest efficiency), never above any of its candidates' scores (the score is monotone
in both columns, and so is its floating-point evaluation). Blocks are scored in the order of their
bounds until the next bound exceeds the best score found. A candidate whose recency changes moves
to a fresh slot at the end: recency stamps only grow, so slots stay close to recency order, each
block spans a narrow range of recency and the bounds stay tight. Dead slots are compacted away
once they outnumber live ones (amortized O(1) per change).

Cost of a choice: O(slots / block) numpy work on the block extremes, plus scoring the blocks whose
bound is below the answer (usually one or two). Changes are O(1) amortized.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

BLOCK = 256
_INF = float("inf")


class RankedCandidates:
    """Keyed candidates (recency, efficiency, tie id, payload), lowest Marconi score on demand."""

    def __init__(self, block: int = BLOCK):
        self._block = block
        self._slot_of: dict[Any, int] = {}
        self._payload: dict[Any, Any] = {}
        self._allocate(4 * block)

    def _allocate(self, capacity: int) -> None:
        self._recency = np.full(capacity, _INF)
        self._efficiency = np.full(capacity, _INF)
        self._tie = np.zeros(capacity, dtype=np.int64)
        self._alive = np.zeros(capacity, dtype=bool)
        self._keys: list = []  # by slot; None where dead
        blocks = capacity // self._block
        self._lo_t, self._hi_t = np.full(blocks, _INF), np.full(blocks, -_INF)
        self._lo_e, self._hi_e = np.full(blocks, _INF), np.full(blocks, -_INF)
        self._stale_blocks: set[int] = set()  # extremes to recompute (a slot holding one died)

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key) -> bool:
        return key in self._slot_of

    def payload(self, key) -> Any:
        return self._payload[key]

    def entry(self, key) -> tuple[float, float, int]:
        slot = self._slot_of[key]
        return float(self._recency[slot]), float(self._efficiency[slot]), int(self._tie[slot])

    def keys(self) -> Iterator:
        return iter(self._slot_of)

    # -- changes ---------------------------------------------------------------------------
    def put(self, key, recency: float, efficiency: float, tie: int, payload: Any = None) -> None:
        """Add `key` or replace its entry."""
        self._payload[key] = payload
        slot = self._slot_of.get(key)
        if slot is not None and self._recency[slot] == recency:  # same recency: stays in place
            old = self._efficiency[slot]
            self._efficiency[slot] = efficiency
            self._tie[slot] = tie
            b = slot // self._block
            if old in (self._lo_e[b], self._hi_e[b]):
                self._stale_blocks.add(b)
            else:
                self._widen(b, recency, efficiency)
            return
        if slot is not None:
            self._kill(slot)
        self._append(key, recency, efficiency, tie)

    def set_recency(self, key, recency: float) -> None:
        """`key`'s recency only (no-op for an unknown key)."""
        slot = self._slot_of.get(key)
        if slot is None or self._recency[slot] == recency:
            return
        efficiency, tie = float(self._efficiency[slot]), int(self._tie[slot])
        self._kill(slot)
        self._append(key, recency, efficiency, tie)

    def remove(self, key) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._payload[key]
            self._kill(slot, keep_key=True)

    def _append(self, key, recency: float, efficiency: float, tie: int) -> None:
        if len(self._keys) == len(self._alive):
            self._make_room()
        slot = len(self._keys)
        self._keys.append(key)
        self._slot_of[key] = slot
        self._recency[slot] = recency
        self._efficiency[slot] = efficiency
        self._tie[slot] = tie
        self._alive[slot] = True
        self._widen(slot // self._block, recency, efficiency)

    def _widen(self, b: int, recency: float, efficiency: float) -> None:
        if recency < self._lo_t[b]:
            self._lo_t[b] = recency
        if recency > self._hi_t[b]:
            self._hi_t[b] = recency
        if efficiency < self._lo_e[b]:
            self._lo_e[b] = efficiency
        if efficiency > self._hi_e[b]:
            self._hi_e[b] = efficiency

    def _kill(self, slot: int, keep_key: bool = False) -> None:
        b = slot // self._block
        t, e = self._recency[slot], self._efficiency[slot]
        if t in (self._lo_t[b], self._hi_t[b]) or e in (self._lo_e[b], self._hi_e[b]):
            self._stale_blocks.add(b)
        self._alive[slot] = False
        self._recency[slot] = _INF
        self._efficiency[slot] = _INF
        key = self._keys[slot]
        self._keys[slot] = None
        if not keep_key and self._slot_of.get(key) == slot:
            del self._slot_of[key]

    def _make_room(self) -> None:
        live = len(self._slot_of)
        if 2 * live <= len(self._keys):  # mostly dead: compact in place
            self._compact(len(self._alive))
        else:
            self._compact(2 * len(self._alive))

    def _compact(self, capacity: int) -> None:
        keep = np.flatnonzero(self._alive[: len(self._keys)])
        recency, efficiency, tie = self._recency[keep], self._efficiency[keep], self._tie[keep]
        keys = [self._keys[i] for i in keep]
        self._allocate(capacity)
        n = len(keys)
        self._recency[:n], self._efficiency[:n], self._tie[:n] = recency, efficiency, tie
        self._alive[:n] = True
        self._keys = keys
        self._slot_of = {key: slot for slot, key in enumerate(keys)}
        self._stale_blocks = set(range((n + self._block - 1) // self._block))

    def _refresh_blocks(self) -> None:
        for b in self._stale_blocks:
            span = slice(b * self._block, (b + 1) * self._block)
            alive = self._alive[span]
            if not alive.any():
                self._lo_t[b] = self._lo_e[b] = _INF
                self._hi_t[b] = self._hi_e[b] = -_INF
                continue
            t, e = self._recency[span], self._efficiency[span]  # dead slots hold +inf
            self._lo_t[b], self._lo_e[b] = t.min(), e.min()
            self._hi_t[b], self._hi_e[b] = t[alive].max(), e[alive].max()
        self._stale_blocks.clear()

    # -- the choice ------------------------------------------------------------------------
    def lowest(self, alpha: float):
        """The key of the candidate with the lowest score (ties: lowest tie id), or None."""
        if not self._slot_of:
            return None
        self._refresh_blocks()
        used = (len(self._keys) + self._block - 1) // self._block
        lo_t, hi_t = self._lo_t[:used], self._hi_t[:used]
        lo_e, hi_e = self._lo_e[:used], self._hi_e[:used]
        t0, e0 = lo_t.min(), lo_e.min()
        span_t, span_e = hi_t.max() - t0, hi_e.max() - e0
        weigh_e = bool(alpha) and span_e > 0

        def scores(t, e):  # marconi_scores' arithmetic, element by element
            s = (t - t0) / span_t if span_t > 0 else np.zeros(len(t))
            if weigh_e:
                s += alpha * ((e - e0) / span_e)
            return s

        bounds = scores(lo_t, lo_e)
        bounds[lo_t == _INF] = _INF  # empty blocks
        best, best_tie, best_slot = _INF, None, None
        while True:
            b = int(bounds.argmin())
            bound = bounds[b]
            if bound == _INF or bound > best:
                break
            bounds[b] = _INF
            span = slice(b * self._block, (b + 1) * self._block)
            s = np.where(self._alive[span], scores(self._recency[span], self._efficiency[span]), _INF)
            low = s.min()
            if low > best:
                continue
            ties = np.flatnonzero(s == low)
            j = int(ties[self._tie[span][ties].argmin()])
            tie = int(self._tie[span][j])
            if low < best or tie < best_tie:
                best, best_tie, best_slot = low, tie, b * self._block + j
        return self._keys[best_slot]

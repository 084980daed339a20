"""Struct-of-arrays index of eviction candidates, scored with numpy.

Marconi's utility (Eq. 2) min-max normalizes recency and FLOP efficiency over the current
candidates, so every eviction needs the extremes of both columns; keeping them dense in two
float arrays makes that one vectorized pass instead of a walk over the tree. Removal swaps the
last entry into the hole so the arrays stay dense.

Every choice is a function of the candidates' values and tie keys alone, never of their slots:
the ranks of a TP / PP group hold the same candidates in different slots (one that rebuilt its
index after a fault fills them in another order), and must still pick the same victim.
- Scores are computed element by element (`(t - lo_t) * w_t + (e - lo_e) * w_e`, each operation
  rounded on its own), so a candidate's score does not depend on where it sits; a BLAS dot may
  fuse or reorder operations differently in its vector body and its tail.
- Among candidates with exactly the lowest score, the smallest tie key wins: `tie_key(item)`, an
  int or a tuple of ints that every rank computes identically (a node's id: SGLang numbers its
  nodes in creation order, which the request stream fixes). Without `tie_key`, an item's `id`
  attribute is its key (every node class here has one), and an item without one is keyed by the
  order in which it was added (deterministic for one history of adds, not across a rebuild).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional, Union

import numpy as np

TieKey = Union[int, tuple]


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


def utility_weights(lo_t: float, hi_t: float, lo_e: float, hi_e: float, alpha: float):
    """(w_t, w_e) with norm(t) + alpha * norm(e) = w_t (t - lo_t) + w_e (e - lo_e); 0 for a column
    whose span is 0. Exact ties (common: with alpha = 1 the oldest, most efficient candidate and
    the newest, least efficient one both score 1) go to the older candidate: recency's weight is
    raised by a relative 1e-12, far below any real score difference. None where a span is
    subnormal (a weight overflows): divide instead, as the reference does."""
    w_t = (1.0 + _TIE_BREAK) / (hi_t - lo_t) if hi_t > lo_t else 0.0
    w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
    if math.isinf(w_t) or math.isinf(w_e):
        return None
    return w_t, w_e


def weighted_scores(columns: np.ndarray, lo, weights) -> np.ndarray:
    """Each candidate's utility under `weights` (`utility_weights`) from its two columns (rows of
    `columns`), element by element: exactly the Python expression `w_t * (t - lo_t) + w_e * (e - lo_e)`,
    each operation rounded on its own."""
    terms = columns - np.asarray(lo)[:, None]
    terms *= np.asarray(weights)[:, None]
    return terms[0] + terms[1]


class CandidateIndex:
    """Candidates with their recency and FLOP efficiency, dense in the two rows of one array, and
    their tie keys in a parallel int64 array (one row per element of a tuple key)."""

    # The tie key of a tree's nodes: `CandidateIndex(tie_key=CandidateIndex.node_id)`.
    node_id = operator.attrgetter("id")

    def __init__(self, initial_capacity: int = 1024, tie_key: Optional[Callable[[Any], TieKey]] = None):
        if initial_capacity < 1:
            raise ValueError(f"initial_capacity {initial_capacity!r}: expected at least 1")
        if tie_key is not None and not callable(tie_key):
            raise TypeError(f"tie_key {tie_key!r}: expected a callable item -> int or tuple of ints")
        self._columns = np.zeros((2, initial_capacity))  # row 0: recency, row 1: efficiency
        self._keys = np.zeros((1, initial_capacity), dtype=np.int64)  # rows: the key's elements
        self._key0 = self._keys[0]  # its first row (a 1-D store is the cheaper one)
        self._key_width: Optional[int] = None  # fixed by the first key: 1 for an int, else tuple length
        self._tie_key = tie_key
        self._adds = 0  # the fallback key of an item without an `id`
        self.items: list[Any] = []

    @property
    def last_access(self) -> np.ndarray:
        return self._columns[0]

    @property
    def efficiency(self) -> np.ndarray:
        return self._columns[1]

    def __len__(self) -> int:
        return len(self.items)

    def key_of(self, item: Any) -> TieKey:
        """`item`'s tie key: `tie_key(item)`, else its `id`, else the order of its add."""
        if self._tie_key is not None:
            return self._tie_key(item)
        key = getattr(item, "id", None)
        if key is None:
            key = self._adds
            self._adds += 1
        return key

    def _key_row(self, item: Any, key: TieKey) -> tuple:
        """The key as a tuple of ints of the index's width (fixed by the first key)."""
        row = (key,) if isinstance(key, (int, np.integer)) else key
        if not isinstance(row, tuple) or not all(isinstance(k, (int, np.integer)) for k in row) or not row:
            raise ValueError(f"tie key {key!r} of {item!r}: expected an int or a non-empty tuple of ints")
        if self._key_width is None:
            self._key_width = len(row)
            if len(row) != 1:
                self._keys = np.zeros((len(row), self._columns.shape[1]), dtype=np.int64)
                self._key0 = self._keys[0]
        elif len(row) != self._key_width:
            raise ValueError(f"tie key {key!r} of {item!r}: expected {self._key_width} element(s), as the first key")
        return row

    def add(self, item: Any, last_access: float, efficiency: float) -> int:
        slot = len(self.items)
        key = self.key_of(item)
        if type(key) is not int or self._key_width != 1:
            key = self._key_row(item, key)
        if slot == self._columns.shape[1]:
            self._grow(2 * slot)
        try:  # the key first: a bad one leaves the index as it was
            if type(key) is int:
                self._key0[slot] = key
            else:
                self._keys[:, slot] = key
        except OverflowError:
            raise ValueError(f"tie key {key!r} of {item!r}: beyond 64-bit integers") from None
        self.items.append(item)
        self._columns[0, slot] = last_access
        self._columns[1, slot] = efficiency
        return slot

    def _grow(self, capacity: int) -> None:
        n = len(self.items)
        grown = np.zeros((2, capacity))
        grown[:, :n] = self._columns[:, :n]
        self._columns = grown
        keys = np.zeros((self._keys.shape[0], capacity), dtype=np.int64)
        keys[:, :n] = self._keys[:, :n]
        self._keys, self._key0 = keys, keys[0]

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
            if self._key_width == 1:
                keys = self._key0
                keys[slot] = keys[last]
            else:
                self._keys[:, slot] = self._keys[:, last]
        self.items.pop()
        return moved

    def least_key(self, slots: np.ndarray) -> int:
        """Of `slots` (a non-empty int array), the one holding the smallest tie key."""
        keys = self._keys[:, slots]
        if keys.shape[0] == 1:
            return int(slots[keys[0].argmin()])
        return int(slots[np.lexsort(keys[::-1])[0]])

    def tie_key_at(self, slot: int) -> tuple:
        return tuple(self._keys[:, slot].tolist())

    def _first_of_equals(self, values: np.ndarray, slot: int) -> int:
        """`slot` holds the minimum of `values`: among the slots holding exactly that value, the one
        with the smallest tie key (a count of equals; the keys are read only on a tie)."""
        equal = values == values[slot]
        if np.count_nonzero(equal) == 1:
            return slot
        return self.least_key(np.flatnonzero(equal))

    def scores(self, alpha: float) -> np.ndarray:
        """Every candidate's utility as `lowest` ranks them, by slot (alpha = 0: its recency, a view:
        read only)."""
        n = len(self.items)
        columns = self._columns[:, :n]
        if not alpha:
            return columns[0]
        lo = columns.min(axis=1)
        (lo_t, lo_e), (hi_t, hi_e) = lo.tolist(), columns.max(axis=1).tolist()
        weights = utility_weights(lo_t, hi_t, lo_e, hi_e, alpha)
        if weights is None:
            return marconi_scores(columns[0], columns[1], alpha)
        return weighted_scores(columns, lo, weights)

    def lowest(self, alpha: float) -> Any:
        """The candidate with the lowest Marconi utility (alpha = 0 is LRU): the same ranking as
        `marconi_scores` (`utility_weights`: exact ties to the older candidate), the remaining
        exact ties to the smallest tie key. (This runs once per evicted node: a few numpy calls.)"""
        scores = self.scores(alpha)
        return self.items[self._first_of_equals(scores, int(scores.argmin()))]


def keep(index: CandidateIndex, slots: dict, item: Any, row: Optional[tuple]) -> None:
    """Make `item` (keyed by its `id` in `slots`, id -> slot) a candidate of `index` with the
    columns `row`, or, with `row` None, no candidate: add, update or remove, keeping `slots` in
    step with the swap that `remove` makes."""
    slot = slots.get(item.id)
    if row is None:
        if slot is not None:
            del slots[item.id]
            moved = index.remove(slot)
            if moved is not None:
                slots[moved.id] = slot
    elif slot is None:
        slots[item.id] = index.add(item, *row)
    else:
        index.update(slot, *row)


def lowest_across(indexes, alpha: float):
    """The lowest-utility candidate over several indexes, each column min-max normalized over
    their union (the cross-kind byte-budget choice: KV leaves and SSM states in one ranking).
    Reads each index's extremes and scores in place, never concatenating them. Returns
    `(position of the index, item)`, or None when all are empty; exact ties go to the older
    candidate, as in `CandidateIndex.lowest`, then to the smallest tie key, then (one item in
    two indexes) to the earlier index."""
    live = [(i, index._columns[:, :len(index)]) for i, index in enumerate(indexes) if len(index)]
    if not live:
        return None
    if alpha:
        lo_t = min(float(cols[0].min()) for _, cols in live)
        hi_t = max(float(cols[0].max()) for _, cols in live)
        lo_e = min(float(cols[1].min()) for _, cols in live)
        hi_e = max(float(cols[1].max()) for _, cols in live)
        weights = utility_weights(lo_t, hi_t, lo_e, hi_e, alpha)

    def scores_of(cols):
        if not alpha:
            return cols[0]
        if weights is not None:
            return weighted_scores(cols, (lo_t, lo_e), weights)
        scores = (cols[0] - lo_t) / (hi_t - lo_t) if hi_t > lo_t else np.zeros(cols.shape[1])
        return scores + alpha * (cols[1] - lo_e) / (hi_e - lo_e) if hi_e > lo_e else scores

    best = None  # (score, tie key, index position, slot)
    for i, cols in live:
        scores = scores_of(cols)
        j = int(scores.argmin())
        score = float(scores[j])
        if best is not None and score > best[0]:
            continue
        j = indexes[i]._first_of_equals(scores, j)
        candidate = (score, indexes[i].tie_key_at(j), i, j)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return best[2], indexes[best[2]].items[best[3]]

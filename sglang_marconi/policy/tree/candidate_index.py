"""Struct-of-arrays index of eviction candidates, scored with numpy.

Marconi's utility (Eq. 2) min-max normalizes recency and FLOP efficiency over the current
candidates, so every eviction needs the extremes of both columns; keeping them dense in two
float arrays makes that one vectorized pass instead of a walk over the tree. Removal swaps the
last entry into the hole so the arrays stay dense.

The score and its one tie-break are `policy/rules/score.py`'s (called, never copied): every
choice is a function of the candidates' values and tie keys alone, never of their slots, since
the ranks of a TP / PP group hold the same candidates in different slots (one that rebuilt its
index after a fault fills them in another order) and must still pick the same victim. A
candidate's tie key is `tie_key(item)`, an int or a tuple of ints that every rank computes
identically (a node's id: SGLang numbers its nodes in creation order, which the request stream
fixes). Without `tie_key`, an item's `id` attribute is its key (every node class here has one),
and an item without one is keyed by the order in which it was added (deterministic for one
history of adds, not across a rebuild).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Union

import numpy as np

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.tree.own_code import own_copies

TieKey = Union[int, tuple]
# Up to this many candidates a weighted choice scores plain Python floats (`score.score_each`)
# rather than numpy arrays: a handful of list operations cost less than numpy's calls.
LIST_SCORED = 32


class CandidateIndex:
    """Candidates with their recency and FLOP efficiency, dense in the two rows of one array, and
    their tie keys in a parallel int64 array (one row per element of a tuple key)."""

    # The tie key of a tree's nodes: `CandidateIndex(tie_key=CandidateIndex.node_id)`.
    node_id = operator.attrgetter("id")
    # What every eviction runs: each index class runs its own copy (`own_code.py`).
    _hot_methods = ("lowest", "scale", "key_of")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own_copies(cls, cls._hot_methods)

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
        self._lists: Optional[tuple] = None  # a subclass keeping its columns as lists: (recency, value)

    @property
    def last_access(self) -> np.ndarray:
        return self._columns[0]

    @property
    def efficiency(self) -> np.ndarray:
        return self._columns[1]

    def recencies(self) -> np.ndarray:
        """Every entry's recency, in slot order (not to be written to)."""
        return self._columns[0, : len(self.items)]

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

    def scale(self, alpha: float) -> score.Scale:
        """The score's scale over the current candidates (`score.scale`)."""
        if not alpha:
            return score.LRU_SCALE
        columns = self._columns[:, :len(self.items)]
        (lo_t, lo_e), (hi_t, hi_e) = columns.min(axis=1).tolist(), columns.max(axis=1).tolist()
        return score.scale(lo_t, hi_t, lo_e, hi_e, alpha)

    def scores(self, alpha: float) -> np.ndarray:
        """Every candidate's score (`score.scorer`), by slot (alpha = 0: its recency, a view:
        read only)."""
        columns = self._columns[:, :len(self.items)]
        return score.scorer(self.scale(alpha))(columns[0], columns[1])

    def lowest(self, alpha: float) -> Any:
        """The candidate with the lowest score (alpha = 0 is LRU), exact ties to the smallest tie
        key (`score.lowest_slot`). (This runs once per evicted node: at alpha = 0 a few numpy
        calls; weighted, a small index is scored as lists, cheaper than the numpy calls.)"""
        n = len(self.items)
        lists = self._lists
        if n <= LIST_SCORED and (lists is not None or alpha):
            # as lists (`score.score_each`: each score the numpy scorer's, bit for bit)
            recency, value = lists if lists is not None else self._columns[:, :n].tolist()
            scores = score.score_each(score.scale(min(recency), max(recency), min(value), max(value), alpha),
                                      recency, value) if alpha else recency
        else:
            scores = self.scores(alpha)
        return self.items[score.lowest_slot(scores, self.least_key)]


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
    """The lowest-scoring candidate over several indexes, each column min-max normalized over
    their union (the cross-kind byte-budget choice: KV leaves and SSM states in one ranking).
    Reads each index's extremes and scores in place, never concatenating them. Returns
    `(position of the index, item)`, or None when all are empty; exact ties go to the smallest
    tie key (`score.lowest_slot` within an index, then across them), then (one item in two
    indexes) to the earlier index."""
    live = [(i, index._columns[:, :len(index)]) for i, index in enumerate(indexes) if len(index)]
    if not live:
        return None
    scale = score.LRU_SCALE
    if alpha:
        scale = score.scale(min(float(cols[0].min()) for _, cols in live), max(float(cols[0].max()) for _, cols in live),
                            min(float(cols[1].min()) for _, cols in live), max(float(cols[1].max()) for _, cols in live),
                            alpha)
    scorer = score.scorer(scale)
    best = None  # (score, tie key, index position, slot)
    for i, cols in live:
        scores = scorer(cols[0], cols[1])
        j = score.lowest_slot(scores, indexes[i].least_key)
        candidate = (float(scores[j]), indexes[i].tie_key_at(j), i, j)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return best[2], indexes[best[2]].items[best[3]]

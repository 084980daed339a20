"""`CandidateIndex` for the shadow caches: the same entries in the same slots, so that every
victim is the one `CandidateIndex.lowest` picks, for less per operation.

- The columns and tie keys live in Python lists (a store is cheaper than a numpy scalar store).
  The numpy arrays that `CandidateIndex.lowest` scores are kept in step only while the index is
  large (from SMALL entries up, down to half that), and built from the lists when a small index
  needs them (a subnormal span, below): same values, same slots.
- `lowest` on a few candidates (a contended cache holds a handful: the shadows of a 1 GB cache
  hold about six) scores the lists themselves, as `CandidateIndex.lowest` scores a small index
  (`score.score_each`, `scorer` over lists, `score.lowest_slot` over the list): each score is
  the numpy scorer's bit for bit (the rule rounds each operation on its own, in Python as in
  numpy), exact ties to the smallest tie key.
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.tree.candidate_index import LIST_SCORED, CandidateIndex

SMALL = LIST_SCORED  # up to this many candidates the Python scores are cheaper than numpy's calls


class SmallCandidateIndex(CandidateIndex):
    def __init__(self, initial_capacity: int = 64, tie_key=None):
        super().__init__(initial_capacity, tie_key)
        self.recency: list[float] = []  # the two columns and the tie keys, slot by slot
        self.value: list[float] = []
        self.keys: list = []  # ints, or tuples of ints
        self._lists = (self.recency, self.value)  # scored as they are while small (`CandidateIndex.lowest`)
        self._mirrored = False  # whether the numpy arrays (`_t`, `_e`, `_keys`) are kept in step

    @property
    def last_access(self) -> np.ndarray:
        return np.array(self.recency)

    @property
    def efficiency(self) -> np.ndarray:
        return np.array(self.value)

    def recencies(self) -> np.ndarray:
        return self._t[: len(self.items)] if self._mirrored else np.array(self.recency, dtype=float)

    def _mirror(self) -> None:
        n = len(self.items)
        capacity = max(2 * n, 64)
        self._columns = np.zeros((2, capacity))
        self._columns[0, :n] = self.recency
        self._columns[1, :n] = self.value
        self._keys = np.zeros((self._key_width or 1, capacity), dtype=np.int64)
        if n:
            self._keys[:, :n] = np.array(self.keys, dtype=np.int64).reshape(n, -1).T
        self._key0 = self._keys[0]
        self._t, self._e = self._columns[0], self._columns[1]
        self._mirrored = True

    def add(self, item, last_access: float, efficiency: float) -> int:
        items = self.items
        slot = len(items)
        tie_key = self._tie_key
        key = self.key_of(item) if tie_key is None else tie_key(item)
        if type(key) is not int or self._key_width != 1:
            row = self._key_row(item, key)
            key = row[0] if len(row) == 1 else row
        items.append(item)
        self.recency.append(last_access)
        self.value.append(efficiency)
        self.keys.append(key)
        if self._mirrored:
            if slot == self._columns.shape[1]:
                self._mirror()
            else:
                self._t[slot] = last_access
                self._e[slot] = efficiency
                self._keys[:, slot] = key
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
        items, recency, value, keys = self.items, self.recency, self.value, self.keys
        # The last entry fills the hole: pop it, and store it at `slot` unless it was that slot.
        moved = items.pop()
        t, e, key = recency.pop(), value.pop(), keys.pop()
        last = len(items)
        if slot == last:
            moved = None
        else:
            items[slot] = moved
            recency[slot] = t
            value[slot] = e
            keys[slot] = key
            if self._mirrored:
                self._t[slot] = self._t[last]
                self._e[slot] = self._e[last]
                self._keys[:, slot] = self._keys[:, last]
        if self._mirrored and last <= SMALL // 2:
            self._mirrored = False
        return moved

    def least_key(self, slots) -> int:
        keys = self.keys
        return int(min(slots, key=lambda slot: keys[slot]))

    def tie_key_at(self, slot: int) -> tuple:
        key = self.keys[slot]
        return key if isinstance(key, tuple) else (key,)

    def scores(self, alpha: float) -> np.ndarray:
        if not self._mirrored:
            self._mirror()
            self._mirrored = False  # a snapshot for this call only
        return super().scores(alpha)


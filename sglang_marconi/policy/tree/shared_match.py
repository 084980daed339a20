"""One request's tokens, compared once for all the shadow caches that walk their trees with it.

A shadow cache's edge does not copy its tokens: it references the token array of the request that
admitted them (`src`) and the absolute positions [start, end) (`shadow_cache.py`). Any request
whose path runs through an edge holds that path as its own prefix, so whether the current request
still agrees with an edge is a question about two token arrays at the same positions, and its
answer is the same in every shadow holding an edge from that source. `SharedMatch` answers it once
per (request, source) and remembers it; every later walk, in any shadow, gets it for a dict lookup.
Seven shadows walking a 20k-token request thus compare its tokens about once instead of 4 x 7
times (a lookup walk, an admission walk and one per admitted state, in each shadow).
"""

from __future__ import annotations

import numpy as np


class _PageKeys(dict):
    """pos -> the child key of the page starting at `pos` (as `RadixTree._key` computes it), each
    computed once: a remembered key is read without a Python call."""

    __slots__ = ("seq", "page_size")

    def __missing__(self, pos: int):
        seq = self.seq
        key = self[pos] = int(seq[pos]) if self.page_size == 1 else seq[pos : pos + self.page_size].tobytes()
        return key


class SharedMatch:
    __slots__ = ("seq", "input_len", "page_size", "keys", "_agreed")

    def __init__(self, seq: np.ndarray, input_len: int, page_size: int):
        self.seq = seq  # input + output (int64)
        self.input_len = input_len
        self.page_size = page_size
        self.keys = _PageKeys()  # `keys[pos]`: `key(pos)`
        self.keys.seq, self.keys.page_size = seq, page_size
        # id(src) -> [src, positions known to agree (from 0), first disagreeing position or -1]; the
        # entry holds src so that no id is reused while this request is matched
        self._agreed: dict[int, list] = {}

    def key(self, pos: int):
        """The child key of the page starting at `pos` (as `RadixTree._key` computes it)."""
        return self.keys[pos]

    def agreed_end(self, src: np.ndarray, pos: int, limit: int) -> int:
        """The first position in [pos, limit) where this request and `src` differ, or `limit` if
        none does; the caller knows they agree on [0, pos) (it walked there). limit <= len(src)."""
        if src is self.seq:
            return limit
        entry = self._agreed.get(id(src))
        if entry is None:
            entry = self._agreed[id(src)] = [src, pos, -1]
        elif entry[2] >= 0:
            return entry[2] if entry[2] < limit else limit
        elif entry[1] >= limit:
            return limit
        agreed = entry[1] if entry[1] > pos else pos
        same = self.seq[agreed:limit] == src[agreed:limit]
        if same.all():
            entry[1] = limit
            return limit
        entry[2] = first = agreed + int(same.argmin())
        return first

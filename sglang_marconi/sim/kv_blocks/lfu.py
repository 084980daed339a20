"""kv-lfu: evict the block with the lowest access count; ties go to the least recently used.

A block's count is the number of accesses since it was last admitted (1 on admission): counts
are lost on eviction, so a re-admitted block starts again at 1 (no history is kept for blocks
that are not resident). Blocks sit in one LRU-ordered bucket per count, so an access and an
eviction are O(1).
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_marconi.sim.kv_blocks.base import BlockCache


class LFUBlockCache(BlockCache):
    name = "kv-lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.resident: dict = {}  # hash id -> access count
        self._buckets: dict[int, OrderedDict] = {}  # count -> its blocks, least recently used first
        self._min = 0  # lowest count of a resident block (valid whenever the cache is non-empty)

    def access(self, h) -> bool:
        counts, buckets = self.resident, self._buckets
        count = counts.get(h)
        if count is not None:
            bucket = buckets[count]
            del bucket[h]
            if not bucket:
                del buckets[count]
                if self._min == count:
                    self._min = count + 1
            counts[h] = count + 1
            nxt = buckets.get(count + 1)
            if nxt is None:
                nxt = buckets[count + 1] = OrderedDict()
            nxt[h] = None
            return True
        if len(counts) >= self.capacity:
            bucket = buckets[self._min]
            victim, _ = bucket.popitem(last=False)
            if not bucket:
                del buckets[self._min]
            del counts[victim]
            self.evictions += 1
        counts[h] = 1
        ones = buckets.get(1)
        if ones is None:
            ones = buckets[1] = OrderedDict()
        ones[h] = None
        self._min = 1
        return False

    def blocks(self) -> list:
        """Resident blocks in eviction order: by count, then least recently used first."""
        return [h for count in sorted(self._buckets) for h in self._buckets[count]]

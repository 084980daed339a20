"""kv-lru: evict the least recently accessed block."""

from __future__ import annotations

from collections import OrderedDict

from sglang_marconi.sim.kv_blocks.base import BlockCache


class LRUBlockCache(BlockCache):
    name = "kv-lru"
    _refresh_on_hit = True  # False: FIFO (`fifo.FIFOBlockCache`)

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.resident: OrderedDict = OrderedDict()  # next victim first

    def access(self, h) -> bool:
        resident = self.resident
        if h in resident:
            if self._refresh_on_hit:
                resident.move_to_end(h)
            return True
        if len(resident) >= self.capacity:
            resident.popitem(last=False)
            self.evictions += 1
        resident[h] = None
        return False

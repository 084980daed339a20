"""kv-fifo: evict the block admitted longest ago; hits change nothing."""

from __future__ import annotations

from sglang_marconi.sim.kv_blocks.lru import LRUBlockCache


class FIFOBlockCache(LRUBlockCache):
    """LRU's queue without the refresh on a hit: admission order is eviction order."""

    name = "kv-fifo"
    _refresh_on_hit = False

"""kv-s3fifo: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23),
as the block-hash trace replay tools state it.

- S, the small FIFO queue, holds ``small_cap = round(capacity * small_ratio)`` blocks (Python's
  `round`: halves go to the even integer, so 25 blocks at 0.1 give 2, 35 give 4); M, the main
  FIFO queue, the other ``capacity - small_cap``; G, the ghost FIFO, remembers up to
  ``capacity - small_cap`` evicted hash ids (metadata only: a ghost is never resident and never
  counts towards the capacity or `final_cache_blocks`).
- Every resident block has a frequency, saturating at `max_freq`: +1 on every access that hits it.
- A miss on a hash id in G is a ghost hit: the id leaves G and the block is admitted at M's tail
  with frequency 0. Any other miss is admitted at S's tail with frequency 0.
- Admitting to S while S is full first drains S from its head (until it has room): a head with
  frequency >= 1 moves to M's tail with its frequency kept, one with frequency 0 is evicted to G.
- Admitting to M while M is full (a ghost hit or a block moved from S) first drains M by second
  chance: a head with frequency >= 1 is decremented and requeued at M's tail; the first head with
  frequency 0 is evicted to G, and that one real eviction ends the drain.
- Evicting to G an id G already holds moves it to G's tail; a full G forgets its head. (A ghost
  hit takes the id out of G, so with these rules an evicted block is never already in G; the rule
  is kept for completeness.)

Both queues need at least one block: capacities where `round(capacity * small_ratio)` is 0 or
equals the capacity are refused. libCacheSim's S3FIFO is a different variant (one shared
capacity, truncated sizes, promotion threshold 2 with the frequency reset, no ghost for M's
victims); `tests/test_kv_blocks_libcachesim.py` lists and checks the differences.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.kv_blocks.base import BlockCache


class S3FIFOBlockCache(BlockCache):
    name = "kv-s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, max_freq: int = 3):
        super().__init__(capacity)
        self.check_params(small_ratio=small_ratio, max_freq=max_freq)
        self.small_ratio, self.max_freq = small_ratio, max_freq
        self.small_cap = round(capacity * small_ratio)
        self.main_cap = self.ghost_cap = capacity - self.small_cap
        if self.small_cap < 1 or self.main_cap < 1:
            raise MarconiError(
                f"kv-s3fifo at {capacity} blocks with small_ratio={small_ratio}: small queue "
                f"round({capacity} * {small_ratio}) = {self.small_cap} blocks, main queue {self.main_cap}; "
                f"both need at least 1 (at this ratio, capacity >= {_min_capacity(small_ratio)} blocks)"
            )
        self.resident: dict = {}  # hash id -> frequency, for the blocks in S and M
        self.small: OrderedDict = OrderedDict()  # head (next out) first
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()

    @classmethod
    def check_params(cls, small_ratio: float = 0.1, max_freq: int = 3) -> None:
        if isinstance(small_ratio, bool) or not isinstance(small_ratio, (int, float)) or not 0 < small_ratio < 1:
            raise MarconiError(f"kv-s3fifo: small_ratio must be in (0, 1), got {small_ratio!r}")
        if isinstance(max_freq, bool) or not isinstance(max_freq, int) or max_freq < 1:
            raise MarconiError(f"kv-s3fifo: max_freq must be an integer >= 1, got {max_freq!r}")

    def access(self, h) -> bool:
        freq = self.resident.get(h)
        if freq is not None:
            if freq < self.max_freq:
                self.resident[h] = freq + 1
            return True
        if h in self.ghost:
            del self.ghost[h]
            self._admit_main(h, 0)
        else:
            self._admit_small(h)
        return False

    def _admit_small(self, h) -> None:
        small, resident = self.small, self.resident
        while len(small) >= self.small_cap:
            head, _ = small.popitem(last=False)
            freq = resident[head]
            if freq >= 1:
                self._admit_main(head, freq)
            else:
                self._evict(head)
        small[h] = None
        resident[h] = 0

    def _admit_main(self, h, freq: int) -> None:
        main, resident = self.main, self.resident
        while len(main) >= self.main_cap:
            head, _ = main.popitem(last=False)
            head_freq = resident[head]
            if head_freq >= 1:
                resident[head] = head_freq - 1
                main[head] = None
            else:
                self._evict(head)
        main[h] = None
        resident[h] = freq

    def _evict(self, h) -> None:
        del self.resident[h]
        self.evictions += 1
        ghost = self.ghost
        if h in ghost:
            ghost.move_to_end(h)
            return
        ghost[h] = None
        if len(ghost) > self.ghost_cap:
            ghost.popitem(last=False)

    def blocks(self) -> list:
        """Resident blocks: S head to tail, then M head to tail (never the ghost)."""
        return [*self.small, *self.main]


def _min_capacity(small_ratio: float) -> int:
    """The smallest capacity whose small and main queues both get at least one block."""
    capacity = max(1, math.floor(0.5 / min(small_ratio, 1 - small_ratio)) - 2)
    while not 1 <= round(capacity * small_ratio) <= capacity - 1:
        capacity += 1
    return capacity

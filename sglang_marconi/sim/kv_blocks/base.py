"""The interface every block-level KV cache policy implements."""

from __future__ import annotations

from typing import Hashable

from sglang_marconi.policy.errors import MarconiError


class BlockCache:
    """A cache of at most `capacity` blocks, each named by its hash id.

    `resident` is a container of the resident hash ids (`h in cache.resident` changes nothing);
    `access(h)` is one access: True on a hit (the policy updates its state), False on a miss
    (the block is admitted, evicting as the policy decides). `evictions` counts blocks evicted.
    """

    name: str = ""
    resident: object

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise MarconiError(f"{self.name}: capacity must be a positive number of blocks, got {capacity!r}")
        self.capacity = capacity
        self.evictions = 0

    def access(self, h: Hashable) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.resident)

    def blocks(self) -> list:
        """The resident hash ids (in the policy's own order: eviction order where it has one)."""
        return list(self.resident)

    @classmethod
    def check_params(cls, **params) -> None:
        """Raise MarconiError naming a bad parameter (before any capacity is known)."""

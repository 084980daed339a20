"""Eviction policies, one per module, all behind `EvictionPolicy`."""

from sglang_marconi.policy.eviction.base import EvictionPolicy
from sglang_marconi.policy.eviction.flop_aware import FlopAwareEviction
from sglang_marconi.policy.eviction.lru_leaves import LruLeafEviction

__all__ = ["EvictionPolicy", "FlopAwareEviction", "LruLeafEviction"]

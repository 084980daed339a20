"""Eviction policies, one per module, all behind `EvictionPolicy`."""

from sglang_marconi.policy.eviction.base import EvictionPolicy
from sglang_marconi.policy.eviction.coverage import CoverageEviction
from sglang_marconi.policy.eviction.flop_aware import FlopAwareEviction
from sglang_marconi.policy.eviction.lru_leaves import LruLeafEviction
from sglang_marconi.policy.eviction.seglen import SegLenEviction

__all__ = ["CoverageEviction", "EvictionPolicy", "FlopAwareEviction", "LruLeafEviction", "SegLenEviction"]

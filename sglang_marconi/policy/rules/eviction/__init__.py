"""Eviction policies, one per module, all behind `EvictionPolicy`."""

from sglang_marconi.policy.rules.eviction.base import EvictionPolicy
from sglang_marconi.policy.rules.eviction.coverage import CoverageEviction
from sglang_marconi.policy.rules.eviction.depth import CalibratedDepthEviction, DepthEviction
from sglang_marconi.policy.rules.eviction.flop_aware import FlopAwareEviction
from sglang_marconi.policy.rules.eviction.lru_leaves import LruLeafEviction
from sglang_marconi.policy.rules.eviction.seglen import SegLenEviction

__all__ = ["CalibratedDepthEviction", "CoverageEviction", "DepthEviction", "EvictionPolicy", "FlopAwareEviction",
           "LruLeafEviction", "SegLenEviction"]

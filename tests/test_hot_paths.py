"""The request path's per-configuration code (`policy/tree/own_code.py`): each cache configuration
runs its own copy of the core's hot methods, behaving as the core's; a shadow keeps its attributes
where CPython caches their lookups; an admission counts the states it adds without evicting for
states already cached."""

import sys

import numpy as np
import pytest
from toy_profile import ToyProfile

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.tree.core import PoolTree, TreeCore
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tree.own_code import origin
from sglang_marconi.policy.tree.served_cache import ServedCache
from sglang_marconi.policy.tree.shadow_cache import ShadowCache
from sglang_marconi.policy.tree.shared_match import SharedMatch
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex
from sglang_marconi.policy.tuning.shadow_tuner import _SharedShadow, eviction_for

TOY = ToyProfile()
CONFIGURATIONS = [HybridPrefixCache, ShadowCache, _SharedShadow, PoolTree, ServedCache]


@pytest.mark.parametrize("cls", CONFIGURATIONS)
def test_each_configuration_runs_its_own_copy_of_the_core_hot_methods(cls):
    for name in cls._hot_methods:
        method = getattr(cls, name)
        if name in cls.__dict__ and origin(method) is method:
            continue  # the configuration's own definition
        inherited = next(base.__dict__[name] for base in cls.__mro__[1:] if name in base.__dict__)
        assert origin(method) is origin(inherited), name  # a copy of the method it inherits
        assert method.__code__ is not inherited.__code__, name  # with its own code object
        assert method.__code__.co_code == origin(inherited).__code__.co_code, name  # and the same instructions


def test_each_candidate_index_runs_its_own_copy_of_the_choice():
    for name in CandidateIndex._hot_methods:
        assert origin(getattr(SmallCandidateIndex, name)) is getattr(CandidateIndex, name)
        assert getattr(SmallCandidateIndex, name).__code__ is not getattr(CandidateIndex, name).__code__


def test_copies_keep_the_fast_paths_of_a_configuration_that_keeps_the_core_hooks():
    assert ShadowCache._core_leaf and ShadowCache._core_refresh and ShadowCache._core_touch
    assert ShadowCache._core_removal and HybridPrefixCache._core_leaf
    assert not _SharedShadow._core_touch  # it overrides the touch


def serve(cache, seq, n_in):
    seq = np.asarray(seq, dtype=np.int64)
    if isinstance(cache, ShadowCache):
        match = SharedMatch(seq, n_in, 1)
        hit, checkpoint_at = cache.lookup(match)
        return cache.admit(match, checkpoint_at, n_in)
    return cache.serve(seq[:n_in], seq[n_in:])[1]


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's inline attribute limit")
@pytest.mark.parametrize("kind", [ShadowCache, _SharedShadow])
def test_a_shadow_keeps_at_most_30_attributes_in_its_dict(kind):
    # CPython keeps up to 30 attributes of an instance inline, where it caches their reads and the
    # instance's method lookups; one more moves them into a dict of their own and every method
    # lookup of the shadows' request path goes the slow way (about a tenth of a tuned replay).
    if kind is ShadowCache:
        cache = ShadowCache(TOY, 1000, eviction_for(1.0))
    else:
        cache = _SharedShadow(TOY, 1000, checkpoint_grid=1, page_size=1, state_slots=None)
    for start in range(0, 400, 40):
        serve(cache, list(range(start, start + 30)) + [7, 8], 30)
    assert len(vars(cache)) <= 30, sorted(vars(cache))


@pytest.mark.parametrize("kind", ["hybrid", "shadow"])
def test_a_cached_sequence_admits_nothing_and_evicts_nothing_in_a_full_cache(kind):
    # 1 byte per token, 10 per state: A (30 tokens) and B (50) with their states fill 100 bytes.
    cache = (HybridPrefixCache(TOY, 100, eviction_for("lru")) if kind == "hybrid"
             else ShadowCache(TOY, 100, eviction_for("lru")))
    a, b = list(range(100, 130)), list(range(200, 250))
    assert serve(cache, a, 30) == 1 and serve(cache, b, 50) == 1
    assert cache.used_bytes == 100
    assert serve(cache, a, 30) == 0  # its end's state is cached: nothing to add, nothing to free
    assert (cache.kv_tokens, cache.ssm_states, cache.counters.evictions_leaf) == (80, 2, 0)
    assert serve(cache, a + [1, 2, 3, 4, 5], 30) == 1  # 5 tokens and a state more: room is made
    assert cache.counters.evictions_leaf == 1 and cache.used_bytes <= 100
    cache.check_invariants()

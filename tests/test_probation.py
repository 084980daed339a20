"""Probationary states (`HybridPrefixCache(probation=True)`): a prefix used exactly twice in a row
hits at its second use, probationary states go first under pressure, and a hit confirms one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, ShadowTuner

PROMPT = list(range(1000, 1200))  # 200 tokens


def rounds(n):
    """SGLang's mooncake generator: each round resends the previous prompt with a placeholder
    reply (not the model's output) and a new question; the output goes unused."""
    prompt = list(PROMPT)
    for k in range(n):
        output = [50_000 + 10 * k + j for j in range(5)]
        yield prompt, output
        prompt = prompt + [9] * 5 + [60_000 + 100 * k + j for j in range(20)]  # placeholder, question


@pytest.mark.parametrize("eviction", [LruLeafEviction, FlopAwareEviction])
def test_a_prefix_used_twice_in_a_row_hits_at_its_second_use(toy, eviction):
    plain = HybridPrefixCache(toy, 10**6, eviction())
    probation = HybridPrefixCache(toy, 10**6, eviction(), probation=True)
    hits_plain = [plain.serve(inp, out)[0].hit_tokens for inp, out in rounds(4)]
    hits_prob = [probation.serve(inp, out)[0].hit_tokens for inp, out in rounds(4)]
    assert hits_plain[1] == 0  # the branch at the end of round 1's prompt is found, and pays from round 3
    assert hits_prob[1] == len(PROMPT)  # the state kept at the end of round 1's input
    assert all(p >= q for p, q in zip(hits_prob, hits_plain)) and hits_prob[2] > hits_plain[1]
    probation.check_invariants()
    assert not probation._probation or all(n.has_state for n in probation._probation)


def test_probationary_states_go_first_and_a_hit_confirms_one(toy):
    cache = HybridPrefixCache(toy, 2_000, LruLeafEviction(), probation=True)
    a = list(range(100, 400))
    _, admitted = cache.serve(a, [1, 2])
    assert admitted == 2 and len(cache._probation) == 1  # the end of a+output, and probation at len(a)
    node = next(iter(cache._probation))
    assert node.end == len(a) and node.has_state
    b = list(range(500, 800))
    cache.serve(b, [3])
    assert len(cache._probation) == 2
    # a hit on a's input confirms its probationary state
    lookup, _ = cache.serve(a + [7, 7], [4])
    assert lookup.hit_tokens == len(a) and node not in cache._probation
    # pressure: the probationary states (b's, and the one the last request added) go before any
    # regular state; a's confirmed one survives
    probationary = list(cache._probation)
    assert len(probationary) == 2
    evictions_before = cache.counters.evictions_leaf
    cache.serve(list(range(900, 2400)), [5])
    assert all(not p.has_state or p.parent is None for p in probationary)
    assert node.has_state and node.parent is not None
    assert cache.counters.evictions_leaf > evictions_before  # and then LRU's own victims
    cache.check_invariants()


def test_no_room_means_no_probationary_state(toy):
    cache = HybridPrefixCache(toy, 22, LruLeafEviction(), probation=True)  # 4 tokens and one 10-byte state fit, not two
    _, admitted = cache.serve([1, 2, 3], [4])
    assert admitted == 1 and not cache._probation  # the regular state fits; a probationary one would not
    cache.check_invariants()


def test_snapshots_and_shadows_keep_probation(toy):
    cache = HybridPrefixCache(toy, 5_000, FlopAwareEviction(1.0), probation=True)
    for inp, out in rounds(3):
        cache.serve(inp, out)
    copy = HybridPrefixCache.from_snapshot(toy, cache.snapshot(), FlopAwareEviction(1.0))
    assert copy.probation and {n.end for n in copy._probation} == {n.end for n in cache._probation}
    copy.check_invariants()
    tuner = ShadowTuner(toy, 600, ShadowConfig(alpha_grid=(0.0, 5.0), seglen_weights=()), probation=True)
    for inp, out in rounds(30):
        tuner.observe("s", np.array(inp), np.array(out))
    for shadow in tuner.shadows or [tuner.shared]:
        assert shadow.probation
        shadow.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=30),
                          st.lists(st.integers(0, 3), max_size=5)), min_size=1, max_size=40),
       st.integers(40, 400), st.sampled_from(["lru", "flop"]))
def test_invariants_hold_with_probation(toy_profile, reqs, capacity, kind):
    prefixes = [[], list(range(100, 140)), list(range(200, 230))]
    cache = HybridPrefixCache(toy_profile, capacity, LruLeafEviction() if kind == "lru" else FlopAwareEviction(2.0),
                              probation=True)
    for p, suffix, output in reqs:
        _, states = cache.serve(prefixes[p] + suffix, output)
        assert states <= 3  # two regular states and at most one probationary
        cache.check_invariants()

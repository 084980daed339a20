"""`coverage` eviction (SGLang PR #38000's rule): each state's value is the number of tree
positions that would resume from it, kept current in the candidate index as the tree changes
below it; the victim is the least covering candidate, ties to the least recently used, so a chain
is thinned from its deep end and a fork off its shallow part still hits."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules.eviction import CoverageEviction, FlopAwareEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.policies import build_policy, check_policy_name
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.synthetic import generate

from toy_profile import ToyProfile

TOY = ToyProfile()  # 1 byte of KV per token, 10 bytes per state


def node_ending_at(cache, end):
    return next(n for n in cache.tree.nodes() if n.end == end)


def coverage_of(cache, end):
    return CoverageEviction.node_value(cache, node_ending_at(cache, end))


def test_coverage_counts_the_positions_that_resume_from_a_state():
    cache = HybridPrefixCache(TOY, 10_000, CoverageEviction())
    prompt = list(range(1, 13))
    cache.serve(prompt, [20, 21, 22])  # one node [0, 15), state at 15
    cache.serve(prompt, [20, 21, 23])  # branch checkpoint at 11; the outputs part at 14, with no state there
    cache.check_invariants()
    assert not node_ending_at(cache, 14).has_state and len(node_ending_at(cache, 14).children) == 2
    # the state at 11 covers 11, 12, 13 and the stateless branch point 14; each leaf only its own end
    assert coverage_of(cache, 11) == 4
    assert [CoverageEviction.node_value(cache, n) for n in cache.tree.nodes() if not n.children] == [1, 1]
    assert coverage_of(cache, 14) == 0  # no state: nothing resumes from it
    slot = node_ending_at(cache, 11).slot
    assert slot >= 0 and cache.index.efficiency[slot] == 4


def chain(cache, turns=3):
    """One conversation: turn k's input is turn k-1's sequence + 2 tokens; states at 12, 16, 20."""
    seq = list(range(1, 11))
    for k in range(turns):
        inp = seq + ([] if k == 0 else [100 + 2 * k, 101 + 2 * k])
        out = [200 + 2 * k, 201 + 2 * k]
        cache.serve(inp, out)
        seq = inp + out
    return seq


def test_a_chain_is_thinned_from_its_deep_end_not_its_shallow_one():
    coverage = HybridPrefixCache(TOY, 10_000, CoverageEviction())
    lru = HybridPrefixCache(TOY, 10_000, FlopAwareEviction(0.0))  # LRU over the same candidates
    for cache in (coverage, lru):
        chain(cache)
        assert sorted(n.end for n in cache.tree.nodes() if n.has_state) == [12, 16, 20]
    assert [coverage_of(coverage, e) for e in (12, 16, 20)] == [4, 4, 1]
    assert coverage.eviction.choose(coverage.index).end == 20  # the deepest, though the most recent
    assert lru.eviction.choose(lru.index).end == 12  # LRU: the shallowest, cached first


def test_a_fork_off_the_shallow_part_of_a_chain_still_hits():
    """The PR's case in miniature: after pressure, a request that shares the first turn and then
    diverges finds the state at 12 under coverage; LRU over the same candidates dropped it."""
    hits = {}
    for name, eviction in (("coverage", CoverageEviction()), ("lru", FlopAwareEviction(0.0))):
        cache = HybridPrefixCache(TOY, 60, eviction)
        first_turn = chain(cache)[:12]
        assert cache.used_bytes == 50
        cache.serve([300, 301, 302, 303, 304], [])  # 15 bytes more: one eviction
        hits[name] = cache.lookup(first_turn + [99, 98]).hit_tokens
        cache.check_invariants()
    assert hits == {"coverage": 12, "lru": 0}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(40, 300))
def test_the_index_keeps_every_candidates_coverage_current(seed, capacity):
    """After every request (inserts, splits, merges, evictions of leaves and of inner states) each
    candidate's indexed value equals its coverage computed afresh."""
    rng = np.random.default_rng(seed)
    cache = HybridPrefixCache(TOY, capacity, CoverageEviction())
    history = {}
    for i in range(30):
        s = int(rng.integers(4))
        base = history.get(s, [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 5)))])
        inp = base + [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 6)))]
        out = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 4)))]
        cache.serve(inp, out)
        history[s] = inp + out
        cache.check_invariants()
        for slot, node in enumerate(cache.index.items):
            assert cache.index.efficiency[slot] == CoverageEviction.node_value(cache, node), node


def test_coverage_is_a_simulator_policy_beside_lru():
    assert check_policy_name("coverage") == "coverage"
    profile = load_profile("paper-7b")
    workload = generate("sharegpt", seed=1, sessions=15)
    run = replay(workload, build_policy("coverage", profile, 10**9), profile, 10**9, progress=False)
    assert run.policy == "coverage" and 0 < run.token_hit_rate < 1 and run.stats.evictions_leaf > 0

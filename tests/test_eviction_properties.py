"""Property tests: random request sequences keep the cache's invariants, and the indexed victim
equals a brute-force evaluation of Marconi's utility over the whole tree."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache

# Requests built from a few shared prefixes and small alphabets, so branches, splits, merges and
# evictions all happen within a few dozen operations.
requests = st.lists(
    st.tuples(
        st.integers(0, 3),  # which shared prefix
        st.lists(st.integers(0, 3), min_size=1, max_size=25),  # private suffix
        st.lists(st.integers(0, 3), max_size=5),  # output
        st.booleans(),  # lock this request's matched node for the rest of the run
    ),
    min_size=1,
    max_size=40,
)
PREFIXES = [[], list(range(100, 120)), list(range(200, 260)), list(range(100, 110)) + [7] * 10]


def brute_force_scores(cache: HybridPrefixCache, alpha: float) -> dict:
    cands = []
    for node in cache.tree.nodes():
        if node.lock_count:
            continue
        if not node.children or (len(node.children) == 1 and node.has_state):
            if node.has_state:
                freed = cache.ssm_state_bytes + (0 if node.children else len(node.tokens) * cache.kv_bytes_per_token)
                eff = cache.profile.prefill_flops(node.parent.end, node.end) / freed
            else:
                eff = 0.0
            cands.append((node, node.last_access, eff))
    ts = [t for _, t, _ in cands]
    es = [e for _, _, e in cands]

    def norm(v, lo, hi):
        return (v - lo) / (hi - lo) if hi > lo else 0.0

    return {n.id: norm(t, min(ts), max(ts)) + alpha * norm(e, min(es), max(es)) for n, t, e in cands}


@settings(max_examples=60, deadline=None)
@given(requests, st.sampled_from([0.0, 0.3, 1.0, 2.0]), st.integers(150, 600))
def test_victim_matches_brute_force(toy_profile, reqs, alpha, capacity):
    cache = HybridPrefixCache(toy_profile, capacity, FlopAwareEviction(alpha))
    for p, suffix, output, _ in reqs:
        prefix = PREFIXES[p]
        cache.serve(prefix + suffix, output)
        if len(cache.index):
            scores = brute_force_scores(cache, alpha)
            victim = cache.eviction.choose(cache.index)
            assert set(scores) == {n.id for n in cache.index.items}
            assert abs(scores[victim.id] - min(scores.values())) < 1e-9


@settings(max_examples=80, deadline=None)
@given(requests, st.sampled_from(["marconi", "sglang+"]), st.sampled_from([0.0, 1.5]), st.integers(60, 500),
       st.sampled_from([1, 4]))
def test_invariants_under_random_requests(toy_profile, reqs, kind, alpha, capacity, grid):
    eviction = FlopAwareEviction(alpha) if kind == "marconi" else LruLeafEviction()
    cache = HybridPrefixCache(toy_profile, capacity, eviction, checkpoint_grid=grid)
    locked = []
    for p, suffix, output, lock in reqs:
        prefix = PREFIXES[p]
        seq = prefix + suffix
        lookup, states = cache.serve(seq, output)
        assert states <= 2  # at most two SSM states admitted per request
        assert lookup.hit_tokens <= min(lookup.overlap_tokens, len(seq) - 1)
        cache.check_invariants()  # bytes == sum over nodes, index == candidates, capacity respected
        if lock and lookup.hit_node is not cache.tree.root:
            cache.lock(lookup.hit_node)
            locked.append((lookup.hit_node, lookup.hit_node.end))
        for node, end in locked:  # locked nodes survive every eviction, state and all
            assert node.parent is not None and node.end == end and node.has_state
    for node, _ in locked:
        cache.unlock(node)
    cache.check_invariants()
    # every state is held by exactly one node: count by position along distinct paths
    assert sum(n.has_state for n in cache.tree.nodes()) == cache.ssm_states


@settings(max_examples=60, deadline=None)
@given(requests)
def test_single_child_eviction_keeps_subtree_kv_matchable(toy_profile, reqs):
    cache = HybridPrefixCache(toy_profile, 10**6, FlopAwareEviction(0.0))
    sequences = []
    for p, suffix, output, _ in reqs:
        prefix = PREFIXES[p]
        cache.serve(prefix + suffix, output)
        sequences.append(np.array(prefix + suffix + output))
    inner = [n for n in cache.tree.nodes() if len(n.children) == 1 and n.has_state and n.slot >= 0]
    for node in inner[:3]:
        if node.parent is None:  # merged away by an earlier eviction in this loop
            continue
        overlaps = [cache.tree.walk(s).overlap for s in sequences]
        kv, states = cache.kv_tokens, cache.ssm_states
        cache.evict(node)
        cache.check_invariants()
        assert cache.kv_tokens == kv and cache.ssm_states == states - 1
        assert [cache.tree.walk(s).overlap for s in sequences] == overlaps

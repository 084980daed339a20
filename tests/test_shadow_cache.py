"""The shadow tuner's cache is `HybridPrefixCache` step for step: on random streams it hits the
same tokens, admits the same states, evicts the same victims and leaves the same tree, candidate
slots and recency columns (so even a near-tie is broken as the reference breaks it); the shared
match compares a request with each source once; the guard's two-arm sums equal the full evidence's."""

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_profile import ToyProfile

from sglang_marconi.policy.tuning.evidence import Evidence, GuardSums
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tree.shadow_cache import ShadowCache
from sglang_marconi.policy.tuning.shadow_tuner import eviction_for
from sglang_marconi.policy.tree.shared_match import SharedMatch
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex


@dataclass(frozen=True)
class AttentionOnlyToy(ToyProfile):
    name: str = "toy-attention"
    ssm_state_bytes: int = 0


TOY, ATTENTION_ONLY = ToyProfile(), AttentionOnlyToy()
PREFIXES = [[], list(range(100, 140)), list(range(200, 230)), list(range(100, 120)) + [7] * 12]
CHOICES = ["lru", 0.0, 1.0, 20.0, "seglen:1", "seglen:100"]


def assert_same_cache(shadow: ShadowCache, ref: HybridPrefixCache) -> None:
    """Same tree (node for node, in the same order), states, recency, candidate slots and columns."""
    a, b = shadow.snapshot(), ref.snapshot()
    assert a.parents == b.parents and a.has_state == b.has_state and a.last_access == b.last_access
    assert all(np.array_equal(s[start:end], t) for (s, start, end), (t,) in zip(a.edges, b.edges))
    assert a.probation == b.probation and a.clock == b.clock
    assert (shadow.kv_tokens, shadow.ssm_states, shadow.counters) == (ref.kv_tokens, ref.ssm_states, ref.counters)
    n = len(ref.index)
    assert [(x.end, x.end - x.start) for x in shadow.index.items] == [(x.end, len(x.tokens)) for x in ref.index.items]
    assert shadow.index.recency == ref.index.last_access[:n].tolist()
    if shadow.eviction.alpha if hasattr(shadow.eviction, "alpha") else False:  # alpha 0 ranks by recency alone
        assert shadow.index.value == ref.index.efficiency[:n].tolist()
    if shadow.index._mirrored:
        assert np.array_equal(shadow.index._columns[:, :n], ref.index._columns[:, :n])


def serve_both(shadow, ref, inp, out):
    inp, out = np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64)
    lookup = ref.lookup(inp)
    seq = np.concatenate((inp, out))
    admitted = ref.admit(seq, lookup.checkpoint_at, len(inp) if ref.probation else None)
    match = SharedMatch(seq, len(inp), shadow.page_size)
    hit, checkpoint_at = shadow.lookup(match)
    assert (hit, checkpoint_at) == (lookup.hit_tokens, lookup.checkpoint_at)
    assert shadow.admit(match, checkpoint_at, len(inp)) == admitted


requests = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=30),
              st.lists(st.integers(0, 3), max_size=6), st.booleans()),  # repeat the previous input instead
    min_size=1, max_size=50)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(30, 400), st.sampled_from(CHOICES), st.sampled_from([1, 2]), st.sampled_from([1, 4]),
       st.sampled_from([None, 3, 5]), st.booleans(), st.booleans())
def test_shadow_cache_is_hybrid_prefix_cache(reqs, capacity, choice, page, grid, slots, probation, attention_only):
    profile = ATTENTION_ONLY if attention_only else TOY
    if slots is None and not attention_only:
        capacity = max(capacity, 2 * profile.ssm_state_bytes)
    kwargs = dict(checkpoint_grid=grid, page_size=page, state_slots=slots, probation=probation)
    shadow = ShadowCache(profile, capacity, eviction_for(choice), **kwargs)
    ref = HybridPrefixCache(profile, capacity, eviction_for(choice), **kwargs)
    previous = None
    for p, suffix, out, repeat in reqs:
        inp = previous if repeat and previous is not None else PREFIXES[p] + suffix
        previous = inp
        serve_both(shadow, ref, inp, out)
        shadow.check_invariants()
        assert_same_cache(shadow, ref)


@settings(max_examples=60, deadline=None)
@given(requests, requests, st.integers(40, 300), st.sampled_from(CHOICES), st.sampled_from(CHOICES), st.booleans())
def test_snapshots_carry_everything(before, after, capacity, first, second, probation):
    """A copy under another choice (a fork, a revival, a verifier's trial) goes on exactly as the
    reference's copy does."""
    shadow = ShadowCache(TOY, capacity, eviction_for(first), probation=probation)
    ref = HybridPrefixCache(TOY, capacity, eviction_for(first), probation=probation)
    for p, suffix, out, _ in before:
        serve_both(shadow, ref, PREFIXES[p] + suffix, out)
    shadow = ShadowCache.from_snapshot(TOY, shadow.snapshot(), eviction_for(second))
    ref = HybridPrefixCache.from_snapshot(TOY, ref.snapshot(), eviction_for(second))
    assert_same_cache(shadow, ref)
    for p, suffix, out, _ in after:
        serve_both(shadow, ref, PREFIXES[p] + suffix, out)
        assert_same_cache(shadow, ref)


def test_a_request_is_compared_with_each_source_once():
    src = np.arange(1000)
    seq = np.concatenate((np.arange(600), [5, 5, 5]))
    match = SharedMatch(seq, 600, 1)
    assert match.agreed_end(src, 0, 100) == 100
    assert match.agreed_end(src, 100, 500) == 500  # extends what it knew
    assert match.agreed_end(src, 0, 50) == 50
    assert match.agreed_end(src, 500, 603) == 600  # the first difference, remembered
    assert match._agreed[id(src)][2] == 600 and match.agreed_end(src, 550, 700) == 600
    assert match.agreed_end(seq, 0, 603) == 603  # the request itself
    assert match.key(3) == 3 and SharedMatch(seq, 600, 2).key(4) == seq[4:6].tobytes()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.floats(0, 1e6), min_size=5, max_size=5),
                          st.floats(1, 1e7)), min_size=1, max_size=60), st.integers(1, 4), st.integers(0, 4))
def test_guard_sums_are_the_evidence_of_two_arms(adds, current, copy_from):
    full, guard = Evidence(5, (math.inf,), block=3), GuardSums(current, block=3)
    for session, gains, whole in adds:
        full.add(f"s{session}", np.array(gains), whole)
        guard.add(f"s{session}", np.array(gains), whole)
    m = full.moments[0]
    assert guard.scores == [full.scores[0, 0], full.scores[0, current]] and guard.potential == full.potential[0]
    assert guard.moments == [m[0, 0], m[current, current], m[0, current]]
    for margin, z in ((0.0, 0.0), (0.01, 1.0), (0.0, 2.0)):
        assert guard.lead(0, current, 0, margin, z) == full.lead(0, current, 0, margin, z)
    if copy_from in (0, current):
        full.copy_arm(copy_from, current)
        guard.copy_arm(copy_from, current)
        guard.add("s0", np.array(adds[0][1]), 1.0)
        full.add("s0", np.array(adds[0][1]), 1.0)
        m = full.moments[0]
        assert guard.moments == [m[0, 0], m[current, current], m[0, current]]
        assert guard.lead(0, current, 0, 0.0, 1.0) == full.lead(0, current, 0, 0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 10)), min_size=1, max_size=40),
       st.sampled_from([0.0, 1.0, 20.0, 100.0]))
def test_small_index_picks_the_reference_victim(entries, alpha):
    """Ties included (recency drawn from few values): the Python path defers to the reference."""
    from sglang_marconi.policy.tree.candidate_index import CandidateIndex

    small, ref = SmallCandidateIndex(4), CandidateIndex(4)
    for i, (t, e) in enumerate(entries):
        assert small.add(i, float(t), e) == ref.add(i, float(t), e)
    for slot in range(0, len(entries), 3):
        if slot < len(ref):
            assert small.remove(slot) == ref.remove(slot)
    if len(ref):
        assert small.lowest(alpha) == ref.lowest(alpha)

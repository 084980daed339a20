"""Admission, eviction and accounting of the policy core's HybridPrefixCache, checked by hand."""

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache

SYSTEM = list(range(1000, 1100))  # a 100-token shared system prompt


def cache(toy, capacity=10_000, eviction=None, **kw):
    return HybridPrefixCache(toy, capacity, eviction or FlopAwareEviction(0.0), **kw)


def test_shared_prefix_reused_from_third_occurrence(toy):
    c = cache(toy)
    hits, admitted = [], []
    for i in range(4):
        lookup, states = c.serve(SYSTEM + [i] * 5, [50 + i] * 3)
        hits.append(lookup.hit_tokens)
        admitted.append(states)
        c.check_invariants()
    # 1st creates the path, 2nd finds the branch at 100 and checkpoints it, 3rd and 4th reuse it.
    assert hits == [0, 0, 100, 100]
    assert admitted == [1, 2, 1, 1]
    assert c.kv_tokens == 100 + 4 * 8 and c.ssm_states == 5
    assert c.used_bytes == c.kv_tokens * 1 + c.ssm_states * 10


def test_multi_turn_continuation_hits_after_last_decoded_token(toy):
    c = cache(toy)
    turn1_in, turn1_out = list(range(40)), [7, 8, 9]
    c.serve(turn1_in, turn1_out)
    lookup, states = c.serve(turn1_in + turn1_out + [11, 12], [13])
    assert lookup.hit_tokens == 43 and lookup.checkpoint_at is None and states == 1


def test_hit_leaves_one_token_to_prefill(toy):
    c = cache(toy)
    c.serve([1, 2, 3, 4], [])
    lookup = c.lookup([1, 2, 3, 4])
    assert lookup.overlap_tokens == 4 and lookup.hit_tokens == 0  # the only state is at 4 = len(input)
    c.serve([1, 2, 3, 4, 5], [])
    assert c.lookup([1, 2, 3, 4, 5, 6]).hit_tokens == 5


def test_checkpoint_grid_rounds_branch_down(toy):
    c = cache(toy, checkpoint_grid=32)
    c.serve(list(range(80)) + [1], [])
    lookup = c.lookup(list(range(80)) + [2, 3])
    assert lookup.overlap_tokens == 80 and lookup.checkpoint_at == 64
    c.admit(list(range(80)) + [2, 3], lookup.checkpoint_at)
    c.check_invariants()
    assert c.lookup(list(range(80)) + [4]).hit_tokens == 64


def test_at_most_two_states_per_request(toy):
    c = cache(toy)
    rng = np.random.default_rng(1)
    for _ in range(200):
        prefix = list(range(int(rng.integers(0, 3)) * 100, 0, -1))
        _, states = c.serve(prefix + rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist(), [5])
        assert states <= 2


def test_leaf_eviction_frees_kv_and_state(toy):
    c = cache(toy, capacity=60)
    c.serve([1] * 20, [])  # 20 KV + 10 state = 30 bytes
    c.serve([2] * 20, [])  # 30 more: full
    c.serve([3] * 20, [])  # evicts the least recent leaf ([1]*20)
    assert c.counters.evictions_leaf == 1 and c.used_bytes == 60
    assert c.lookup([1] * 21).overlap_tokens == 0 and c.lookup([2] * 21).hit_tokens == 20


def test_single_child_eviction_frees_only_the_state_and_keeps_kv(toy):
    c = cache(toy, capacity=200)
    c.serve([1] * 30, [])  # leaf A, state at 30
    c.serve([1] * 30 + [2] * 30, [])  # A becomes single-child with state; leaf B at 60
    a = c.tree.walk(np.array([1] * 30)).last
    before = c.kv_tokens
    c.evict(a)
    c.check_invariants()
    assert c.kv_tokens == before and c.ssm_states == 1
    assert c.counters.evictions_single_child == 1
    lookup = c.lookup([1] * 30 + [2] * 30 + [3])
    assert lookup.overlap_tokens == 60 and lookup.hit_tokens == 60  # B's KV and state still whole


def test_locked_nodes_are_never_evicted(toy):
    c = cache(toy, capacity=60)
    c.serve([1] * 20, [])
    node = c.tree.walk(np.array([1] * 20)).last
    c.lock(node)
    c.serve([2] * 20, [])
    c.serve([3] * 20, [])  # must evict [2]*20, not the locked [1]*20
    assert c.lookup([1] * 21).hit_tokens == 20 and c.lookup([2] * 21).overlap_tokens == 0
    c.unlock(node)
    c.check_invariants()
    with pytest.raises(MarconiError, match="not locked"):
        c.unlock(node)


def test_request_larger_than_capacity_is_skipped_not_fatal(toy):
    c = cache(toy, capacity=50)
    _, states = c.serve([1] * 100, [])
    assert states == 0 and c.counters.admissions_skipped == 1 and c.used_bytes == 0


def test_flop_aware_eviction_keeps_the_long_prefix(toy):
    # alpha large: a long prefix saves far more FLOPs per byte than a short one (e^2 - s^2).
    c = cache(toy, capacity=150, eviction=FlopAwareEviction(2.0))
    c.serve(list(range(100)), [])  # old but valuable: 100^2 / 110
    c.serve([500] * 5, [])  # recent, cheap
    c.serve([600] * 5, [])  # recent, cheap
    c.serve([700] * 30, [])  # needs room: LRU would drop the 100-token prefix
    assert c.lookup(list(range(100)) + [1]).hit_tokens == 100
    lru = cache(toy, capacity=150)
    for seq in (list(range(100)), [500] * 5, [600] * 5, [700] * 30):
        lru.serve(seq, [])
    assert lru.lookup(list(range(100)) + [1]).hit_tokens == 0


def test_a_weight_changed_in_place_ranks_the_next_eviction(toy):
    # The tuner's `adopt_choice` moves between FLOP-aware weights by setting `eviction.alpha` on the
    # cache's policy object, without `set_eviction`: the next victim must follow the new weight.
    c = cache(toy, capacity=150, eviction=FlopAwareEviction(0.0))
    c.serve(list(range(100)), [])
    c.serve([500] * 5, [])
    c.serve([600] * 5, [])
    c.eviction.alpha = 2.0
    c.serve([700] * 30, [])  # needs room: at alpha 0 the 100-token prefix would go
    assert c.lookup(list(range(100)) + [1]).hit_tokens == 100


def test_sglang_plus_refreshes_path_and_evicts_only_leaves(toy):
    c = cache(toy, capacity=1000, eviction=LruLeafEviction())
    c.serve([1] * 30, [])
    c.serve([1] * 30 + [2] * 30, [])
    inner = c.tree.walk(np.array([1] * 30)).last
    assert inner.slot < 0  # single-child node: not a candidate for SGLang+
    stamp = inner.last_access
    c.lookup([1] * 30 + [2] * 30 + [3])
    assert inner.last_access > stamp  # whole matched path refreshed


def test_marconi_refreshes_only_the_hit_node(toy):
    c = cache(toy)
    c.serve([1] * 30, [])
    c.serve([1] * 30 + [2] * 30, [])
    inner = c.tree.walk(np.array([1] * 30)).last
    stamp = inner.last_access
    c.lookup([1] * 30 + [2] * 30 + [3])
    assert inner.last_access == stamp


@pytest.mark.parametrize("bad", [[], [1, "a"], [1.5], "abc", [True]])
def test_bad_token_sequences(toy, bad):
    with pytest.raises(MarconiError, match="token sequence"):
        cache(toy).lookup(bad)


@pytest.mark.parametrize("capacity", [0, -5, 19, 2.5])
def test_bad_capacity(toy, capacity):
    with pytest.raises(MarconiError, match="capacity"):
        cache(toy, capacity=capacity)


def test_negative_alpha():
    with pytest.raises(MarconiError, match="alpha"):
        FlopAwareEviction(-0.1)


def test_snapshot_round_trip(toy):
    c = cache(toy, capacity=400)
    rng = np.random.default_rng(3)
    for _ in range(50):
        c.serve(rng.integers(0, 3, size=int(rng.integers(2, 40))).tolist(), [9])
    copy = HybridPrefixCache.from_snapshot(toy, c.snapshot(), FlopAwareEviction(0.0))
    copy.check_invariants()
    assert (copy.kv_tokens, copy.ssm_states, copy.used_bytes) == (c.kv_tokens, c.ssm_states, c.used_bytes)
    for _ in range(20):
        seq = rng.integers(0, 3, size=30).tolist()
        assert copy.lookup(seq).hit_tokens == c.lookup(seq).hit_tokens


def test_page_granularity(toy):
    c = cache(toy, page_size=4)
    c.serve(list(range(10)), [])  # 8 tokens cached (two pages)
    assert c.kv_tokens == 8
    lookup = c.lookup(list(range(6)) + [99] * 6)
    assert lookup.overlap_tokens == 4


def test_attention_only_model_reuses_any_cached_prefix():
    from toy_profile import ToyProfile

    c = HybridPrefixCache(ToyProfile(ssm_state_bytes=0), 1_000)
    c.serve(list(range(50)), [])
    lookup = c.lookup(list(range(30)) + [99])
    assert lookup.hit_tokens == 30 and lookup.checkpoint_at is None
    assert c.ssm_states == 0 and c.used_bytes == 50


def test_branch_checkpoint_capped_before_grid_floor(toy):
    # A wholly cached 128-token input: the branch is capped at 127 (one token is always
    # prefilled), then floored to the 64 grid, so the checkpoint is usable by the same input.
    c = cache(toy, checkpoint_grid=64)
    prompt = list(range(1, 129))
    c.serve(prompt, [7])
    lookup, _ = c.serve(prompt, [8])
    assert lookup.checkpoint_at == 64
    assert c.lookup(prompt).hit_tokens == 64


def test_admission_may_evict_the_edge_it_leaves_midway(toy):
    """A request locks what it reuses, not the edge it leaves mid-way (SGLang's running request
    locks its matched prefix): the previous request's private tail is evicted for room like any
    leaf, and the request caches those tokens itself."""
    for c in (cache(toy, capacity=70), cache(toy, capacity=70, state_slots=2)):  # one budget; 70 KV + 2 states
        c.serve([1] * 20 + [2] * 20, [])  # 40 tokens and a state
        lookup, states = c.serve([1] * 20 + [3] * 25, [])  # branch at 20: two states, 25 tokens beyond
        assert lookup.checkpoint_at == 20
        assert states == 2 and c.counters.admissions_skipped == 0
        assert c.lookup([1] * 20 + [3] * 25 + [9]).hit_tokens == 45
        assert c.lookup([1] * 20 + [2] * 20 + [9]).overlap_tokens == 20  # the tail went
        c.check_invariants()

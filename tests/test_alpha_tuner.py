"""Alpha tuning: bootstrap window sizing, grid replay, the keep-LRU-unless-beaten rule,
sampling, worker failure."""

import logging
import os

import numpy as np
import pytest

from sglang_marconi.policy.alpha_tuner import (
    LRU, AlphaScore, AlphaTuner, TuningConfig, WindowRequest, pick_choice, replay_window,
)
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.hybrid_cache import HybridPrefixCache

from toy_profile import ToyProfile


def contended_requests(n, seed=0):
    """One long valuable prefix revisited rarely, many short one-off requests in between."""
    rng = np.random.default_rng(seed)
    long_prefix = np.arange(10_000, 10_300)
    for i in range(n):
        if i % 7 == 0:
            yield f"long-{i % 3}", np.concatenate((long_prefix, rng.integers(0, 50, 5))), np.array([1, 2])
        else:
            yield f"short-{i}", rng.integers(100, 10_000, size=int(rng.integers(20, 60))), np.array([3])


def test_alpha_zero_until_first_eviction_then_window_of_multiplier_times(toy):
    cache = HybridPrefixCache(toy, 2_000, FlopAwareEviction(0.0))
    tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=2, workers=0))
    first_eviction_at = None
    for i, (sid, inp, out) in enumerate(contended_requests(200), start=1):
        cache.serve(inp, out)
        tuner.after_request(sid, inp, out)
        if first_eviction_at is None and cache.counters.evictions_leaf + cache.counters.evictions_single_child:
            first_eviction_at = i
            assert tuner.alpha == 0.0
    assert first_eviction_at is not None
    assert tuner.window_len == 2 * first_eviction_at
    ends = [at for at, _ in tuner.log.history[1:]]
    assert ends[0] == first_eviction_at + tuner.window_len
    assert all(b - a == tuner.window_len for a, b in zip(ends, ends[1:]))  # re-tuned every window
    assert len(tuner.log.windows) == len(ends) and len(tuner.log.windows[0]) == 22  # LRU + 21 alphas


def test_tuning_finds_positive_alpha_when_flops_matter(toy):
    # At 600 bytes LRU drops the 300-token prefix between its visits; FLOP-aware eviction keeps it.
    cache = HybridPrefixCache(toy, 600, FlopAwareEviction(0.0))
    tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=3, workers=0))
    for sid, inp, out in contended_requests(400):
        cache.serve(inp, out)
        tuner.after_request(sid, inp, out)
    assert any(alpha > 0 for _, alpha in tuner.log.history)
    window = tuner.log.windows[0]
    best = max(window, key=lambda s: s.flops_saved)
    assert best.flops_saved > next(s for s in window if s.alpha == 0).flops_saved


def test_pick_choice_keeps_baseline_on_ties_and_follows_objective():
    scores = [AlphaScore(0.0, 10.0, 5, 100), AlphaScore(0.5, 10.0, 9, 100), AlphaScore(1.0, 9.0, 7, 100)]
    assert pick_choice(scores, "flops") == 0.0  # 0.5 only ties on FLOPs
    assert pick_choice(scores, "token_hit_rate") == 0.5
    scores.append(AlphaScore(1.5, 12.0, 1, 100))
    assert pick_choice(scores, "flops") == 1.5
    with_lru = [AlphaScore(LRU, 12.0, 1, 100)] + scores
    assert pick_choice(with_lru, "flops") == LRU  # SGLang's LRU is the baseline and wins the tie


def test_tuner_can_switch_to_lru_and_back(toy):
    cache = HybridPrefixCache(toy, 600, FlopAwareEviction(0.0))
    tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=3, workers=0))
    tuner.after_request("x", np.arange(5), np.arange(1))  # no eviction yet: nothing happens
    from sglang_marconi.policy.alpha_tuner import _adopt

    _adopt(cache, LRU)
    assert isinstance(cache.eviction, LruLeafEviction)
    cache.check_invariants()
    _adopt(cache, 0.7)
    assert isinstance(cache.eviction, FlopAwareEviction) and cache.eviction.alpha == 0.7
    cache.check_invariants()


def test_replay_window_matches_direct_replay(toy):
    cache = HybridPrefixCache(toy, 1_500, FlopAwareEviction(0.7))
    reqs = list(contended_requests(60, seed=4))
    for _, inp, out in reqs[:30]:
        cache.serve(inp, out)
    snap = cache.snapshot()
    (score,) = replay_window(toy, snap, [WindowRequest(i, o) for _, i, o in reqs[30:]], [0.7])
    hits = sum(cache.serve(i, o)[0].hit_tokens for _, i, o in reqs[30:])
    assert score.hit_tokens == hits


def test_worker_processes_give_the_same_answer(toy):
    results = []
    for workers in (0, 2):
        cache = HybridPrefixCache(toy, 1_500, FlopAwareEviction(0.0))
        tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=3, workers=workers, alpha_grid=(0.0, 1.0, 2.0)))
        for sid, inp, out in contended_requests(150):
            cache.serve(inp, out)
            tuner.after_request(sid, inp, out)
        tuner.close()
        results.append(tuner.log.history)
    assert results[0] == results[1]


class WorkerKillingProfile(ToyProfile):
    """Serves normally here, but kills the worker process that unpickles it."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_dying_worker_keeps_alpha_and_serving(caplog):
    cache = HybridPrefixCache(WorkerKillingProfile(), 1_500, FlopAwareEviction(0.0))
    tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=1, workers=1))
    served = 0
    with caplog.at_level(logging.WARNING):
        for sid, inp, out in contended_requests(150):
            cache.serve(inp, out)
            tuner.after_request(sid, inp, out)
            served += 1
    tuner.close()
    assert served == 150 and tuner.log.failures >= 1 and tuner.alpha == 0.0
    assert "alpha tuning failed" in caplog.text and "BrokenProcessPool" in caplog.text
    cache.check_invariants()


def test_sampled_tuning_uses_scaled_shadow(toy):
    cache = HybridPrefixCache(toy, 4_000, FlopAwareEviction(0.0))
    tuner = AlphaTuner(cache, TuningConfig(bootstrap_multiplier=2, workers=0, sample_rate=0.5))
    for sid, inp, out in contended_requests(300):
        cache.serve(inp, out)
        tuner.after_request(sid, inp, out)
    assert tuner.shadow is not None and tuner.shadow.capacity_bytes == 2_000
    assert tuner.log.windows  # windows were replayed on the sampled sessions
    assert all(s.input_tokens < sum(len(i) for _, i, _ in contended_requests(300)) for s in tuner.log.windows[0])


@pytest.mark.parametrize("kwargs, match", [
    ({"objective": "latency"}, "objective"),
    ({"alpha_grid": (0.0, -1.0)}, "alpha"),
    ({"alpha_grid": ()}, "alpha_grid"),
    ({"sample_rate": 0.0}, "sample_rate"),
    ({"bootstrap_multiplier": 0}, "bootstrap_multiplier"),
    ({"workers": -1}, "workers"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(MarconiError, match=match):
        TuningConfig(**kwargs)


def test_tuner_needs_flop_aware_eviction(toy):
    with pytest.raises(MarconiError, match="FlopAwareEviction"):
        AlphaTuner(HybridPrefixCache(toy, 1_000, LruLeafEviction()))

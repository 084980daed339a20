"""The model of SGLang's served sliding-window cache (`policy/tree/served_window_cache.py`): every
hit it reports is reusable, its eviction is `window_plan`'s rule (the incremental plan equals the
reference on its tree after every request), a running request's window is held through the
evictions its own allocations cause, and the tuner's shadows are that model. Request by request
agreement with SGLang's own cache is `tests/serving/test_sim_equivalence.py`'s."""

import dataclasses

import numpy as np
import pytest

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tree.served_window_cache import ServedWindowCache
from sglang_marconi.policy.tuning.sampling import session_in_sample
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.policy.tuning.window_tuner import WindowTuner
from sglang_marconi.sim.baselines.swa_radix import served_marconi_swa
from sglang_marconi.sim.synthetic import generate

W = 8
TINY = dataclasses.replace(load_profile("gpt-oss-20b"), name="gpt-oss-20b-window-8", sliding_window=W)


def reusable(cache: ServedWindowCache, tokens, hit: int) -> bool:
    """Independently of the cache's match: the first `hit` tokens are in the tree (full KV) and
    SWA KV covers [max(0, hit - window), hit), or every token before `hit` (SGLang's validator:
    a run since the last tombstone of at least a window, or no tombstone at all)."""
    if hit == 0:
        return True
    node, pos, swa = cache.root, 0, []
    while pos < hit:
        child = node.children.get(int(tokens[pos]))
        if child is None:
            return False
        k = min(len(child.key), hit - pos)
        if not np.array_equal(child.key[:k], tokens[pos: pos + k]):
            return False
        swa += [child.swa] * k
        node, pos = child, pos + k
    return all(swa[max(0, hit - cache.window):]) and (hit >= cache.window or all(swa))


@pytest.mark.parametrize("kind,params,pools,chunk", [
    ("lmsys", dict(sessions=6, scale=0.1, seed=1), (3000, 1100), None),
    ("sharegpt", dict(sessions=8, scale=0.3, seed=3), (2500, 900), 64),
    ("swe-agent", dict(sessions=2, scale=0.03, seed=4), (3000, 1400), 256),
])
def test_hits_are_reusable_and_eviction_is_the_window_rule(kind, params, pools, chunk):
    profile = load_profile("gpt-oss-20b")
    cache = ServedWindowCache(profile, *pools, alpha=1.0, chunk_size=chunk)
    hits = 0
    for r in generate(kind, **params):
        expected = cache.peek_hit(r.input_tokens)  # read before: the request's later allocations may evict it
        assert reusable(cache, r.input_tokens, expected), (kind, cache.served, expected)
        out = cache.serve(r.input_tokens, r.output_tokens)
        assert out.hit_tokens == expected, (kind, cache.served, out)
        hits += out.hit_tokens
        cache.check_invariants()
        cache.check_plan()  # the incremental plan equals window_plan.reference_plan on this tree
    c = cache.counters
    assert c.evictions_stale + c.evictions_window + c.evictions_leaf > 0, "no SWA pressure: the test proves nothing"
    assert c.evictions_fallback == 0 and hits > 0


def test_a_running_request_holds_its_window_through_its_own_evictions():
    """A request that hit a prefix allocates its new tokens into a full SWA pool. Unlocked, the
    prefix's first node would be the first victim (stale: in no reuse point's window while the
    request runs); locked by the request, it stays, and the prefix is still reusable after it."""
    cache = ServedWindowCache(TINY, 10_000, 30, alpha=0.0)
    prefix = np.arange(1, 2 * W + 1)
    cache.serve(np.concatenate((prefix, [100, 101])), [7])  # 18 tokens of SWA KV
    cache.serve(np.arange(1000, 1010), [7])  # 10 more: 2 slots left
    request = np.concatenate((prefix, np.arange(500, 500 + W + 3)))
    assert cache.peek_hit(request) == 2 * W
    assert cache.serve(request, [7]).hit_tokens == 2 * W  # its 11 new tokens evict 9 or more
    assert cache.counters.evictions_leaf > 0
    assert cache.peek_hit(np.concatenate((prefix, [999, 998]))) == 2 * W
    cache.check_invariants()


def test_the_tuner_shadow_at_full_rate_is_the_served_model():
    profile = load_profile("gpt-oss-20b")
    tuner = WindowTuner(profile, 0, None, ShadowConfig(alpha_grid=(0.0, 1.0)), pools=(3000, 1100))
    policy = served_marconi_swa(profile, 3000, 1100, alpha=1.0)
    for r in generate("lmsys", sessions=6, scale=0.1, seed=1):
        live = policy.serve(r).hit_tokens
        tuner.observe(r.session_id, r.input_tokens, r.output_tokens[:-1])
        assert tuner.last_hits[1] == live
    assert policy.cache.counters.evictions_stale + policy.cache.counters.evictions_leaf > 0


def test_bad_input_names_the_value():
    profile = load_profile("gpt-oss-20b")
    with pytest.raises(MarconiError, match="swa_tokens must be a positive integer, got 0"):
        ServedWindowCache(profile, 100, 0)
    with pytest.raises(MarconiError, match="chunk_size"):
        ServedWindowCache(profile, 100, 100, chunk_size=0)
    with pytest.raises(MarconiError, match="no sliding-window layers"):
        ServedWindowCache(load_profile("llama-3-8b"), 100, 100)
    cache = ServedWindowCache(TINY, 10_000, 4 * W)
    with pytest.raises(MarconiError, match="out of memory: 41 tokens needed"):  # as SGLang's alloc_token_slots fails
        cache.serve(np.arange(1, 42), [5])


def test_a_request_the_pools_cannot_hold_leaves_the_tree_consistent():
    """Out of memory mid-request (SGLang's allocation fails): the request lets go of its lock, the
    cache serves on; a tuner's shadow scaled below the served pools counts it as a miss."""
    cache = ServedWindowCache(TINY, 10_000, 4 * W)
    prefix = np.arange(1, 2 * W + 1)
    cache.serve(np.concatenate((prefix, [100])), [7])
    with pytest.raises(MarconiError, match="out of memory"):
        cache.serve(np.concatenate((prefix, np.arange(200, 200 + 4 * W))), [5])  # hits the prefix, locks it
    cache.check_invariants()  # no lock left behind
    assert cache.serve(np.concatenate((prefix, [300, 301])), [7]).hit_tokens == 2 * W
    tuner = WindowTuner(TINY, 0, None, ShadowConfig(alpha_grid=(0.0,), sample_rate=0.5), pools=(10_000, 4 * W))
    assert tuner.shadows[0].swa_pool == 4 * W  # the floor: a few windows
    key = next(k for k in (f"s{i}" for i in range(100)) if session_in_sample(k, 0.5))
    tuner.observe(key, np.arange(1, 6 * W), np.arange(9, 12))
    assert tuner.last_hits == [0]
    cache = tuner.shadows[0]
    cache.check_invariants()


def test_the_full_walk_deletes_the_least_recently_used_leaf_first():
    """Under full-KV pressure (SWA pool ample) the core's eviction walk runs SGLang's FULL LRU: the
    evictable leaf least recently accessed goes first, its parent next once it is a leaf, and the
    deletions count as the FULL walk's, not the SWA walk's."""
    cache = ServedWindowCache(TINY, 50, 10_000, alpha=1.0)
    a, b = np.arange(1, 21), np.arange(101, 121)
    cache.serve(a, [7])
    cache.serve(b, [7])
    cache.serve(np.concatenate((a, np.arange(201, 206))), [7])  # A again: B is now the oldest
    cache.serve(np.arange(301, 321), [7])  # 20 new tokens into 5 free slots
    assert cache.peek_hit(np.concatenate((a, [9]))) == 20 and cache.peek_hit(np.concatenate((b, [9]))) == 0
    c = cache.counters
    assert (c.evictions_full_leaf, c.evictions_leaf) == (2, 0), c  # B's two nodes, by the FULL walk
    cache.check_invariants()

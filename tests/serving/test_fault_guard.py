"""Fault guard: an exception in Marconi's own code on the scheduler thread (victim choice, index
flush, index hooks, the runtime's reports) costs one warning, marks the cache faulted and falls
back to upstream's behaviour for that call and every later one; the cache keeps serving (matches,
inserts, upstream's evictions) and no exception reaches the caller. Upstream's own errors still
propagate. Faults are injected into SGLang's real UnifiedRadixCache on CPU by monkeypatching
Marconi functions only."""

import logging
import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.eviction_components import MarconiTreeIndex  # noqa: E402

SYSTEM = list(range(1, 301))


class Injected(RuntimeError):
    pass


def fail_after(monkeypatch, owner, name, calls_ok=0):
    """Make `owner.name` raise `Injected` from its (calls_ok + 1)-th call on; returns the call log."""
    original = getattr(owner, name)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) > calls_ok:
            raise Injected(f"injected into {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)
    return calls


def serving(**kwargs):
    config = MarconiServingConfig(alpha=kwargs.pop("alpha", 1.0), tune_workers=0)
    return build_marconi_serving(config, kv_size=kwargs.pop("kv_size", 2600), mamba_size=kwargs.pop("mamba_size", 10),
                                 max_num_reqs=2, **kwargs)


def serve(cc, n, seed=0):
    """n requests, many sharing one system prompt: both pressures evict. Returns the hits."""
    rng = random.Random(seed)
    hits = []
    for i in range(n):
        head = SYSTEM if rng.random() < 0.6 else []
        tokens = head + [rng.randrange(10_000, 1 << 30) for _ in range(rng.randrange(40, 260))]
        _, hit = run_request(cc, tokens, rng.randrange(1, 20), chunk_size=rng.choice([None, 96]),
                             chunk_end=chunk_end_for_branch)
        hits.append(hit)
        cc.check_no_leak()
    return hits


def marconi_warnings(caplog):
    return [r for r in caplog.records if r.name == "sglang_marconi" and "Marconi fault" in r.getMessage()]


def check_fell_back(cc, runtime, caplog, served_after):
    settings = runtime.settings
    assert settings.faulted is not None and "Injected" in settings.faulted
    assert len(marconi_warnings(caplog)) == 1  # one warning, whatever happened after
    # the cache kept serving: hits on the shared prompt, evictions by upstream, pools whole
    assert any(h >= len(SYSTEM) - 64 for h in served_after), served_after
    cc.check_no_leak()
    cc.cache.sanity_check()
    index = cc.cache.marconi_index
    assert index.root is None and not index._dirty and not index._struct  # hooks are no-ops now
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "upstream"


@pytest.mark.parametrize("calls_ok", [0, 5])
def test_victim_choice_fault_falls_back_to_upstream_eviction(monkeypatch, caplog, calls_ok):
    cc, runtime = serving()
    callbacks = []
    runtime_on_fault = runtime.settings.on_fault
    runtime.settings.on_fault = lambda where, exc: (callbacks.append((where, exc)), runtime_on_fault(where, exc))
    calls = fail_after(monkeypatch, MarconiTreeIndex, "choose", calls_ok)
    evicted_before = runtime.figures.evicted_tokens
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    assert len(calls) == calls_ok + 1  # never asked again after the fault
    assert runtime.figures.evicted_tokens > evicted_before and runtime.figures.evicted_states > 0
    evictions = runtime.figures.evicted_tokens
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits += serve(cc, 20, seed=1)
    assert runtime.figures.evicted_tokens > evictions  # upstream's walks keep freeing memory
    assert len(callbacks) == 1 and "victim choice" in callbacks[0][0] and isinstance(callbacks[0][1], Injected)
    check_fell_back(cc, runtime, caplog, hits[-20:])


def test_index_flush_fault_falls_back(monkeypatch, caplog):
    cc, runtime = serving()
    serve(cc, 3)  # bound the index (first eviction) or not: the flush runs after every release
    fail_after(monkeypatch, MarconiTreeIndex, "flush")
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    check_fell_back(cc, runtime, caplog, hits)
    assert runtime.figures.requests == 43  # the runtime still counts every release


def test_index_hook_fault_falls_back(monkeypatch, caplog):
    cc, runtime = serving()
    serve(cc, 25)  # evictions have bound the index: the hooks record
    assert cc.cache.marconi_index.root is not None
    fail_after(monkeypatch, MarconiTreeIndex, "changed")
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 30, seed=2)
    check_fell_back(cc, runtime, caplog, hits)


def test_runtime_report_fault_falls_back(monkeypatch, caplog):
    cc, runtime = serving()
    monkeypatch.setattr(runtime, "on_match", lambda *a, **k: (_ for _ in ()).throw(Injected("on_match")))
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    assert "on_match" in runtime.settings.faulted
    check_fell_back(cc, runtime, caplog, hits)


def test_after_a_fault_evictions_are_upstreams_lru(monkeypatch, caplog):
    """Once faulted, the Mamba walk frees states in SGLang's LRU order: the victims are
    the least recently used unlocked states, as upstream's walk would take them."""
    cc, runtime = serving()
    fail_after(monkeypatch, MarconiTreeIndex, "choose")
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        serve(cc, 30)
    assert runtime.settings.faulted is not None
    counters = runtime.settings.counters
    before = (counters.evictions_leaf, counters.evictions_single_child, counters.evictions_fallback)
    lru = cc.tree_core.lru_lists[MAMBA]
    oldest = lru.get_lru_no_lock()
    assert oldest is not None
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cc.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert oldest.component_data[MAMBA].value is None or cc.tree_core._node_arena.get(oldest.id) is not oldest
    # Marconi's counters no longer move: the decisions are upstream's
    assert (counters.evictions_leaf, counters.evictions_single_child, counters.evictions_fallback) == before
    cc.check_no_leak()


def test_upstream_errors_still_propagate(monkeypatch):
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    cc, runtime = serving()
    serve(cc, 2)
    fail_after(monkeypatch, FullComponent, "redistribute_on_node_split")
    with pytest.raises(Injected):  # SGLang's own hook raised: not Marconi's to swallow
        run_request(cc, SYSTEM[:150] + [7, 7, 7], 2)
    assert runtime.settings.faulted is None


def test_second_fault_is_silent_and_callback_runs_once(caplog):
    cc, runtime = serving()
    seen = []
    runtime.settings.on_fault = lambda where, exc: seen.append(where)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        runtime.settings.fault("first", Injected("a"))
        runtime.settings.fault("second", Injected("b"))
    assert seen == ["first"] and runtime.settings.faulted == "first: Injected: a"
    assert len(marconi_warnings(caplog)) == 1

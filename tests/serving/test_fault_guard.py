"""Fault protocol (`serving/faults.py`) on SGLang's real cache on CPU, faults injected by
monkeypatching Marconi's functions only:

- a fault in the eviction index (upkeep or victim choice) is recovered by rebuilding it from the
  tree: the cache decides exactly what an unfaulted twin fed the same stream decides (same tree
  after every request, same victims), with one warning;
- a fault Marconi cannot recover from (the rebuilt index fails again, admission) makes a rank
  alone fall back to upstream's rules and a rank of a TP/PP group raise one clear error;
- a failure of the runtime's reports (figures) stops the figures only: the tree is untouched;
- upstream's own errors propagate.
"""

import logging
import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, FakeGroup, Injected, build_marconi_serving, fail_at, run_request, tree_signature  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.faults import MarconiFaults, MarconiGroupFault  # noqa: E402
from sglang_marconi.serving.tree_index import MarconiTreeIndex  # noqa: E402

SYSTEM = list(range(1, 301))



def serving(group=None, **kwargs):
    config = MarconiServingConfig(alpha=kwargs.pop("alpha", 1.0), tune_workers=0)
    return build_marconi_serving(config, kv_size=kwargs.pop("kv_size", 2600), mamba_size=kwargs.pop("mamba_size", 10),
                                 max_num_reqs=2, group=group, **kwargs)


def requests(n, seed=0):
    """n requests, many sharing one system prompt: both pressures evict."""
    rng = random.Random(seed)
    for _ in range(n):
        head = SYSTEM if rng.random() < 0.6 else []
        tokens = head + [rng.randrange(10_000, 1 << 30) for _ in range(rng.randrange(40, 260))]
        yield tokens, rng.randrange(1, 20), rng.choice([None, 96])


def serve(cc, n, seed=0, trees=None):
    """Serve the stream; returns the hits (and appends the tree after each request to `trees`)."""
    hits = []
    for i, (tokens, n_out, chunk) in enumerate(requests(n, seed)):
        out = [5_000_000 + 100 * i + j for j in range(n_out)]
        _, hit = run_request(cc, tokens, n_out, chunk_size=chunk, out_tokens=out, chunk_end=chunk_end_for_branch)
        hits.append(hit)
        cc.check_no_leak()
        if trees is not None:
            trees.append(tree_signature(cc.cache))
    return hits


def fault_warnings(caplog):
    return [r for r in caplog.records if r.name == "sglang_marconi" and "Marconi fault" in r.getMessage()]


def twin_run(n=60, seed=0):
    cc, runtime = serving()
    victims = []
    cc.settings.observer = lambda v: victims.append((v.pressure, v.kind, v.node.id))
    trees = []
    hits = serve(cc, n, seed, trees)
    return hits, trees, victims, runtime


# -- recovered: exact -----------------------------------------------------------------------------

@pytest.mark.parametrize("method,calls", [
    ("choose", {1}), ("choose", {7}), ("choose_across", {1}),
    ("flush", {3}), ("flush", {40}), ("changed", {5}), ("changed", {200}), ("touched", {50}),
    ("stamp", {30}), ("state_used", {10}), ("evaluate", {100}),
])
def test_an_index_fault_is_recovered_exactly(monkeypatch, caplog, method, calls):
    hits_ref, trees_ref, victims_ref, _ = twin_run()
    assert len(victims_ref) > 30 and {p for p, _, _ in victims_ref} == {"kv", "mamba"}
    cc, runtime = serving()
    victims = []
    cc.settings.observer = lambda v: victims.append((v.pressure, v.kind, v.node.id))
    log = fail_at(monkeypatch, MarconiTreeIndex, method, calls)
    trees = []
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 60, 0, trees)
    if method == "choose_across":  # only under one byte budget: never called here
        assert not log
        return
    assert len(log) >= max(calls), f"{method} was called {len(log)} times: the fault was never injected"
    assert runtime.faults.recovered_count == 1 and runtime.faulted is None
    assert len(fault_warnings(caplog)) == 1
    # Node ids are the cache's own: compare what the victims were, not their ids.
    assert [(p, k) for p, k, _ in victims] == [(p, k) for p, k, _ in victims_ref]
    assert trees == trees_ref and hits == hits_ref
    cc.cache.marconi.index.check()
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "marconi"


def test_the_twin_comparison_can_tell_different_streams_apart():
    _, trees_a, _, _ = twin_run(seed=0)
    cc, _ = serving()
    trees_b = []
    serve(cc, 60, 1, trees_b)
    assert trees_a != trees_b


# -- unrecoverable: a rank alone falls back, a rank of a group stops ------------------------------

def check_fell_back(cc, runtime, caplog, served_after):
    assert runtime.faulted is not None and "Injected" in runtime.faulted
    assert len(fault_warnings(caplog)) == 2  # the recovery attempt, then the fallback
    assert any(h >= len(SYSTEM) - 64 for h in served_after), served_after  # the cache kept serving
    cc.check_no_leak()
    cc.cache.sanity_check()
    index = cc.cache.marconi.index
    assert index.root is None and not index._dirty and not index._struct  # no more upkeep
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "upstream"


def test_a_persistent_victim_choice_fault_falls_back_to_upstream_on_a_rank_alone(monkeypatch, caplog):
    cc, runtime = serving()
    log = fail_at(monkeypatch, MarconiTreeIndex, "choose", range(1, 10**9))
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    assert len(log) == 2  # the choice, its retry from a rebuilt index; never asked again
    evictions = runtime.figures.evicted_tokens
    assert evictions > 0 and runtime.figures.evicted_states > 0
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits += serve(cc, 20, seed=1)
    assert runtime.figures.evicted_tokens > evictions  # upstream's walks keep freeing memory
    check_fell_back(cc, runtime, caplog, hits[-20:])


def test_after_a_fallback_evictions_are_upstreams_lru(monkeypatch, caplog):
    cc, runtime = serving()
    fail_at(monkeypatch, MarconiTreeIndex, "choose", range(1, 10**9))
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        serve(cc, 30)
    assert runtime.faulted is not None
    counters = runtime.settings.counters
    before = (counters.evictions_leaf, counters.evictions_single_child, counters.evictions_fallback)
    oldest = cc.tree_core.lru_lists[MAMBA].get_lru_no_lock()
    assert oldest is not None
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cc.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert oldest.component_data[MAMBA].value is None or cc.tree_core._node_arena.get(oldest.id) is not oldest
    assert (counters.evictions_leaf, counters.evictions_single_child, counters.evictions_fallback) == before
    cc.check_no_leak()


@pytest.mark.parametrize("where", ["choose", "admission"])
def test_an_unrecoverable_fault_on_a_rank_of_a_group_stops_it_with_one_clear_error(monkeypatch, where):
    cc, runtime = serving(group=FakeGroup())
    if where == "choose":
        fail_at(monkeypatch, MarconiTreeIndex, "choose", range(1, 10**9))
    else:
        component = type(cc.cache.components[MAMBA])
        fail_at(monkeypatch, component, "_marconi_admits", {5})
    with pytest.raises(MarconiGroupFault) as raised:
        serve(cc, 40)
    message = str(raised.value)
    assert "\n" not in message and "rank 1 of a 2-rank TP/PP group" in message and "Injected" in message
    assert runtime.faulted is None  # it did not go on alone with upstream's rules


def test_an_admission_fault_falls_back_on_a_rank_alone(monkeypatch, caplog):
    cc, runtime = serving()
    component = type(cc.cache.components[MAMBA])
    fail_at(monkeypatch, component, "_marconi_admits", {5})
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    assert runtime.faulted is not None and "admission" in runtime.faulted
    assert len(fault_warnings(caplog)) == 1
    assert any(h >= len(SYSTEM) - 64 for h in hits[20:])
    cc.check_no_leak()


# -- rank-local: figures stop, the tree does not change --------------------------------------------

def test_a_failing_report_stops_the_figures_and_nothing_else(monkeypatch, caplog):
    hits_ref, trees_ref, _, _ = twin_run()
    cc, runtime = serving()
    monkeypatch.setattr(runtime, "on_match", lambda *a, **k: (_ for _ in ()).throw(Injected("on_match")))
    trees = []
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 60, 0, trees)
    assert trees == trees_ref and hits == hits_ref
    assert runtime.faulted is None and "metrics" in runtime.faults.rank_local_failures
    assert runtime.figures.requests == 0  # the figures stopped at the first failure
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "marconi"


def test_upstream_errors_still_propagate(monkeypatch):
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    cc, runtime = serving()
    serve(cc, 2)
    fail_at(monkeypatch, FullComponent, "redistribute_on_node_split", {1})
    with pytest.raises(Injected):  # SGLang's own hook raised: not Marconi's to swallow
        run_request(cc, SYSTEM[:150] + [7, 7, 7], 2)
    assert runtime.faulted is None


def test_a_second_fault_is_silent_and_the_fallback_callback_runs_once(caplog):
    faults = MarconiFaults()
    seen = []
    faults.on_fall_back = seen.append
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        faults.unrecoverable("first", Injected("a"))
        faults.unrecoverable("second", Injected("b"))
    assert seen == ["first: Injected: a"] and faults.fallen_back == "first: Injected: a"
    assert len(fault_warnings(caplog)) == 1

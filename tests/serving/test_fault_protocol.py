"""The fault protocol (`serving/faults.py`) on the paths `test_fault_guard.py` does not reach, on
SGLang's real cache classes on CPU, one fault per class, on one rank, at the worst offset:

- recoverable derived state, SWA: a fault in the plan's upkeep midway through stamping a window
  (after the first node's stamp, before the others'): the window times, the trees and the
  victims equal an unfaulted twin's after every request (the stamps are primary data, written
  whole before the plan hears of them);
- unrecoverable: a fault while writing primary data (window times, SWA; a state's use time or
  the probation registry, SSM) or in the SWA retain floor (admission): a rank alone falls back to
  upstream's rules and keeps serving, a rank of a group raises `MarconiGroupFault` (one line),
  never an arbitrary exception;
- repeated recoveries escalate: a hook that fails every time is recovered `RECOVERY_LIMIT` times,
  then treated as unrecoverable (alone: fallback; group: `MarconiGroupFault`), SSM and SWA; the
  bound counts in releases, the runtime's stream position;
- rank-local readbacks: a failing `/server_info` readback (Marconi's figures, the KV-event
  figures) does not take down SGLang's handler, and the tree is untouched.
"""

from __future__ import annotations

import functools
import itertools
import logging

import pytest

pytest.importorskip("sglang")

from sglang_cpu import FakeGroup, Injected, fail_at, tree_signature  # noqa: E402
from sglang_swa_cpu import SWA, build_swa_cache, session_requests  # noqa: E402
from test_fault_guard import SYSTEM, serve, serving  # noqa: E402

from sglang_marconi.policy.rules.probation import ProbationRegistry  # noqa: E402
from sglang_marconi.policy.rules.window_plan import WindowPlan  # noqa: E402
from sglang_marconi.serving import components  # noqa: E402
from sglang_marconi.serving.faults import (  # noqa: E402
    RECOVERY_LIMIT,
    RECOVERY_WINDOW,
    MarconiFaults,
    MarconiGroupFault,
)
from sglang_marconi.serving.swa_component import window_time  # noqa: E402
from sglang_marconi.serving.tree_index import MarconiTreeIndex  # noqa: E402

WINDOW = 64



def marconi_warnings(caplog):
    return [r for r in caplog.records if r.name == "sglang_marconi" and "Marconi fault" in r.getMessage()]


# -- SWA: the cache at its API, multi-turn sessions under SWA pool pressure ----------------------

def swa_signature(cc):
    """Every node as (path, SWA KV live), canonical order: what the victims left."""
    out, stack = [], [(cc.tree_core.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + tuple(child.key.token_ids)
            out.append((child_path, child.component_data[SWA].value is not None))
            stack.append((child, child_path))
    return sorted(out)


def recency_order(cc):
    """Every node's window time as its rank among the tree's window times: two caches fed the same
    stream from different starting clocks agree on it iff they recorded the same recency."""
    nodes = cc.nodes()
    ranks = {t: r for r, t in enumerate(sorted({window_time(n) for n in nodes}))}
    paths = {}
    for node in nodes:
        path, walk = [], node
        while walk.parent is not None:
            path[:0] = walk.key.token_ids
            walk = walk.parent
        paths[tuple(path)] = ranks[window_time(node)]
    return sorted(paths.items())


def serve_swa(cc, n, evicted=None):
    """n session turns: match (a hit stamps the window it reads), make room in the SWA pool,
    insert (stamps the window kept). Returns [(tree, recency)] after each request; appends the
    SWA tokens each request's eviction freed to `evicted`."""
    seen = []
    for tokens, _, _ in itertools.islice(session_requests(WINDOW, seed=0, live_sessions=24), n):
        hit = cc.match(tokens).device_prefix_len
        need, freed = len(tokens) - hit, 0
        while cc.allocator.swa_available_size() < need:
            before = cc.allocator.swa_available_size()
            freed += cc.evict_swa(need - before).swa_num_tokens_evicted
            assert cc.allocator.swa_available_size() > before, "SWA pool full of locked KV"
        if evicted is not None:
            evicted.append(freed)
        assert cc.insert(tokens, evicted=max(hit, len(tokens) - WINDOW), cached=hit) is not None
        cc.check_no_leak()
        seen.append((swa_signature(cc), recency_order(cc)))
    return seen


SWA_REQUESTS = 150


def swa_cache(faults=None):
    cc = build_swa_cache(kv_size=200_000, swa_size=3000, window=WINDOW)
    if faults is not None:
        cc.settings.faults = faults
    return cc


@functools.lru_cache(maxsize=1)
def swa_twin():
    cc = swa_cache()
    seen = serve_swa(cc, SWA_REQUESTS)
    figures = cc.settings.figures
    assert figures.evictions_stale > 10 and figures.evictions_leaf > 10, figures  # SWA pressure decided
    return seen, (figures.evictions_stale, figures.evictions_window, figures.evictions_leaf,
                  figures.evictions_fallback)


def fail_mid_stamp(monkeypatch, cc, at: int):
    """Raise in the plan's upkeep at the first node of the `at`-th window stamp that spans more
    than one node: the worst offset, the first stamp written and the rest not yet. Returns the
    count of such stamps seen."""
    component_class = type(cc.component)
    state = {"fresh": False, "seen": 0}
    stamp_window = component_class._marconi_stamp_window

    def tracked(self, node):
        state["fresh"] = True
        return stamp_window(self, node)

    stamped = WindowPlan.stamped

    def broken(self, node):
        if state["fresh"]:
            state["fresh"] = False
            if node.parent is not cc.tree_core.root_node and len(node.key) < WINDOW:  # the walk goes on
                state["seen"] += 1
                if state["seen"] == at:
                    raise Injected(f"injected into the plan's stamp upkeep at multi-node window {at}")
        return stamped(self, node)

    monkeypatch.setattr(component_class, "_marconi_stamp_window", tracked)
    monkeypatch.setattr(WindowPlan, "stamped", broken)
    return state


@pytest.mark.parametrize("at", [1, 40, 100])
def test_a_fault_midway_through_a_window_stamp_leaves_the_decisions_of_an_unfaulted_twin(monkeypatch, caplog, at):
    twin, twin_victims = swa_twin()
    cc = swa_cache()
    state = fail_mid_stamp(monkeypatch, cc, at)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        seen = serve_swa(cc, SWA_REQUESTS)
    assert state["seen"] >= at, "the fault was never injected"
    assert cc.settings.faults.recovered_count == 1 and cc.settings.faulted is None
    assert len(marconi_warnings(caplog)) == 1
    for i, ((tree, recency), (tree_ref, recency_ref)) in enumerate(zip(seen, twin)):
        assert recency == recency_ref, f"window times differ from the twin's after request {i}"
        assert tree == tree_ref, f"trees differ from the twin's after request {i}"
    f = cc.settings.figures
    assert (f.evictions_stale, f.evictions_window, f.evictions_leaf, f.evictions_fallback) == twin_victims
    cc.plan.check(cc.settings.alpha)


def fail_primary_stamp(monkeypatch, cc, at: int, evicted=()):
    """The window-time write fails midway at its `at`-th call: the first node stamped, the rest not.
    Returns the calls, and (the last entry) how many requests `evicted` had seen at the fault."""
    component_class = type(cc.component)
    write = component_class._marconi_write_window_time
    calls = []

    def broken(self, node, now):
        calls.append(len(evicted))
        if len(calls) == at:
            node._marconi_window_time = now
            raise Injected("injected into the window-time write")
        return write(self, node, now)

    monkeypatch.setattr(component_class, "_marconi_write_window_time", broken)
    return calls


def test_a_fault_writing_window_times_falls_back_on_a_rank_alone(monkeypatch, caplog):
    cc, evicted = swa_cache(), []
    calls = fail_primary_stamp(monkeypatch, cc, 30, evicted)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        serve_swa(cc, 100, evicted)
    assert len(calls) == 30  # never stamped again
    assert cc.settings.faulted is not None and "window stamp (recency)" in cc.settings.faulted
    assert cc.settings.faults.recovered_count == 0 and len(marconi_warnings(caplog)) == 1  # not derived state
    assert cc.plan.root is None  # no more upkeep: upstream's walk
    assert sum(evicted[calls[-1]:]) > 500  # and upstream's walk kept freeing SWA KV (serve_swa checked the ledgers)


def test_a_fault_writing_window_times_stops_a_group_with_one_line(monkeypatch):
    cc = swa_cache(MarconiFaults(group_size=2, rank=1))
    fail_primary_stamp(monkeypatch, cc, 30)
    with pytest.raises(MarconiGroupFault) as raised:
        serve_swa(cc, 80)
    message = str(raised.value)
    assert "\n" not in message and "rank 1 of a 2-rank" in message and "window stamp (recency)" in message
    assert cc.settings.faulted is None


@pytest.mark.parametrize("group", [False, True])
def test_a_plan_hook_that_fails_every_time_escalates_after_the_bound(monkeypatch, caplog, group):
    cc = swa_cache(MarconiFaults(group_size=2, rank=1) if group else None)
    calls, evicted = [], []

    def broken(self, node):
        if self.root is not None:
            calls.append(len(evicted))
            raise Injected("injected into every plan upkeep")

    monkeypatch.setattr(WindowPlan, "touched", broken)
    faults = cc.settings.faults
    if group:
        with pytest.raises(MarconiGroupFault) as raised:
            serve_swa(cc, 80)
        assert "recovery bound" in str(raised.value) and "\n" not in str(raised.value)
        assert faults.recovered_count == RECOVERY_LIMIT and cc.settings.faulted is None
        return
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        serve_swa(cc, 80, evicted)
    assert faults.recovered_count == RECOVERY_LIMIT and len(calls) == RECOVERY_LIMIT + 1
    assert cc.settings.faulted is not None and "recovery bound" in cc.settings.faulted
    assert len(marconi_warnings(caplog)) == 2  # the first recovery, then the fallback
    assert cc.plan.root is None and sum(evicted[calls[-1]:]) > 500  # upstream's walk from then on


# -- SSM: the scheduler's calls (sglang_cpu.run_request), both pressures ---------------------------

PRIMARY = [  # (owner, name, the call that fails, where the fault is reported)
    (components, "record_state_use", 12, "state use"),
    (ProbationRegistry, "add", 3, "probation"),
    (ProbationRegistry, "confirm", 3, "state use"),
    (ProbationRegistry, "forget", 5, "probation"),
    (ProbationRegistry, "oldest", 2, "probationary"),
]


@pytest.mark.parametrize("owner,name,at,where", PRIMARY, ids=[p[1] for p in PRIMARY])
def test_a_fault_in_primary_ssm_data_falls_back_on_a_rank_alone(monkeypatch, caplog, owner, name, at, where):
    cc, runtime = serving()
    seen = fail_at(monkeypatch, owner, name, {at})
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 50)
    assert len(seen) >= at, f"{name} was called {len(seen)} times: the fault was never injected"
    assert runtime.faulted is not None and "Injected" in runtime.faulted and where in runtime.faulted
    assert runtime.faults.recovered_count == 0 and len(marconi_warnings(caplog)) == 1
    assert any(h >= len(SYSTEM) - 64 for h in hits[-20:])  # the cache kept serving hits
    cc.cache.sanity_check()
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "upstream"


@pytest.mark.parametrize("owner,name,at,where", PRIMARY[:2], ids=[p[1] for p in PRIMARY[:2]])
def test_a_fault_in_primary_ssm_data_stops_a_group_with_one_line(monkeypatch, owner, name, at, where):
    cc, runtime = serving(FakeGroup())
    fail_at(monkeypatch, owner, name, {at})
    with pytest.raises(MarconiGroupFault) as raised:
        serve(cc, 50)
    message = str(raised.value)
    assert "\n" not in message and "rank 1 of a 2-rank" in message and where in message
    assert runtime.faulted is None


@pytest.mark.parametrize("group", [False, True])
def test_an_index_hook_that_fails_every_time_escalates_after_the_bound(monkeypatch, caplog, group):
    cc, runtime = serving(FakeGroup() if group else None)
    calls = []

    def broken(self, node):
        if self.root is not None:
            calls.append(1)
            raise Injected("injected into every index upkeep")

    monkeypatch.setattr(MarconiTreeIndex, "changed", broken)
    if group:
        with pytest.raises(MarconiGroupFault) as raised:
            serve(cc, 40)
        assert "recovery bound" in str(raised.value) and "\n" not in str(raised.value)
        assert runtime.faults.recovered_count == RECOVERY_LIMIT and runtime.faulted is None
        return
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        hits = serve(cc, 40)
    assert runtime.faults.recovered_count == RECOVERY_LIMIT and len(calls) == RECOVERY_LIMIT + 1
    assert runtime.faulted is not None and "recovery bound" in runtime.faulted
    assert len(marconi_warnings(caplog)) == 2  # the first recovery, then the fallback
    assert any(h >= len(SYSTEM) - 64 for h in hits[-15:])
    assert runtime.metrics(cc.cache)["marconi_eviction_policy"] == "upstream"


def test_the_recovery_bound_counts_in_the_runtimes_releases():
    cc, runtime = serving()
    serve(cc, 5)
    assert runtime.released == 5 and runtime.faults.position() == 5


def test_recoveries_spread_wider_than_the_window_never_escalate():
    faults, now = MarconiFaults(group_size=2), {"at": 0}
    faults.position = lambda: now["at"]
    for k in range(10):  # RECOVERY_LIMIT + 1 in any RECOVERY_WINDOW releases never happens
        now["at"] = k * (RECOVERY_WINDOW // RECOVERY_LIMIT + 1)
        assert faults.recovered("spread", Injected("x")) is True
    assert faults.recovered_count == 10
    now["at"] += RECOVERY_WINDOW - 1
    for _ in range(RECOVERY_LIMIT - 1):  # with the last one, RECOVERY_LIMIT in the window
        assert faults.recovered("burst", Injected("y")) is True
    with pytest.raises(MarconiGroupFault, match="recovery bound"):
        faults.recovered("burst", Injected("z"))


def test_a_rank_alone_past_the_bound_falls_back_once():
    faults, fell_back = MarconiFaults(), []
    faults.on_fall_back = fell_back.append
    results = [faults.recovered("again", Injected(str(k))) for k in range(RECOVERY_LIMIT + 3)]
    assert results == [True] * RECOVERY_LIMIT + [False] * 3
    assert len(fell_back) == 1 and "recovery bound" in fell_back[0] and faults.recovered_count == RECOVERY_LIMIT


# -- rank-local readbacks --------------------------------------------------------------------------

def test_a_failing_server_info_readback_does_not_take_down_the_handler(monkeypatch, caplog):
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from sglang_marconi.serving.metrics import add_marconi_state

    cc, runtime = serving()
    serve(cc, 10)
    tree = tree_signature(cc.cache)
    monkeypatch.setattr(runtime, "metrics", lambda cache: (_ for _ in ()).throw(Injected("readback")))
    controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cc.cache))
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        for _ in range(2):
            out = add_marconi_state(GetInternalStateReqOutput(internal_state={"x": 1}), controller, None)
    assert out.internal_state["x"] == 1
    entry = out.internal_state["marconi"]
    assert entry["marconi_eviction_policy"] == "marconi" and "Injected: readback" in entry["marconi_figures_error"]
    assert sum("server_info failed" in r.getMessage() for r in caplog.records) == 1  # one warning
    assert tree_signature(cc.cache) == tree and runtime.faulted is None
    monkeypatch.undo()
    out = add_marconi_state(GetInternalStateReqOutput(internal_state={}), controller, None)
    assert out.internal_state["marconi"]["marconi_requests"] == 10  # tried again at the next readback


def test_a_failing_kv_events_readback_does_not_take_down_the_handler(monkeypatch):
    from types import SimpleNamespace

    from sglang_marconi.serving import kv_events

    cc, runtime = serving()
    serve(cc, 3)
    monkeypatch.setattr(kv_events, "_dp_rank", lambda: (_ for _ in ()).throw(Injected("no parallel context")))
    state = {}
    controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cc.cache))
    kv_events.add_kv_events_state(None, controller, state)
    assert "Injected: no parallel context" in state["marconi_kv_events"]["readback_error"]
    assert "kv_events readback" in runtime.faults.rank_local_failures and runtime.faulted is None



@pytest.mark.parametrize("group", [False, True])
def test_a_fault_in_the_swa_retain_floor_is_unrecoverable(group):
    from sglang_swa_cpu import run_swa_request

    cc = build_swa_cache(kv_size=20_000, swa_size=4000, window=8)
    if group:
        cc.settings.faults = MarconiFaults(group_size=2, rank=1)
    settings = cc.cache.marconi.settings

    class BrokenWindow:  # what the floor reads of the settings: the window fails
        faults = settings.faults

        @property
        def window(self):
            raise Injected("injected into the retain floor")

    cc.cache.marconi.settings = BrokenWindow()
    prompt = list(range(1, 101))
    if group:
        with pytest.raises(MarconiGroupFault, match="swa_retain_floor"):
            run_swa_request(cc, prompt, range(10_000, 10_200))
        return
    for i in range(3):  # decodes long past the window: SGLang frees the out-of-window SWA KV
        run_swa_request(cc, prompt + [500 + i], range(10_000 * (i + 2), 10_000 * (i + 2) + 200))
        cc.check_no_leak()
    assert cc.settings.faulted is not None and "swa_retain_floor" in cc.settings.faulted
    assert cc.plan.root is None  # no more upkeep: upstream's eviction

"""Cluster replay (issue 17, item 1): routers, peeks, the load model, the CLI's cluster flags."""

import numpy as np
import pytest

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim import cli
from sglang_marconi.sim.cluster.cli import replay_cells
from sglang_marconi.sim.cluster.routers import (
    ROUTER_NAMES, CacheAware, CacheAwareConfig, SessionAffinity, WorkerView, build_router,
)
from sglang_marconi.sim.cluster.scaling import ShiftedCopies
from sglang_marconi.sim.cluster.workers import TokenWorker
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.workload import ListWorkload, Request

PROFILE = load_profile("paper-7b")


def small_workload(kind="swe-agent", sessions=6, scale=0.2, seed=3):
    return generate(kind, seed=seed, sessions=sessions, scale=scale)


def req(tokens, session="s", arrival=0.0, output=()):
    return Request(session, 0, arrival, np.asarray(tokens, dtype=np.int64), np.asarray(output, dtype=np.int64))


def tokens(start, n):
    return list(range(start, start + n))


@pytest.mark.parametrize("policy", ["sglang+", "marconi:1", "vllm+", "infinite"])
@pytest.mark.parametrize("router", ["round_robin", "cache_aware", "cache_aware_state"])
def test_one_worker_reproduces_the_single_server_replay(policy, router):
    """Peeks change nothing: one worker behind any router serves exactly what `replay` serves."""
    w = small_workload()
    single = replay(w, build_policy(policy, PROFILE, 2 * 10**9), PROFILE, 2 * 10**9, progress=False)
    (run,) = replay_cells(w, PROFILE, [router], [policy], [2 * 10**9], 1)
    assert run.per_request["hit_tokens"] == single.per_request["hit_tokens"]
    assert run.hit_tokens == single.hit_tokens and run.hit_tokens > 0


def test_peek_answers_both_questions_and_equals_the_hit_serving_gets():
    w = small_workload("system-prompt", sessions=40, scale=0.3)
    workers = [TokenWorker(build_policy("sglang+", PROFILE, 10**9)) for _ in range(3)]
    kv_only_hits = 0
    for i, r in enumerate(w):
        matches = [x.peek(r) for x in workers]
        assert all(m.reusable_tokens <= m.kv_tokens < r.input_len for m in matches)
        target = i % 3
        hit = workers[target].serve(r)
        assert hit == matches[target].reusable_tokens
        kv_only_hits += matches[target].kv_tokens > hit
    assert kv_only_hits > 0  # some requests found KV with no state: the two answers differ


def two_sglang_workers(capacity=10**6):
    return [TokenWorker(build_policy("sglang+", PROFILE, 10**9)) for _ in range(2)]


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker():
    prompt = tokens(0, 400)
    stream = [req(prompt + tokens(10_000 + 100 * u, 30), session=f"user{u}", arrival=10.0 * u) for u in range(8)]
    for router in ("cache_aware", "cache_aware_state"):
        (run,) = replay_cells(ListWorkload("shared", stream), PROFILE, [router], ["sglang+"], [10**10], 4)
        assert set(run.per_request["worker"]) == {0}  # the first goes to the idle worker 0, the rest follow
        assert run.hit_tokens > 0
    (rr,) = replay_cells(ListWorkload("shared", stream), PROFILE, ["round_robin"], ["sglang+"], [10**10], 4)
    assert rr.per_request["worker"] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_spill_gate_moves_requests_off_an_overloaded_matched_worker():
    """All arrive together (nothing finishes): worker 0 holds the prefix, its in-flight count k
    grows; with abs 2 and rel 1.5 it is overloaded once k > k/2 + 2 (margin min(2, max(4, ..)) = 2),
    i.e. from k = 5: the sixth request spills to worker 1, never earlier."""
    prompt = tokens(0, 300)
    stream = [req(prompt + tokens(5000 + 50 * u, 20), session=f"u{u}", arrival=0.0) for u in range(8)]
    work = ListWorkload("burst", stream)
    (gated,) = replay_cells(work, PROFILE, ["cache_aware"], ["sglang+"], [10**10], 2,
                            config=CacheAwareConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    assert gated.per_request["worker"][:6] == [0, 0, 0, 0, 0, 1]
    (default,) = replay_cells(work, PROFILE, ["cache_aware"], ["sglang+"], [10**10], 2)
    assert set(default.per_request["worker"]) == {0}  # smg's default margin (64) never trips here


def test_threshold_sends_a_weak_match_to_the_least_loaded_worker():
    """All at t=0 (nothing finishes): worker 0 holds two in flight when the weak match arrives."""
    prompt = tokens(0, 100)
    first = req(prompt + tokens(9000, 20))
    weak = req(prompt[:20] + tokens(7000, 200))  # matches 20 / 220 tokens on worker 0
    work = ListWorkload("t", [first, first, weak])
    (run,) = replay_cells(work, PROFILE, ["cache_aware"], ["sglang+"], [10**10], 2)
    assert run.per_request["worker"] == [0, 0, 1]  # 0.09 <= 0.3: least loaded
    (low,) = replay_cells(work, PROFILE, ["cache_aware"], ["sglang+"], [10**10], 2,
                          config=CacheAwareConfig(cache_threshold=0.05))
    assert low.per_request["worker"] == [0, 0, 0]  # 0.09 > 0.05: the match wins


def test_cache_aware_state_avoids_a_worker_whose_match_has_no_state():
    prefix = tokens(0, 100)
    w0, w1 = two_sglang_workers()
    w0.serve(req(prefix + tokens(1000, 20)))  # KV of `prefix` on w0, a state only at 120
    w1.serve(req(prefix[:50]))  # a state at 50 on w1
    probe = req(prefix + tokens(2000, 30))
    matches = [w.peek(probe) for w in (w0, w1)]
    assert [(m.kv_tokens, m.reusable_tokens) for m in matches] == [(100, 0), (50, 50)]
    view = WorkerView([0, 0], [0.0, 0.0], matches)
    full = CacheAware(CacheAwareConfig(), state_aware=False)
    state = CacheAware(CacheAwareConfig(), state_aware=True)
    assert full.choose("s", probe.input_len, view) == (0, 100)  # believes in 100 tokens on w0 ...
    assert state.choose("s", probe.input_len, view) == (1, 50)
    assert w0.peek(probe) == matches[0]  # the peeks changed nothing
    assert w0.serve(probe) == 0  # ... which were not there
    assert w1.serve(probe) == 50


def test_every_router_on_a_synthetic_trace():
    w = small_workload("lmsys", sessions=12, scale=0.3)
    runs = replay_cells(w, PROFILE, list(ROUTER_NAMES), ["sglang+"], [2 * 10**9], 3)
    by = {r.router: r for r in runs}
    sessions = w.session_ids()
    for r in runs:
        assert r.requests == len(w) and sum(r.requests_per_worker) == len(w)
        assert sum(r.per_request["hit_tokens"]) == r.hit_tokens
        assert 0 < r.token_hit_rate < 1 and r.modeled_ttft_p95_s >= r.modeled_ttft_p50_s > 0
        assert r.flops_saved == pytest.approx(r.flops_total - sum(r.prefill_flops_per_worker))
        work = np.asarray(r.prefill_flops_per_worker)
        assert r.imbalance_cv == pytest.approx(work.std() / work.mean())
    counts = by["round_robin"].requests_per_worker
    assert max(counts) - min(counts) <= 1
    placed = {}
    for s, worker in zip(sessions, by["session"].per_request["worker"]):
        assert placed.setdefault(s, worker) == worker  # a session never moves
    assert by["cache_aware_state"].expected_missed_tokens == 0  # it counts only reusable points
    assert by["cache_aware"].expected_missed_tokens >= 0
    assert by["round_robin"].expected_tokens is None
    # affinity matters on multi-turn chat: both cache-aware routers beat round robin
    assert by["cache_aware"].token_hit_rate > by["round_robin"].token_hit_rate
    assert by["cache_aware_state"].token_hit_rate > by["round_robin"].token_hit_rate


def test_kv_block_caches_run_behind_routers():
    w = small_workload("sharegpt", sessions=8, scale=0.5)
    runs = replay_cells(w, PROFILE, ["round_robin", "cache_aware"], ["kv-lru"], [10**9], 2, block_size=16)
    assert runs[1].token_hit_rate > runs[0].token_hit_rate > 0
    assert runs[1].expected_missed_tokens == 0  # KV-only: a block held is a block reusable


def test_session_ring_moves_few_sessions_when_a_worker_joins():
    names = [f"sess-{i}" for i in range(2000)]
    four, five = SessionAffinity(4), SessionAffinity(5)
    before = [four.worker_of(s) for s in names]
    after = [five.worker_of(s) for s in names]
    moved = sum(a != b for a, b in zip(before, after))
    assert all(b == 4 for a, b in zip(before, after) if a != b)  # only onto the new worker
    assert 0.1 < moved / len(names) < 0.3  # about 1/5
    assert max(np.bincount(before)) / len(names) < 0.35


def test_shifted_copies_share_nothing():
    w = small_workload("sharegpt", sessions=4, scale=0.5)
    one = replay(w, build_policy("sglang+", PROFILE, 10**11), PROFILE, 10**11, progress=False)
    two = replay(ShiftedCopies(w, 2), build_policy("sglang+", PROFILE, 10**11), PROFILE, 10**11, progress=False)
    assert len(ShiftedCopies(w, 2)) == 2 * len(w)
    assert two.per_request["hit_tokens"] == 2 * one.per_request["hit_tokens"]
    arrivals = [r.arrival_s for r in ShiftedCopies(w, 3)]
    assert arrivals == sorted(arrivals)


@pytest.mark.parametrize("argv, needle", [
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--workers", "2", "--routers", "cache_awareish"], "unknown router 'cache_awareish'"),
    (["--routers", "session"], "--routers needs --workers N"),
    (["--workers", "2", "--cache-threshold", "1.5"], "--cache-threshold must be in [0, 1], got 1.5"),
    (["--workers", "2", "--balance-rel-threshold", "0.5"], "--balance-rel-threshold must be finite and >= 1, got 0.5"),
    (["--workers", "2", "--balance-abs-threshold", "-1"], "--balance-abs-threshold must be an integer >= 0, got -1"),
    (["--workers", "2", "--policies", "marconi-best"], "'marconi-best'"),
    (["--workers", "2", "--policies", "lru"], "unknown policy 'lru'"),
])
def test_bad_cluster_flags_give_one_line_errors(argv, needle, capsys):
    rc = cli.main(["--workload", "synthetic:sharegpt:sessions=2", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and needle in err, err


def test_cli_prints_one_row_per_router_policy_capacity(tmp_path, capsys):
    out = tmp_path / "c.json"
    rc = cli.main(["--workload", "synthetic:sharegpt:sessions=6,scale=0.5", "--no-progress", "--workers", "2",
                   "--routers", "round_robin,cache_aware_state", "--policies", "sglang+,kv-lru",
                   "--capacity", "1GB,2GB", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    import json

    rows = json.loads(out.read_text())
    assert [(r["router"], r["policy"], r["capacity_bytes"]) for r in rows] == [
        (ro, p, c) for p in ("sglang+", "kv-lru") for c in (10**9, 2 * 10**9)
        for ro in ("round_robin", "cache_aware_state")]
    assert text.count("cache_aware_state") == 4 and all(r["workers"] == 2 for r in rows)


def test_build_router_names():
    for name in ROUTER_NAMES:
        assert build_router(name, 3).name == name


def _bench_cluster():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_cluster.py"
    spec = importlib.util.spec_from_file_location("bench_cluster", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_live_flag_delegates_to_the_live_script_or_says_it_is_missing(tmp_path, monkeypatch, capsys):
    bench = _bench_cluster()
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    (tmp_path / "scripts").mkdir()
    assert bench.main(["--live", "--workers", "2"]) == 2
    assert capsys.readouterr().out.strip().count("\n") == 0  # one line: not available
    (tmp_path / "scripts" / "bench_cluster_live.py").write_text(
        "def main(argv):\n    print('live', argv)\n    return 7\n")
    assert bench.main(["--live", "--workers", "2"]) == 7
    assert "live ['--workers', '2']" in capsys.readouterr().out

"""Parallel serving through a real SGLang server on this CPU (SGLang's CPU engine, tiny hybrid
models, our launcher): `--tp-size 2` (gated delta net), `--pp-size 2` (Mamba2: SGLang's
Nemotron-H model supports PP, its Qwen3-Next one asserts a single stage) and `--dp-size 2` (Mamba2).

- Tensor and pipeline parallel: two ranks (two TP ranks, or two PP stages) run the same
  scheduling, each on its own tree, under SGLang's rank-consensus checker
  (`SGLANG_ENABLE_RANK_CONSENSUS_CHECKER=1`: a scheduler exits on any divergence of
  `match_prefix` / `insert` / `evict`). A concurrent workload on small pools (many distinct
  prompts, some sharing a long prefix) evicts all the time; every request completes, warm
  responses equal cold ones, and the shadow tuner moves the cache off LRU, on every rank at the
  same point of the stream (the leader's directive rides the requests: no collective of ours on
  the batch path, where under PP one would deadlock stage 0 against stage 1).
- `--scheduler-recv-interval 4` on two TP ranks (SGLang skips three receives of four while
  decoding, and a skipped receive drops what the leader added to it): every directive the leader
  sends is applied by both ranks at the same iteration (each rank logs each one it applies).
- Data parallel: each replica has its own cache and tuner (`/server_info` has one `marconi`
  entry per replica; a prefix cached by one replica is not a hit on the other), and the
  Prometheus gauges carry the replica's `dp_rank`.

The PyNccl guard and the per-rank CPU shares these servers need: `tests/cpu_engine/
cpu_distributed.py`, `live_server.cpu_engine_env`.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import requests

pytest.importorskip("sglang")

from http_api import Generation, flush_cache, generate, metric_samples, same_up_to_numeric_ties  # noqa: E402

REQUEST_TIMEOUT_S = 120  # one request; the whole workload gets WORKLOAD_TIMEOUT_S
WORKLOAD_TIMEOUT_S = 240

# Small pools: the long prefix and a few one-offs fill them. The tuner decides every 2 sampled
# requests; its choice takes effect every 8 releases (the sync point where the TP ranks agree).
TP_ARGS = (
    "--tp-size", "2", "--max-total-tokens", "1500", "--max-mamba-cache-size", "8",
    "--max-running-requests", "4", "--chunked-prefill-size", "256",
    "--marconi-tune-epoch", "2", "--marconi-tune-sync-every", "8",
)
# The workload: a long, valuable prefix revisited every 8th request, one-offs of 150-250 tokens
# in between. LRU lets the one-offs push the prefix out before it comes back (no hit at all in
# the shadow LRU cache); FLOP-aware eviction keeps it. It is sent in waves of WAVE requests, all
# of a wave at once, until the cache has left LRU (the policy core's tuner, fed this stream in
# order or shuffled within windows, leaves LRU after about 50 requests; the choice takes effect
# at a later sync point), then AFTER_SWITCH more waves, served with the tuner's choice: the long
# prefix is kept and hit from then on (112 requests, 4 hits of 640 tokens, in the runs so far).
LONG, EVERY, MAX_NEW = 640, 8, 8
WAVE, MAX_WAVES, AFTER_SWITCH = 16, 16, 3
DIVERGENCE = "Found rank divergence"


def tokens(seed: int, n: int) -> list[int]:
    """n random word ids (2..511: never a special token)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def prompt(i: int) -> list[int]:
    if i % EVERY == 0:
        return tokens(1, LONG) + tokens(10_000 + i, 30)
    return tokens(20_000 + i, 150 + (37 * i) % 100)


def server_info(url: str) -> dict:
    r = requests.get(url + "/server_info", timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


def run_concurrently(url: str, prompts, workers: int = 6) -> list[Generation]:
    """All prompts at once from `workers` clients (more than the server runs at a time, so some
    queue); fails, naming the stragglers, if they are not all answered in WORKLOAD_TIMEOUT_S."""
    pool = ThreadPoolExecutor(workers)
    try:
        futures = [pool.submit(generate, url, p, MAX_NEW) for p in prompts]
        _, pending = wait(futures, timeout=WORKLOAD_TIMEOUT_S)
        assert not pending, f"{len(pending)} of {len(futures)} requests unanswered after {WORKLOAD_TIMEOUT_S} s"
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung request ends when its server is stopped


def class_server(tiny_model, tmp_path_factory, model: str, args, log_name: str, consensus: bool = True):
    """A server of `model` with `args` for one test class (a fixture's body: yields it, stops it
    before the next class starts its own); `consensus`: under SGLang's rank-consensus checker."""
    from live_server import start_server

    log = tmp_path_factory.mktemp("server-logs") / log_name
    server = start_server(tiny_model(model), extra_args=args, log_path=log, hard_limit_s=900,
                          env={"SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1"} if consensus else None)
    yield server
    server.stop()


def assert_workload_completed(responses, before: dict, after: dict) -> None:
    """Every prompt answered in order and in full, and counted once by the cache (`before` and
    `after`: its figures around the workload)."""
    assert [r.input_ids for r in responses] == [prompt(i) for i in range(len(responses))]
    assert all(len(r.output_ids) == MAX_NEW for r in responses)
    assert after["marconi_requests"] - before["marconi_requests"] == len(responses)


def assert_warm_equals_cold(url: str, hits) -> None:
    """Each hit's response equals the one the same prompt gets on an empty cache."""
    for warm in hits:
        flush_cache(url)
        cold = generate(url, warm.input_ids, MAX_NEW)
        assert cold.cached_tokens == 0
        assert (result := same_up_to_numeric_ties(warm, cold, 1e-2)), result.detail


def assert_ranks_agreed(server) -> str:
    """The rank-consensus checker ran and found no divergence; returns the server's log."""
    log = server.log_path.read_text(errors="replace")
    assert "Rank consensus checker is enabled" in log  # the check ran
    assert DIVERGENCE not in log, next(line for line in log.splitlines() if DIVERGENCE in line)[:2000]
    return log


def test_each_rank_gets_its_share_of_the_cpus(monkeypatch):
    """What live_server hands a parallel server: SGLang wants SGLANG_CPU_OMP_THREADS_BIND once
    ranks outnumber NUMA nodes, and ranks sharing two cores should not each run two threads."""
    from live_server import cpu_engine_env, parallel_ranks, threads_bind

    assert parallel_ranks(["--tp-size", "2", "--dp-size=2", "--max-total-tokens", "1500"]) == 4
    assert parallel_ranks(["--tensor-parallel-size", "2", "--tp-size", "1", "--pp-size", "3"]) == 3
    assert parallel_ranks([]) == 1
    assert threads_bind(2, [0, 1]) == "0|1"
    assert threads_bind(2, [0, 1, 2, 3, 6]) == "0-1|2-3"
    assert threads_bind(3, [0, 1, 4, 5, 6, 8]) == "0-1|4-5|6,8"
    assert threads_bind(4, [0, 1]) == "0|1|0|1"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    env = cpu_engine_env(ranks=2)
    assert (env["OMP_NUM_THREADS"], env["SGLANG_CPU_OMP_THREADS_BIND"]) == ("1", "0|1")
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_engine_env() and cpu_engine_env()["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "1|0")  # the caller's choice stands
    assert cpu_engine_env(ranks=2)["SGLANG_CPU_OMP_THREADS_BIND"] == "1|0"


# ---------------------------------------------------------------- --tp-size 2


@pytest.fixture(scope="class")
def tp_server(tiny_model, tmp_path_factory):
    """A `--tp-size 2` server for one test class."""
    yield from class_server(tiny_model, tmp_path_factory, "gated-delta", TP_ARGS, "tp2-gated-delta.log")


def switches(figures: dict) -> int:
    return figures["marconi_choice_switches"]


def evicting_workload(url: str):
    """(responses in prompt order, /server_info before, after) of the workload: waves until the
    cache has switched its eviction choice (or MAX_WAVES), then AFTER_SWITCH more."""
    before = after = server_info(url)
    responses, after_switch = [], 0
    while len(responses) < MAX_WAVES * WAVE and after_switch < AFTER_SWITCH:
        switched = switches(after["internal_states"][0]["marconi"]) > 0
        first = len(responses)
        responses += run_concurrently(url, [prompt(i) for i in range(first, first + WAVE)])
        after = server_info(url)
        after_switch += switched
    return responses, before, after


@pytest.fixture(scope="class")
def tp_workload(tp_server):
    return evicting_workload(tp_server.url)
class TestTensorParallel:
    """Two TP ranks, each its own tree, under SGLang's rank-consensus checker."""

    def test_one_marconi_cache_per_attention_tp_group(self, tp_server):
        info = server_info(tp_server.url)
        assert info["tp_size"] == 2
        states = info["internal_states"]  # one per attention-TP group: its rank 0 reports
        assert len(states) == 1 and "marconi" in states[0], [sorted(s) for s in states]

    def test_concurrent_evicting_workload_completes(self, tp_server, tp_workload):
        responses, before, after = tp_workload
        old, new = before["internal_states"][0]["marconi"], after["internal_states"][0]["marconi"]
        assert_workload_completed(responses, old, new)
        evictions = lambda f: f["marconi_evictions_leaf"] + f["marconi_evictions_single_child"]  # noqa: E731
        assert evictions(new) > evictions(old), new
        # The check below can fail: different prompts give different greedy outputs.
        assert len({tuple(r.output_ids) for r in responses}) == len(responses)
        assert requests.get(tp_server.url + "/health_generate", timeout=REQUEST_TIMEOUT_S).status_code == 200

    def test_warm_responses_equal_cold_ones(self, tp_server, tp_workload):
        responses = tp_workload[0]
        hits = [r for r in responses if r.cached_tokens > 0]
        assert len(hits) >= 2, [r.cached_tokens for r in responses]
        assert_warm_equals_cold(tp_server.url, hits)

    def test_ranks_never_diverged(self, tp_server, tp_workload):
        assert_ranks_agreed(tp_server)
        assert tp_server.process.poll() is None

    def test_tuner_switched_its_choice(self, tp_server, tp_workload):
        responses, _, after = tp_workload
        figures = after["internal_states"][0]["marconi"]
        assert figures["marconi_tuning_failures"] == 0
        assert figures["marconi_choice"] != "lru", (len(responses), figures)
        assert figures["marconi_choice_switches"] >= 1, figures


# ------------------------------------------ --tp-size 2 --scheduler-recv-interval 4

# SGLang receives (and broadcasts) requests only every 4th decode step: a directive handed out on
# a skipped receive must come out again on the next. Sync points every 2 releases and a tuner that
# decides every request make directives frequent.
SKIP_ARGS = (*TP_ARGS[:TP_ARGS.index("--marconi-tune-epoch")], "--marconi-tune-epoch", "1",
             "--marconi-tune-sync-every", "2", "--scheduler-recv-interval", "4",
             "--log-level", "info")  # each rank logs each directive it applies
SKIP_MAX_WAVES = 8  # the directive came at about 60 releases in the runs so far
APPLIED = re.compile(r"^\[[^\]]* TP(\d)\] Marconi directive (\d+) applied at iteration (\d+) after (\d+) releases")


def applied_by_rank(log_path) -> dict[str, list[tuple[int, int, int]]]:
    """(directive, iteration, releases) of each directive each TP rank applied, from its log lines."""
    applied = {"0": [], "1": []}
    for line in log_path.read_text(errors="replace").splitlines():
        if m := APPLIED.match(line):
            applied[m.group(1)].append(tuple(int(g) for g in m.groups()[1:]))
    return applied


@pytest.fixture(scope="class")
def skip_server(tiny_model, tmp_path_factory):
    yield from class_server(tiny_model, tmp_path_factory, "gated-delta", SKIP_ARGS, "tp2-recv-interval-4.log")


class TestSkippedReceives:
    """`--scheduler-recv-interval 4` on two TP ranks under concurrent evicting load."""

    def test_every_rank_applies_every_directive_at_the_same_iteration(self, skip_server):
        url = skip_server.url
        before = server_info(url)["internal_states"][0]["marconi"]
        # Waves until a whole wave has run after the first directive, or SKIP_MAX_WAVES.
        responses, figures, waves_with_directive = [], before, 0
        while len(responses) < SKIP_MAX_WAVES * WAVE and waves_with_directive < 2:
            first = len(responses)
            responses += run_concurrently(url, [prompt(i) for i in range(first, first + WAVE)])
            figures = server_info(url)["internal_states"][0]["marconi"]
            waves_with_directive += figures["marconi_directives_sent"] > 0
        assert_workload_completed(responses, before, figures)
        # A directive still out when the load stops comes back at a later receive (an idle
        # scheduler keeps polling; a request makes sure).
        deadline = time.monotonic() + 30
        while True:
            applied = applied_by_rank(skip_server.log_path)
            figures = server_info(url)["internal_states"][0]["marconi"]
            sent = figures["marconi_directives_sent"]
            if len(applied["0"]) == len(applied["1"]) == figures["marconi_directives_applied"] == sent:
                break
            assert time.monotonic() < deadline, (applied, figures["marconi_directives_applied"], sent)
            generate(url, tokens(50, 20), 1)
            time.sleep(0.5)
        assert skip_server.process.poll() is None
        # Every directive, in order, none lost (a gap stops every rank), on both ranks at the same
        # iteration and the same point of the request stream.
        assert sent >= 1, "no directive was sent: the test would prove nothing"
        assert [seq for seq, _, _ in applied["0"]] == list(range(len(applied["0"])))
        assert applied["0"] == applied["1"]
        assert figures["marconi_tuning_failures"] == 0
        assert "MarconiError" not in assert_ranks_agreed(skip_server)
        print(f"{len(responses)} requests, {sent} directives, {figures['marconi_choice_switches']} switches")


# ---------------------------------------------------------------- --pp-size 2

PP_ARGS = ("--pp-size", "2", *TP_ARGS[2:])


@pytest.fixture(scope="class")
def pp_server(tiny_model, tmp_path_factory):
    """A `--pp-size 2` server (two stages of the Mamba2 hybrid) for one test class."""
    yield from class_server(tiny_model, tmp_path_factory, "mamba2", PP_ARGS, "pp2-mamba2.log")


@pytest.fixture(scope="class")
def pp_workload(pp_server):
    return evicting_workload(pp_server.url)


def gauge_by_pp_rank(url: str, name: str) -> dict[str, float]:
    samples = [s for s in metric_samples(url) if s.name == name]
    return {s.labels["pp_rank"]: s.value for s in samples}


class TestPipelineParallel:
    """Two PP stages, each its own scheduler and tree (its own layers), under SGLang's
    rank-consensus checker; stage 0 leads (reads the requests, runs the only tuner)."""

    def test_concurrent_evicting_workload_completes(self, pp_server, pp_workload):
        responses, before, after = pp_workload
        old, new = before["internal_states"][0]["marconi"], after["internal_states"][0]["marconi"]
        assert_workload_completed(responses, old, new)
        assert new["marconi_evictions_leaf"] + new["marconi_evictions_single_child"] > 0, new
        assert len({tuple(r.output_ids) for r in responses}) == len(responses)  # can fail: outputs differ

    def test_every_stage_switched_at_the_same_point(self, pp_server, pp_workload):
        responses, _, after = pp_workload
        figures = after["internal_states"][0]["marconi"]
        assert figures["marconi_tuning_failures"] == 0 and figures["marconi_choice_switches"] >= 1, figures
        # Both stages publish their gauges (pp_rank label): the same requests, the same switches,
        # every directive applied on both (published at most once a second and when idle).
        deadline = time.monotonic() + 30
        while True:
            per_stage = {name: gauge_by_pp_rank(pp_server.url, f"sglang:{name}") for name in
                         ("marconi_requests", "marconi_choice_switches", "marconi_directives_applied")}
            if all(len(v) == 2 and len(set(v.values())) == 1 for v in per_stage.values()):
                break
            assert time.monotonic() < deadline, per_stage
            time.sleep(0.5)
        assert per_stage["marconi_choice_switches"]["1"] >= 1
        assert per_stage["marconi_requests"]["1"] >= len(responses)

    def test_warm_responses_equal_cold_ones(self, pp_server, pp_workload):
        hits = [r for r in pp_workload[0] if r.cached_tokens > 0]
        assert len(hits) >= 2, [r.cached_tokens for r in pp_workload[0]]
        assert_warm_equals_cold(pp_server.url, hits[:4])

    def test_stages_never_diverged(self, pp_server, pp_workload):
        assert_ranks_agreed(pp_server)
        assert pp_server.process.poll() is None


# ---------------------------------------------------------------- --dp-size 2


def routed_generate(url: str, input_ids: list[int], dp_rank: int) -> Generation:
    """Greedy generation on one DP replica (`routed_dp_rank`), which the response names."""
    r = requests.post(url + "/generate", timeout=REQUEST_TIMEOUT_S, json={
        "input_ids": input_ids, "routed_dp_rank": dp_rank,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    })
    r.raise_for_status()
    body = r.json()
    meta = body["meta_info"]
    assert meta["dp_rank"] == dp_rank, meta
    return Generation(input_ids, body["output_ids"], [], meta["prompt_tokens"], meta["cached_tokens"])


def replica_figures(url: str) -> list[dict]:
    """The `marconi` entry of each replica's internal state, in the order /server_info lists
    them (which is not the replicas' order: it changes from call to call)."""
    states = server_info(url)["internal_states"]
    assert len(states) == 2 and all("marconi" in s for s in states), [sorted(s) for s in states]
    return [s["marconi"] for s in states]


def per_replica_changes(before: list[dict], after: list[dict], keys) -> list[set[tuple]]:
    """Each replica's change in `keys` (a tuple per replica), for each way of pairing the two
    unordered lists of figures in which every counter grew or stayed."""
    pairings = []
    for order in ((0, 1), (1, 0)):
        changes = {tuple(after[j][k] - before[i][k] for k in keys) for i, j in enumerate(order)}
        if all(v >= 0 for change in changes for v in change):
            pairings.append(changes)
    return pairings


def marconi_gauge_by_dp_rank(url: str, name: str) -> dict[str, float]:
    samples = [s for s in metric_samples(url) if s.name == name]
    assert all("dp_rank" in s.labels for s in samples), [s.labels for s in samples]
    assert len(samples) == 2, [(s.labels, s.value) for s in samples]
    return {s.labels["dp_rank"]: s.value for s in samples}


@pytest.fixture(scope="class")
def dp_server(tiny_model, tmp_path_factory):
    """A `--dp-size 2` server (the default CPU pools) for one test class; the Mamba2 hybrid, where
    the TP tests serve the gated-delta one."""
    yield from class_server(tiny_model, tmp_path_factory, "mamba2", ("--dp-size", "2"), "dp2-mamba2.log",
                            consensus=False)


class TestDataParallel:
    """Two replicas, each its own scheduler, cache and tuner."""

    def test_replicas_have_their_own_cache_and_tuner(self, dp_server):
        keys = ("marconi_requests", "marconi_hit_tokens", "marconi_tuner_requests_fed")
        before = replica_figures(dp_server.url)
        first = tokens(30, 200)
        g0 = routed_generate(dp_server.url, first, 0)
        second = first + g0.output_ids + tokens(31, 40)
        turn = routed_generate(dp_server.url, second, 0)  # replica 0 holds the first turn
        assert turn.cached_tokens >= len(first) + MAX_NEW - 1
        elsewhere = routed_generate(dp_server.url, second, 1)  # replica 1 never saw it
        assert elsewhere.cached_tokens == 0
        assert elsewhere.output_ids == turn.output_ids  # same weights, same greedy answer
        third = routed_generate(dp_server.url, second + turn.output_ids + tokens(32, 30), 0)
        assert third.cached_tokens >= len(second) + MAX_NEW - 1
        # Requests, hit tokens and requests fed to the tuner, of replica 0 and of replica 1.
        expected = {(3, turn.cached_tokens + third.cached_tokens, 3), (1, 0, 1)}
        deadline = time.monotonic() + 30  # a tuner is fed in batches, or when its replica goes idle
        while expected not in (changes := per_replica_changes(before, after := replica_figures(dp_server.url), keys)):
            assert time.monotonic() < deadline, (changes, expected)
            time.sleep(0.5)
        for figures in after:  # a tuner per replica
            assert figures["marconi_shadow_scores"] and figures["marconi_tuning_failures"] == 0

    def test_marconi_gauges_are_separated_per_replica(self, dp_server):
        """`sglang:marconi_requests` has one series per replica (`dp_rank` label), each counting
        only the requests that replica served."""
        name = "sglang:marconi_requests"
        before = marconi_gauge_by_dp_rank(dp_server.url, name)
        for i, rank in enumerate((0, 0, 0, 1)):
            routed_generate(dp_server.url, tokens(40 + i, 60), rank)
        deadline = time.monotonic() + 30  # published at most once a second, and when idle
        while True:
            after = marconi_gauge_by_dp_rank(dp_server.url, name)
            deltas = {rank: after[rank] - before.get(rank, 0.0) for rank in after}
            if deltas == {"0": 3.0, "1": 1.0} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert deltas == {"0": 3.0, "1": 1.0}, (before, after)
        assert sorted(after.values()) == sorted(float(f["marconi_requests"]) for f in replica_figures(dp_server.url))

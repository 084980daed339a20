"""Online tuning in the server, on SGLang's real cache: the shadow tuner runs in a background
process fed without blocking, makes the same decisions as the simulator's on the same request
stream, and a dying or stalled tuner leaves the cache serving with its current choice."""

import logging
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving as marconi_serving  # noqa: E402
from sglang_cpu import run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.tuning.shadow_tuner import LRU, ShadowTuner, choice_label  # noqa: E402
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.runtime import served_pools  # noqa: E402

SYSTEM = list(range(1, 401))


class WorkerKillingProfile:
    """nemotron-h-8b's figures here; unpickling it (in the tuner process) kills that process."""

    def __init__(self):
        self._p = load_profile("nemotron-h-8b")

    def __getattr__(self, name):
        return getattr(self.__dict__["_p"], name)

    def __reduce__(self):
        return (os._exit, (3,))


LONG = list(range(200_000, 201_200))


@pytest.fixture(autouse=True)
def fresh_request_ids(monkeypatch):
    """Request ids ("req-N", `sglang_cpu.make_request`) are the tuner's session keys here, and its
    evidence splits sessions into halves by key: number them from 0 in every test, so that its
    decisions do not depend on how many requests other tests made before in this process."""
    import itertools

    import sglang_cpu

    monkeypatch.setattr(sglang_cpu, "_request_ids", itertools.count())


def workload(n):
    """A long, valuable prefix revisited every 8th request, and short one-offs in between: LRU lets
    the one-offs push it out, FLOP-aware eviction keeps it."""
    for i in range(n):
        if i % 8 == 0:
            yield LONG + list(range(50_000 + 40 * i, 50_000 + 40 * i + 30))
        else:
            yield list(range(100_000 + 700 * i, 100_000 + 700 * i + 100 + 7 * (i % 20)))


def drive(cc, n, fed=None):
    for tokens in workload(n):
        req, _ = run_request(cc, tokens, 6, chunk_end=chunk_end_for_branch)
        cc.check_no_leak()
        if fed is not None:
            fed.append((str(req.session_id or req.rid), list(req.origin_input_ids), list(req.output_ids)))


def wait_ready(runtime, timeout=60):
    deadline = time.monotonic() + timeout
    while not runtime.tuner.ready:
        assert time.monotonic() < deadline, "the tuner process did not start"
        time.sleep(0.02)


CONFIG = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), seglen_weights=(50.0,))


def test_background_tuner_decides_as_the_simulator_does_on_the_same_stream():
    cc, runtime = marconi_serving(CONFIG, kv_size=2500, mamba_size=8)
    assert runtime.settings.use_upstream_lru  # LRU until the shadows say otherwise
    wait_ready(runtime)
    fed = []
    drive(cc, 120, fed)
    runtime.close()  # waits until the process has observed everything
    assert runtime.tuner.dropped == 0 and runtime.tuner.failed is None
    served = runtime.tuner_log
    # The simulator's tuner over the same stream, given what the live cache was given (its shadows
    # model the served cache on those pools: `runtime.served_pools`).
    pools = served_pools(cc.cache, CONFIG)
    assert (pools.kv_tokens, pools.mamba_slots, pools.strategy) == (2500, 8, "no_buffer")
    sim = ShadowTuner(runtime.profile, 1, CONFIG.tuning(), probation=CONFIG.probation, served=pools)
    for key, inp, out in fed:
        sim.observe(key, np.array(inp), np.array(out[:-1]))
    assert served.decisions == sim.log.decisions and len(served.decisions) > 1
    assert served.requests == sim.log.requests == 120 and served.forked_at == sim.log.forked_at
    figures = runtime.metrics(cc.cache)
    assert figures["marconi_choice"] == choice_label(served.decisions[-1][1]) != LRU
    assert runtime.choice == served.decisions[-1][1]
    assert set(figures["marconi_shadow_scores"]) == {"lru", "0", "2", "20", "seglen:50", "depth:1", "depth:4",
                                                     "depth:auto", "coverage"}
    assert list(figures["marconi_shadow_scores"].values()) == pytest.approx(list(sim.scores))
    assert figures["marconi_tuner_requests_fed"] == figures["marconi_tuner_requests_observed"] == 120


def test_inline_tuner_adopts_the_same_choices():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), tune_workers=0),
                                  kv_size=2500, mamba_size=8)
    drive(cc, 120)
    runtime.close()
    assert runtime.tuner_log.decisions[-1][1] == runtime.choice != LRU


def test_dying_tuner_keeps_the_choice_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr("sglang_marconi.serving.background_tuner._CHECK_EVERY_S", 0.0)
    cc, runtime = marconi_serving(CONFIG, profile=WorkerKillingProfile(), kv_size=2500, mamba_size=8)
    with caplog.at_level(logging.WARNING):
        runtime.tuner._proc.join(timeout=60)  # dies unpickling its arguments
        drive(cc, 60)
        runtime.close()
    assert runtime.tuner.failed and "exited" in runtime.tuner.failed
    assert caplog.text.count("Marconi tuning stopped") == 1
    assert runtime.settings.use_upstream_lru  # the choice in force when it died
    figures = runtime.metrics(cc.cache)
    assert figures["marconi_requests"] == 60 and figures["marconi_tuning_failures"] == 1


def test_a_stalled_tuner_never_holds_the_scheduler_longer_than_the_sync_wait(monkeypatch):
    """The scheduler waits for the tuner's verdict at most --marconi-tune-sync-wait-ms per sync
    point (50 ms here), never the stall timeout (60 s here): a late verdict keeps the choice."""
    config = MarconiServingConfig(alpha=None, tune_timeout_s=60.0, tune_sync_every=8, tune_sync_wait_s=0.05)
    cc, runtime = marconi_serving(config, kv_size=2500, mamba_size=8)
    wait_ready(runtime)
    os.kill(runtime.tuner._proc.pid, signal.SIGSTOP)
    try:
        drive(cc, 40)  # five sync points
        figures = runtime.metrics(cc.cache)
        # (the first asks for the verdict as of release 0, which the child recorded at start)
        assert figures["marconi_sync_waits_late"] == 4 and figures["marconi_requests"] == 40
        # Guaranteed: each wait ends at its deadline (50 ms) plus one poll; 1 s each covers a
        # loaded machine and is still far below the 60 s an unbounded wait would have taken.
        assert figures["marconi_sync_wait_seconds"] < 5 * 1.0
        assert runtime.tuner.failed is None and runtime.settings.use_upstream_lru  # the choice in force stays
    finally:
        os.kill(runtime.tuner._proc.pid, signal.SIGCONT)
    drive(cc, 40)
    runtime.close()
    assert runtime.tuner.failed is None and runtime.tuner_log.requests == 80  # it caught up: nothing lost


def test_stalled_tuner_is_given_up_and_serving_goes_on(caplog, monkeypatch):
    monkeypatch.setattr("sglang_marconi.serving.background_tuner._CHECK_EVERY_S", 0.0)
    config = MarconiServingConfig(alpha=None, tune_timeout_s=0.3, tune_sync_every=8)
    cc, runtime = marconi_serving(config, kv_size=2500, mamba_size=8)
    wait_ready(runtime)
    os.kill(runtime.tuner._proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING):
            drive(cc, 16)
            time.sleep(0.5)  # the oldest request handed over has waited more than the stall limit
            drive(cc, 24)  # the next health check gives the child up; the next sync point stops tuning
        assert runtime.tuner.failed and "unread" in runtime.tuner.failed
        assert caplog.text.count("Marconi tuning stopped") == 1
        figures = runtime.metrics(cc.cache)
        assert figures["marconi_requests"] == 40 and figures["marconi_tuning_failures"] == 1
        assert runtime.tuning_failed and not runtime.tuning
        assert runtime.settings.use_upstream_lru  # the choice in force when it stalled
    finally:
        os.kill(runtime.tuner._proc.pid, signal.SIGCONT)
        runtime.close()


def test_idle_periods_longer_than_the_stall_limit_never_stop_tuning(monkeypatch):
    """A stall is measured from the oldest request the child has not read, not from the last time it
    read one: a server idle for longer than the limit keeps tuning (it used to give up). The limit is
    5 s through the idle period and the health check after it, then 60 s (the default) for the
    traffic that follows, which only has to show tuning carry on: how far the nice-19 child lags
    behind 115 requests depends on the machine's load. (The sync wait is raised so that the switch
    this test expects is not merely late.)"""
    monkeypatch.setattr("sglang_marconi.serving.background_tuner._CHECK_EVERY_S", 0.0)
    config = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), seglen_weights=(50.0,),
                                  tune_timeout_s=5.0, tune_sync_every=8, tune_sync_wait_s=60.0)
    cc, runtime = marconi_serving(config, kv_size=2500, mamba_size=8)
    wait_ready(runtime)
    drive(cc, 5)  # a partial batch: handed over when the scheduler goes idle
    runtime.on_idle()
    deadline = time.monotonic() + 30
    while runtime.tuner.observed < 5:
        assert time.monotonic() < deadline, "the partial batch never reached the tuner"
        time.sleep(0.01)
    time.sleep(11.0)  # idle: more than two stall limits
    runtime.on_idle()
    runtime.tuner._check_health(time.monotonic())  # what the next request's put would check first
    assert runtime.tuner.failed is None, runtime.tuner.failed
    runtime.tuner.stall_s = 60.0
    drive(cc, 115)
    runtime.on_idle()
    assert runtime.tuner.failed is None and runtime.tuning_failed is None
    figures = runtime.metrics(cc.cache)
    assert figures["marconi_tuning_failures"] == 0 and figures["marconi_choice_switches"] >= 1
    runtime.close()
    assert runtime.tuner_log.requests == 120


def test_retune_off_adopts_the_first_decision_only():
    config = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), tune_workers=0, retune=False)
    cc, runtime = marconi_serving(config, kv_size=2500, mamba_size=8)
    drive(cc, 120)
    assert len(runtime.adoptions) == 1 and runtime.adoptions[0][1] == runtime.choice != LRU  # the first, kept
    assert runtime.tuner.fed < 120  # nothing fed after it


def test_seglen_choice_ranks_by_replay_length_in_sglangs_cache():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=0.0), kv_size=2500, mamba_size=8)  # no tuner
    runtime.settings.choice = "seglen:100"  # as a directive from the tuner would
    assert runtime.choice == "seglen:100" and runtime.metrics(cc.cache)["marconi_eviction_policy"] == "seglen"
    drive(cc, 40)
    index = cc.cache.marconi.index
    index.check()  # every entry equals a from-scratch evaluation, replay lengths included
    assert all(e == int(e) for e in index.indexes[0].efficiency[: len(index.indexes[0])])  # token counts
    assert runtime.settings.counters.evictions_leaf > 0 and runtime.settings.counters.stale_repairs == 0
    runtime.settings.choice = 1.0  # back to FLOP efficiency: the index is rebuilt at the next eviction
    drive(cc, 20)
    index.check()
    runtime.close()


def test_fixed_alpha_does_not_tune():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=0.5), kv_size=2500, mamba_size=8)
    drive(cc, 20)
    assert runtime.tuner is None and runtime.alpha == 0.5 and not runtime.settings.use_upstream_lru
    assert runtime.metrics(cc.cache)["marconi_shadow_scores"] == {}


def test_blocked_hit_tokens_counted_when_state_is_missing():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=0.0))
    for i in range(2):  # the 2nd request's full-KV hit (the prompt) has no state yet
        run_request(cc, SYSTEM + [90_000 + i], 3, chunk_end=chunk_end_for_branch)
    assert runtime.figures.blocked_tokens > 0


def test_a_dropped_tuner_stops_its_child_before_its_shared_memory_is_reused():
    """Without close(): the child must not outlive the object, or it would keep writing into shared
    memory that multiprocessing's heap hands to the next tuner (it did: zeroed a later tuner's scores)."""
    import gc

    from sglang_marconi.policy.tuning.tuner_spec import TunerSpec
    from sglang_marconi.serving.background_tuner import BackgroundShadowTuner

    tuner = BackgroundShadowTuner(TunerSpec("hybrid", load_profile("nemotron-h-8b"), 10**9, CONFIG.tuning(),
                                            dict(state_slots=8, checkpoint_grid=64)))
    deadline = time.monotonic() + 60
    while not tuner.ready:
        assert time.monotonic() < deadline, "the tuner process did not start"
        time.sleep(0.02)
    child = tuner._proc
    assert child.is_alive()
    del tuner
    gc.collect()
    child.join(timeout=10)
    assert not child.is_alive()


def test_background_and_inline_tuning_make_identical_decisions():
    """The shadows in their background process and on the scheduler thread decide the same: the
    same switches at the same requests, the same hits, whenever the background one answers within
    the sync wait (raised here so that it always does; a late verdict is counted and taken later)."""
    base = dict(alpha=None, alpha_grid=(0.0, 2.0, 20.0), seglen_weights=(50.0,), tune_sync_every=8,
                tune_sync_wait_s=60.0)
    runs = []
    for workers in (1, 0):
        cc, runtime = marconi_serving(MarconiServingConfig(**base, tune_workers=workers), kv_size=2500, mamba_size=8)
        if workers:
            wait_ready(runtime)
        hits = [run_request(cc, tokens, 6, chunk_end=chunk_end_for_branch)[1] for tokens in workload(160)]
        runs.append((list(runtime.adoptions), hits, runtime.sync_waits_late))
        runtime.close()
    (bg_adoptions, bg_hits, late), (inline_adoptions, inline_hits, _) = runs
    assert late == 0 and len(inline_adoptions) >= 1  # it switched: the comparison means something
    assert bg_adoptions == inline_adoptions and bg_hits == inline_hits

"""Online alpha tuning and the serving figures, on SGLang's real cache: tuning runs in worker
processes without blocking requests, and a dying worker leaves the cache serving."""

import logging
import os

import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving as marconi_serving  # noqa: E402
from sglang_cpu import run_request  # noqa: E402

from sglang_marconi.policy.model_profile import load_profile  # noqa: E402
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

SYSTEM = list(range(1, 401))


class WorkerKillingProfile:
    """nemotron-h-8b's figures here; unpickling it (in a tuning worker) kills that process."""

    def __init__(self):
        self._p = load_profile("nemotron-h-8b")

    def __getattr__(self, name):
        return getattr(self.__dict__["_p"], name)

    def __reduce__(self):
        return (os._exit, (3,))


def workload(n):
    for i in range(n):
        if i % 4 == 0:
            yield SYSTEM + list(range(50_000 + 40 * i, 50_000 + 40 * i + 30))
        else:
            yield list(range(100_000 + 700 * i, 100_000 + 700 * i + 300 + 7 * (i % 50)))


def drive(cc, n):
    for tokens in workload(n):
        run_request(cc, tokens, 6, chunk_end=chunk_end_for_branch)
        cc.check_no_leak()


def test_tuning_windows_run_in_workers_and_serving_never_waits():
    config = MarconiServingConfig(alpha=None, bootstrap_multiplier=1, alpha_grid=(0.0, 1.0, 3.0), tune_workers=1)
    cc, runtime = marconi_serving(config, kv_size=3000, mamba_size=12)
    assert runtime.settings.use_upstream_lru  # LRU until a window says otherwise
    drive(cc, 80)
    runtime.close()  # waits for the replay in flight
    log = runtime.tuner.log
    assert runtime.tuner.window_len >= 1 and log.windows and log.failures == 0
    assert all(len(w) == 4 for w in log.windows)  # LRU + three alphas
    figures = runtime.metrics(cc.cache)
    assert figures["marconi_requests"] == 80
    assert 0 < figures["marconi_token_hit_rate"] < 1 and figures["marconi_prefill_flops_saved"] > 0
    assert figures["marconi_ssm_states_cached"] > 0
    assert figures["marconi_alpha"] == runtime.alpha


def test_dying_tuning_worker_leaves_the_cache_serving(caplog):
    config = MarconiServingConfig(alpha=None, bootstrap_multiplier=1, alpha_grid=(0.0, 1.0), tune_workers=1)
    cc, runtime = marconi_serving(config, profile=WorkerKillingProfile(), kv_size=3000, mamba_size=12)
    with caplog.at_level(logging.WARNING):
        drive(cc, 60)
        runtime.close()
    assert runtime.tuner.log.failures >= 1
    assert "alpha tuning failed" in caplog.text
    assert runtime.metrics(cc.cache)["marconi_requests"] == 60


def test_fixed_alpha_does_not_tune():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=0.5), kv_size=3000, mamba_size=12)
    drive(cc, 20)
    assert runtime.tuner is None and runtime.alpha == 0.5 and not runtime.settings.use_upstream_lru


def test_blocked_hit_tokens_counted_when_state_is_missing():
    cc, runtime = marconi_serving(MarconiServingConfig(alpha=0.0))
    for i in range(2):  # the 2nd request's full-KV hit (the prompt) has no state yet
        run_request(cc, SYSTEM + [90_000 + i], 3, chunk_end=chunk_end_for_branch)
    assert runtime.figures.blocked_tokens > 0

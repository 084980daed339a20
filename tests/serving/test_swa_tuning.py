"""Alpha tuning of the served sliding-window cache (`serving/swa_runtime.py`): the window shadows
(`policy/tuning/window_tuner.py`, the simulator's tuner) see the served stream, are the model of the
served cache on its two pools (`policy/tree/served_window_cache.py`: the rule the server runs), and
their decisions take effect at sync points exactly as the SSM runtime's do; the component's
eviction ranks with the alpha in force."""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang")

import sglang_swa_cpu  # noqa: E402

from sglang_marconi.policy.tree.served_window_cache import ServedWindowCache  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.swa_runtime import SWARuntime  # noqa: E402
from sglang_marconi.sim.synthetic import generate  # noqa: E402

WINDOW = 32
SWA_POOL = 600
CONFIG = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 20.0), tune_workers=0, tune_epoch=2, tune_sync_every=4)


def swa_serving(config=CONFIG):
    cc = sglang_swa_cpu.build_swa_cache(kv_size=40_000, swa_size=SWA_POOL, window=WINDOW)
    runtime = SWARuntime(cc.cache, cc.settings, config)
    cc.cache.marconi.runtime = runtime
    return cc, runtime


def stream(n):
    """Short multi-turn chats (30 sessions) on an SWA pool of 600 tokens: in the model of the served
    cache alpha 20 keeps what saves most (measured over the whole stream: 24,774 hit tokens, recency
    alone 9,087), so the shadows leave the start."""
    for r in list(generate("lmsys", sessions=30, scale=0.05, seed=1))[:n]:
        yield f"{r.session_id}-{r.turn}", r.input_tokens.tolist(), r.output_tokens.tolist()


def serve(cc, runtime, n):
    hits = []
    for key, tokens, output in stream(n):
        hit = cc.match(tokens).device_prefix_len
        cc.insert(tokens, evicted=max(0, len(tokens) - WINDOW), cached=0) if hit == 0 else cc.insert(
            tokens, evicted=max(hit, len(tokens) - WINDOW), cached=hit)
        hits.append(hit)
        runtime.on_release(SimpleNamespace(rid=key, session_id=key, origin_input_ids=tokens, output_ids=output,
                                           cached_tokens=hit))
    return hits


def test_the_window_shadows_model_the_served_pools():
    cc, runtime = swa_serving()
    spec = runtime.tuner_spec(cc.cache)
    profile = cc.settings.profile
    full, swa = 40_000 * profile.kv_bytes_per_token, SWA_POOL * profile.swa_kv_bytes_per_token
    assert spec.kind == "window" and spec.capacity_bytes == int(full + swa)
    assert spec.options["swa_share"] == pytest.approx(swa / (full + swa))
    assert spec.options["pools"] == (40_000, SWA_POOL)
    shadows = runtime.tuner.tuner.shadows
    assert [type(s) for s in shadows] == [ServedWindowCache] * 2 and [s.alpha for s in shadows] == [0.0, 20.0]
    assert {(s.kv_pool, s.swa_pool, s.window) for s in shadows} == {(40_000, SWA_POOL, WINDOW)}
    assert cc.settings.alpha == 0.0  # the tuner's safe start: recency alone over Marconi's candidates


def test_a_decision_takes_effect_at_the_sync_point_after_it_and_the_plan_ranks_with_it():
    cc, runtime = swa_serving()
    serve(cc, runtime, 465)
    decisions = runtime.tuner.tuner.decisions
    assert decisions, "the window shadows never switched: the test would prove nothing"
    assert runtime.adoptions, runtime.metrics(cc.cache)
    for released, alpha in runtime.adoptions:
        assert released % CONFIG.tune_sync_every == 0
        as_of = released - CONFIG.tune_sync_every
        assert alpha == [a for at, a in decisions if at <= as_of][-1]
    assert cc.settings.alpha == runtime.adoptions[-1][1] and cc.component.marconi_plan is not None
    figures = runtime.metrics(cc.cache)
    assert figures["marconi_choice_switches"] == len(runtime.adoptions) and figures["marconi_alpha"] == cc.settings.alpha
    assert set(figures["marconi_shadow_scores"]) == {"0", "20"}
    cc.check_no_leak()

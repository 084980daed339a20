"""Marconi's figures in `/server_info` (through the HookRegistry hook on the scheduler's
internal-state readback) and as Prometheus gauges."""

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
pytest.importorskip("prometheus_client")

from sglang_cpu import build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.metrics import GAUGES, PrometheusGauges, add_marconi_state, register_hooks  # noqa: E402

SYSTEM = list(range(1, 301))


def served_cache():
    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=0.0))
    for i in range(4):
        run_request(cc, SYSTEM + [70_000 + i] * 20, 5, chunk_end=chunk_end_for_branch)
    return cc, runtime


def test_internal_state_hook_adds_marconi_figures():
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    cc, runtime = served_cache()
    controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cc.cache))
    out = add_marconi_state(GetInternalStateReqOutput(internal_state={"x": 1}), controller, None)
    figures = out.internal_state["marconi"]
    assert out.internal_state["x"] == 1
    assert figures["marconi_requests"] == 4 and figures["marconi_token_hit_rate"] > 0
    assert set(GAUGES) <= set(figures)


def test_hook_is_applied_to_the_scheduler_readback():
    from sglang.srt.managers.scheduler_components import internal_state
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_marconi.serving.two_pass_prefill import uninstall_two_pass_prefill_hook

    controller_cls = internal_state.SchedulerInternalStateController
    register_hooks()
    try:
        HookRegistry.apply_hooks()
    finally:  # apply_hooks() applies every registered hook: leave the scheduler's others as found
        uninstall_two_pass_prefill_hook()
    assert getattr(controller_cls.get_internal_state, "__wrapped__", None) is not None

    cc, _ = served_cache()  # also sets the scheduler's global server args, which the readback reads
    controller = controller_cls(scheduler=SimpleNamespace(tree_cache=cc.cache), record_step_time=False)
    # The readback's other contributors describe a GPU scheduler (topology, memory, ...): silence
    # them on this instance so SGLang's real readback runs with only our hook contributing.
    for name in dir(controller):
        if name.startswith("_add_"):
            setattr(controller, name, lambda state: None)
    result = controller.get_internal_state(None)
    assert result.internal_state["marconi"]["marconi_requests"] == 4


@pytest.fixture(scope="module")
def exporter():
    return PrometheusGauges({"model_name": "test-model"})  # one per process: the registry is global


def test_prometheus_gauges_follow_the_figures(exporter):
    from prometheus_client import REGISTRY

    cc, runtime = served_cache()
    runtime.exporter = exporter
    run_request(cc, SYSTEM + [80_000] * 10, 3, chunk_end=chunk_end_for_branch)
    value = REGISTRY.get_sample_value("sglang:marconi_requests", {"model_name": "test-model"})
    assert value == 5
    hit = REGISTRY.get_sample_value("sglang:marconi_token_hit_rate", {"model_name": "test-model"})
    assert hit == pytest.approx(runtime.metrics(cc.cache)["marconi_token_hit_rate"])


def test_choice_and_shadow_scores_are_gauges_by_choice(exporter):
    from prometheus_client import REGISTRY

    config = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0), seglen_weights=(5.0,), tune_workers=0)
    cc, runtime = build_marconi_serving(config, kv_size=2500, mamba_size=8)
    runtime.exporter = exporter
    for i in range(12):
        run_request(cc, SYSTEM + [60_000 + i] * 30, 4, chunk_end=chunk_end_for_branch)
    figures = runtime.metrics(cc.cache)
    labels = lambda choice: {"model_name": "test-model", "choice": choice}  # noqa: E731
    assert set(figures["marconi_shadow_scores"]) == {"lru", "0", "2", "seglen:5"}
    for choice, score in figures["marconi_shadow_scores"].items():
        assert REGISTRY.get_sample_value("sglang:marconi_shadow_score", labels(choice)) == pytest.approx(score)
        current = REGISTRY.get_sample_value("sglang:marconi_choice", labels(choice))
        assert current == float(choice == figures["marconi_choice"])

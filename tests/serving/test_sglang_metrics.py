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


# -- the gauges: SGLang's scheduler labels, the stats rank, SGLang's cadence --------------------

BASE_RANKS = dict(tp_rank=0, pp_rank=0, moe_ep_rank=0, dp_rank=None, attn_tp_rank=0, attn_cp_rank=0)


def publish_args(**kwargs):
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=1, **kwargs)
    args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(args)
    return args


def sglang_scheduler_labels(server_args):
    """What SGLang's own `SchedulerMetricsCollector.init_new` computes here: its labels and whether
    this rank publishes (the collector class is SGLang's, given a constructor that only keeps the
    labels, so no gauge is registered)."""
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.runtime_context import get_schedule

    captured = {}

    class LabelsOnly(SchedulerMetricsCollector):
        def __init__(self, labels, **kwargs):
            captured.update(labels)

    ctx = LabelsOnly.init_new(server_args=server_args, enable_lora=False, enable_hierarchical_cache=False,
                              enable_priority_scheduling=get_schedule().enable_priority_scheduling)
    return captured, ctx.current_scheduler_metrics_enabled


@pytest.mark.parametrize("server_args, ranks", [
    (dict(), {}),
    (dict(tp_size=2), dict(tp_rank=1, attn_tp_rank=1)),  # a TP rank that is not the stats rank
    (dict(tp_size=2, enable_metrics_for_all_schedulers=True), dict(tp_rank=1, attn_tp_rank=1)),
    (dict(pp_size=2, dp_size=2), dict(pp_rank=1, dp_rank=1)),  # a PP stage of a DP replica
    (dict(tp_size=4, attn_cp_size=2, enable_priority_scheduling=True, extra_metric_labels={"zone": "a"},
          disaggregation_mode="prefill"), dict(tp_rank=3, attn_tp_rank=1, attn_cp_rank=1, dp_rank=1)),
    (dict(tp_size=4, attn_cp_size=2), dict(tp_rank=2, attn_tp_rank=0, attn_cp_rank=1)),
])
@pytest.mark.parametrize("metrics", [True, False])
def test_labels_and_publishing_rank_are_sglangs(server_args, ranks, metrics):
    from sglang.srt.runtime_context import get_parallel

    from sglang_marconi.serving.metrics import publishes_scheduler_metrics, scheduler_metric_labels

    args = publish_args(enable_metrics=metrics, served_model_name="test-model", **server_args)
    with get_parallel().override(**{**BASE_RANKS, **ranks}):
        labels, publishes = sglang_scheduler_labels(args)
        if metrics:
            assert scheduler_metric_labels() == labels
        assert publishes_scheduler_metrics() == publishes


class Figures:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        figures = {key: float(self.calls) for key in GAUGES}
        return {**figures, "marconi_shadow_scores": {"lru": 1.0, "0": 2.0}, "marconi_choice": "0"}


@pytest.fixture(scope="module")
def labels():
    from sglang.srt.runtime_context import get_parallel

    from sglang_marconi.serving.metrics import scheduler_metric_labels

    publish_args(enable_metrics=True, served_model_name="test-model")
    with get_parallel().override(**BASE_RANKS):
        return {k: str(v) for k, v in scheduler_metric_labels().items()}


def test_maybe_publish_at_most_once_per_interval_and_what_was_left_when_idle(labels):
    exporter = PrometheusGauges(labels, interval_s=1.0)
    figures = Figures()
    assert exporter.maybe_publish(figures, now=100.0)  # the first one publishes
    assert not exporter.maybe_publish(figures, now=100.4)  # throttled: the figures are not even read
    assert not exporter.maybe_publish(figures, now=100.9)
    assert figures.calls == 1
    assert exporter.maybe_publish(figures, now=101.0)
    assert not exporter.maybe_publish(figures, now=101.2)  # leaves figures unpublished...
    assert exporter.maybe_publish(figures, now=101.3, idle=True)  # ...which the idle path publishes
    assert not exporter.maybe_publish(figures, now=101.4, idle=True)  # nothing left: wait for the interval
    assert exporter.maybe_publish(figures, now=102.3, idle=True)  # idle, an interval later (the tuner moves on)
    assert figures.calls == exporter.publishes == 4


def test_gauges_carry_sglangs_labels_and_follow_the_figures(labels):
    from prometheus_client import REGISTRY

    exporter = PrometheusGauges(labels, interval_s=3600.0)  # the burst below fits in one interval on any machine
    assert set(labels) == {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    cc, runtime = served_cache()
    runtime.exporter = exporter
    exporter.last_publish = None
    run_request(cc, SYSTEM + [80_000] * 10, 3, chunk_end=chunk_end_for_branch)
    value = REGISTRY.get_sample_value("sglang:marconi_requests", labels)
    assert value == 5  # published at once: the first publish is never throttled
    for i in range(20):  # a burst within one interval: no publish per request
        run_request(cc, SYSTEM + [81_000 + i] * 10, 3, chunk_end=chunk_end_for_branch)
    assert exporter.publishes == 1 and REGISTRY.get_sample_value("sglang:marconi_requests", labels) == 5
    exporter.last_publish -= exporter.interval_s  # an interval later the scheduler is idle
    runtime.on_idle()
    assert REGISTRY.get_sample_value("sglang:marconi_requests", labels) == 25
    hit = REGISTRY.get_sample_value("sglang:marconi_token_hit_rate", labels)
    assert hit == pytest.approx(runtime.metrics(cc.cache)["marconi_token_hit_rate"])


def test_choice_and_shadow_scores_are_gauges_by_choice(labels):
    from prometheus_client import REGISTRY

    exporter = PrometheusGauges(labels)
    config = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0), seglen_weights=(5.0,), tune_workers=0)
    cc, runtime = build_marconi_serving(config, kv_size=2500, mamba_size=8)
    runtime.exporter = exporter
    for i in range(12):
        run_request(cc, SYSTEM + [60_000 + i] * 30, 4, chunk_end=chunk_end_for_branch)
    figures = runtime.metrics(cc.cache)
    exporter.publish(figures)  # what the next interval's publish shows
    by_choice = lambda choice: {**labels, "choice": choice}  # noqa: E731
    assert set(figures["marconi_shadow_scores"]) == {"lru", "0", "2", "seglen:5", "depth:1", "depth:4", "depth:auto", "coverage"}
    for choice, score in figures["marconi_shadow_scores"].items():
        assert REGISTRY.get_sample_value("sglang:marconi_shadow_score", by_choice(choice)) == pytest.approx(score)
        current = REGISTRY.get_sample_value("sglang:marconi_choice", by_choice(choice))
        assert current == float(choice == figures["marconi_choice"])


@pytest.mark.parametrize("server_args, ranks, exported", [
    (dict(enable_metrics=True), {}, True),
    (dict(enable_metrics=True, tp_size=2), dict(tp_rank=1, attn_tp_rank=1), False),
    (dict(enable_metrics=True, tp_size=2, enable_metrics_for_all_schedulers=True), dict(tp_rank=1, attn_tp_rank=1), True),
    (dict(enable_metrics=False), {}, False),
])
def test_factory_builds_the_exporter_only_where_sglang_publishes(monkeypatch, labels, server_args, ranks, exported):
    from sglang.srt.runtime_context import get_parallel
    from test_factory import build_context
    from transformers import NemotronHConfig

    from sglang_marconi.serving.config import ENV_VAR
    from sglang_marconi.serving.plugin import marconi_radix_cache_factory

    monkeypatch.setenv(ENV_VAR, MarconiServingConfig(alpha=1.0).to_env())  # no tuner process here
    ctx, _ = build_context(NemotronHConfig())
    ctx.server_args = publish_args(served_model_name="test-model", **server_args)
    with get_parallel().override(**{**BASE_RANKS, **ranks}):
        cache = marconi_radix_cache_factory(ctx)
    exporter = cache.marconi_runtime.exporter
    assert (exporter is not None) == exported
    if exported:
        assert exporter.labels == {**labels, "tp_rank": str(ranks.get("tp_rank", 0))}

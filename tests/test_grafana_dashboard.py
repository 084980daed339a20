"""The Grafana dashboard (`examples/monitoring/grafana/marconi-dashboard.json`, written by
`scripts/grafana_dashboard.py`): every panel's query names a gauge the server exports (the gauge
tables of `serving/metrics.py`, which the live tests find on /metrics:
`test_live_server.py::test_figures_and_gauges_agree_with_the_responses`, `test_live_swa.py`), the
committed JSON is what the script writes, and the panels the issue asks for are there."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "grafana_dashboard.py"


def _script():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_gauges() -> set[str]:
    from sglang_marconi.serving import metrics

    return set(metrics.GAUGES) | set(metrics.SWA_GAUGES) | set(metrics.LABELED_GAUGES)


def test_every_query_names_an_exported_gauge():
    script = _script()
    dashboard = json.loads(script.DEFAULT_OUT.read_text())
    named = script.metric_names(dashboard)
    assert named and named <= exported_gauges(), sorted(named - exported_gauges())
    for p in dashboard["panels"]:
        assert p["targets"], p["title"]
        for target in p["targets"]:
            assert script.metric_names({"panels": [{"targets": [target]}], "templating": {"list": [{"query": ""}]}}), \
                (p["title"], target["expr"])


def test_the_check_fails_on_a_gauge_the_server_does_not_export():
    script = _script()
    dashboard = script.build()
    dashboard["panels"][0]["targets"][0]["expr"] = "sglang:marconi_no_such_gauge"
    assert "marconi_no_such_gauge" in script.metric_names(dashboard) - exported_gauges()


def test_committed_json_is_what_the_script_writes():
    assert _script().DEFAULT_OUT.read_text() == _script().render(), "run: python scripts/grafana_dashboard.py"


def test_panels_cover_hits_flops_choice_evictions_and_tuner_health():
    script = _script()
    named = script.metric_names(script.build())
    for needed in ("marconi_token_hit_rate", "marconi_device_hit_tokens", "marconi_host_hit_tokens",
                   "marconi_prefill_flops_saved", "marconi_choice", "marconi_shadow_score",
                   "marconi_evictions_leaf", "marconi_evictions_window", "marconi_tuning_failures",
                   "marconi_tuner_requests_observed", "marconi_sync_waits_late"):
        assert needed in named, needed
    ids = [p["id"] for p in script.build()["panels"]]
    assert len(ids) == len(set(ids))
    positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in script.build()["panels"]]
    assert len(positions) == len(set(positions))  # no panel drawn over another

"""Write the Grafana dashboard for Marconi's `sglang:marconi_*` gauges.

    python scripts/grafana_dashboard.py [--out examples/monitoring/grafana/marconi-dashboard.json]

It follows the conventions of SGLang's own dashboard (`examples/monitoring/grafana/dashboards/json/
sglang-dashboard.json` in SGLang's repository): a Prometheus datasource chosen at import
(`${DS_PROMETHEUS}`), a `model_name` variable, timeseries panels on a 24-column grid. Import it
beside SGLang's dashboard, with the same Prometheus scraping `--enable-metrics` servers.

The gauges are cumulative counts published at most once a second by the stats rank, so rates use
`deriv` / `delta` (gauges, not counters) and every series keeps SGLang's labels (tp_rank, pp_rank,
dp_rank). `tests/test_grafana_dashboard.py` checks that every query names a gauge the server
exports and that the committed JSON is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "examples" / "monitoring" / "grafana" / "marconi-dashboard.json"
SEL = '{model_name=~"$model_name"}'
WINDOW = "[$__rate_interval]"
RANK = "tp{{tp_rank}} pp{{pp_rank}}"


def g(name: str) -> str:
    """A Marconi gauge with the dashboard's model filter."""
    return f"sglang:{name}{SEL}"


def per_s(name: str) -> str:
    return f"deriv({g(name)}{WINDOW})"


def delta_of(name: str, window: str = "[5m]") -> str:
    return f"delta({g(name)}{window})"


# (title, unit, description, [(expr, legend)]): the rows of the dashboard, two panels a row.
PANELS = [
    ("Token hit rate (last 5 min)", "percentunit",
     "Share of input tokens whose prefill the cache skipped, over the last 5 minutes (and since start-up).",
     [(f"{delta_of('marconi_hit_tokens')} / {delta_of('marconi_input_tokens')}", f"last 5 min {RANK}"),
      (g("marconi_token_hit_rate"), f"since start {RANK}")]),
    ("Hit and input tokens per second", "short",
     "Input tokens released through the cache and those whose prefill was skipped.",
     [(per_s("marconi_input_tokens"), f"input {RANK}"), (per_s("marconi_hit_tokens"), f"hit {RANK}"),
      (per_s("marconi_blocked_hit_tokens"), f"KV hit without a state {RANK}")]),
    ("Hit tokens by tier (HiCache write_back)", "short",
     "Hit tokens per second found on the device and loaded back from the host tier, and the host's share.",
     [(per_s("marconi_device_hit_tokens"), f"device {RANK}"), (per_s("marconi_host_hit_tokens"), f"host {RANK}"),
      (f"{delta_of('marconi_host_hit_tokens')} / ({delta_of('marconi_device_hit_tokens')} + "
       f"{delta_of('marconi_host_hit_tokens')})", f"host share, last 5 min {RANK}")]),
    ("Host tier: demoted, dropped, loaded back", "short",
     "Per second: SSM states and KV tokens demoted to host memory as they leave the device, states and leaves "
     "dropped, host evictions, and what hits load back.",
     [(per_s("marconi_host_states_demoted"), f"states demoted {RANK}"),
      (per_s("marconi_host_states_dropped"), f"states dropped {RANK}"),
      (per_s("marconi_host_kv_tokens_demoted"), f"KV tokens demoted {RANK}"),
      (per_s("marconi_host_drops"), f"leaves dropped {RANK}"),
      (per_s("marconi_host_evictions"), f"host evictions {RANK}"),
      (per_s("marconi_host_states_evicted"), f"host states evicted {RANK}"),
      (per_s("marconi_host_states_loaded_back"), f"states loaded back {RANK}"),
      (per_s("marconi_host_kv_tokens_loaded_back"), f"KV tokens loaded back {RANK}")]),
    ("Prefill FLOPs saved per second", "flops",
     "Prefill FLOPs skipped by hits (the model profile's estimate).",
     [(per_s("marconi_prefill_flops_saved"), RANK)]),
    ("Requests per second", "reqps", "Requests released through the Marconi cache.",
     [(per_s("marconi_requests"), RANK)]),
    ("Eviction choice in force", "short",
     "1 for the choice in force (lru, an alpha, seglen:W), 0 for the other candidates; the same on every rank.",
     [(f"sglang:marconi_choice{SEL} == 1", "{{choice}} " + RANK)]),
    ("Shadow scores by candidate", "short",
     "Each candidate's decayed shadow score (prefill FLOPs saved, or hit tokens): the tuner adopts a leader.",
     [(f"sglang:marconi_shadow_score{SEL}", "{{choice}} " + RANK)]),
    ("Alpha and rule weight", "short",
     "alpha: FLOP-efficiency weight (empty while LRU or SegLen is in force); rule weight: the value column's.",
     [(g("marconi_alpha"), f"alpha {RANK}"), (g("marconi_rule_weight"), f"rule weight {RANK}"),
      (delta_of("marconi_choice_switches", "[1h]"), f"switches / h {RANK}")]),
    ("Evictions per second, by kind", "short",
     "Leaves (KV and state), single-child states, probationary states, upstream's fallback walk; for "
     "sliding-window models, branch windows and stale SWA KV.",
     [(per_s(f"marconi_evictions_{kind}"), f"{kind} {RANK}")
      for kind in ("leaf", "single_child", "probationary", "fallback", "window", "stale")]),
    ("SSM states", "short", "States held by the tree, those on probation, and admissions per second.",
     [(g("marconi_ssm_states_cached"), f"cached {RANK}"),
      (g("marconi_probationary_states_cached"), f"on probation {RANK}"),
      (per_s("marconi_ssm_states_admitted"), f"admitted / s {RANK}"),
      (per_s("marconi_admissions_skipped_no_slot"), f"skipped, no slot / s {RANK}")]),
    ("Two-pass prefill", "short",
     "Chunks ended at a branch so its state is admitted, branches inside a chunk not split at, deferred "
     "admissions; tokens lost to the extra_buffer snapshot grid.",
     [(per_s("marconi_two_pass_splits"), f"splits / s {RANK}"), (per_s("marconi_two_pass_skipped"), f"skipped / s {RANK}"),
      (per_s("marconi_two_pass_deferred"), f"deferred / s {RANK}"),
      (per_s("marconi_branch_tokens_lost_to_grid"), f"tokens lost to grid / s {RANK}")]),
    ("Tuner health: requests", "short",
     "Sampled requests sent to the shadow tuner, dropped at a full channel, and accounted for (its heartbeat).",
     [(per_s("marconi_tuner_requests_fed"), f"fed {RANK}"), (per_s("marconi_tuner_requests_dropped"), f"dropped {RANK}"),
      (per_s("marconi_tuner_requests_observed"), f"observed {RANK}")]),
    ("Tuner health: sync points and faults", "short",
     "Tuning stopped (1), late verdicts at sync points, seconds waited per second, leader directives, "
     "index faults recovered, rank-local features stopped.",
     [(g("marconi_tuning_failures"), f"tuning stopped {RANK}"),
      (delta_of("marconi_sync_waits_late"), f"late sync points / 5 min {RANK}"),
      (per_s("marconi_sync_wait_seconds"), f"wait s / s {RANK}"),
      (delta_of("marconi_directives_applied"), f"directives / 5 min {RANK}"),
      (g("marconi_faults_recovered"), f"faults recovered {RANK}"),
      (g("marconi_rank_local_failures"), f"rank-local failures {RANK}")]),
    ("Speculative decoding", "short",
     "Draft tokens per verify (0: off), and finished requests SGLang left out of the tree because their last "
     "verify ran past the stop.",
     [(g("marconi_speculative_num_draft_tokens"), f"draft tokens {RANK}"),
      (delta_of("marconi_speculative_final_states_skipped"), f"left out / 5 min {RANK}")]),
]


def panel(panel_id: int, title: str, unit: str, description: str, targets) -> dict:
    x, y = (panel_id - 1) % 2 * 12, (panel_id - 1) // 2 * 8
    return {
        "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
        "description": description,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1,
                                                              "spanNulls": False}}, "overrides": []},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "id": panel_id,
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, "editorMode": "code",
                     "expr": expr, "legendFormat": legend, "range": True, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(targets)],
        "title": title,
        "type": "timeseries",
    }


def build() -> dict:
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "annotations": {"list": []},
        "description": "Marconi prefix cache for hybrid models (sglang-marconi): hits, FLOPs saved, "
                       "eviction choice and shadow scores, evictions by kind, tuner health.",
        "editable": True,
        "graphTooltip": 1,
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS, start=1)],
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["sglang", "marconi"],
        "templating": {"list": [{
            "name": "model_name", "label": "model", "type": "query",
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "query": "label_values(sglang:marconi_requests, model_name)",
            "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}, "refresh": 2,
        }]},
        "time": {"from": "now-1h", "to": "now"},
        "title": "SGLang Marconi prefix cache",
        "uid": "sglang-marconi",
        "version": 1,
    }


def metric_names(dashboard: dict) -> set[str]:
    """Every `sglang:...` metric a panel's query reads."""
    names = set()
    for p in dashboard["panels"]:
        for target in p["targets"]:
            names.update(re.findall(r"sglang:([A-Za-z_][A-Za-z0-9_]*)", target["expr"]))
    names.update(re.findall(r"sglang:([A-Za-z_][A-Za-z0-9_]*)", dashboard["templating"]["list"][0]["query"]))
    return names


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the dashboard JSON")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render())
    print(f"wrote {args.out} ({len(build()['panels'])} panels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

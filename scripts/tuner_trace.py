"""The tuner's evidence over one replay: what each choice's shadow led by, when the tuner adopted what,
and why it did not adopt the best fixed choice in hindsight sooner (or at all).

    python scripts/tuner_trace.py --workload synthetic:sharegpt --capacity 5GB [--model paper-7b] \\
        [--out out/tuner_trace] [--no-plot]

Replays every candidate fixed over the whole trace (`marconi-best`, as `bench_policies` does), then the
tuned replay with the tuner's decisions recorded: at each decision (every `epoch` sampled requests),
each choice's lead over the safe one (LRU) in points of what the sampled requests could save at most,
over the long and the short window, and the test the tuner applies to the hindsight best against the
choice in force: its long-window lead in points against the adoption bar (margin x (1 + strikes)), its
lead in session-clustered standard errors against `z`, and whether it leads in both halves of the
sessions. Prints the decisions and the evidence at ten points of the trace; writes the whole trace as
JSON and, unless --no-plot, a PNG (`tuner_trace_<cell>.png`). At a sample rate below 1 the verifier,
not this step, adopts what the shadows propose: its adoptions are in the decisions, not in the
records' `switched_to`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tuning.evidence import LONG, SHORT
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, choice_label
from sglang_marconi.sim import robustness
from sglang_marconi.sim.hindsight import replay_best
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import load_workload
from sglang_marconi.sim.tuning import shadow_config_for
from sglang_marconi.sim.units import parse_bytes


def lead_test(tuner, a: int, b: int) -> dict:
    """The long-window test `ShadowTuner._decide` applies to adopting arm `a` over arm `b`."""
    ev, c = tuner.evidence, tuner.config
    potential = ev.potential.item(LONG)
    gap = ev.scores.item(LONG, a) - ev.scores.item(LONG, b)
    m = ev.moments.item
    se = math.sqrt(max(m(LONG, a, a) + m(LONG, b, b) - 2 * m(LONG, a, b), 0.0))
    h = ev.halves.item
    return {"lead_pts": 100 * gap / potential if potential else 0.0,
            "bar_pts": 100 * c.margin * (1.0 + float(tuner.strikes[a])),
            "z": gap / se if se else (math.inf if gap > 0 else 0.0),
            "both_halves": bool(h(LONG, 0, a) > h(LONG, 0, b) and h(LONG, 1, a) > h(LONG, 1, b)),
            "held": float(tuner._held[a])}


def record_decisions(tuner, best: int, trace: list) -> None:
    """Wrap the tuner's decision step (on this instance only) to append its evidence to `trace`."""
    decide = tuner._decide

    def recorded():
        ev = tuner.evidence
        cur = tuner.choices.index(tuner.current)
        leads = {}
        for w, name in ((LONG, "long"), (SHORT, "short")):
            potential = ev.potential.item(w)
            scores = ev.scores[w].tolist()
            leads[name] = [100 * (s - scores[0]) / potential if potential else 0.0 for s in scores]
        choice = decide()
        # a pruned shadow saves nothing until revived: its lead decays, which says nothing of its choice
        pruned = [i for i, shadow in enumerate(tuner.shadows) if shadow is None]
        trace.append({"pruned": pruned, "request": tuner.log.requests, "sampled": tuner.log.sampled,
                      "current": choice_label(tuner.choices[cur]),
                      "lead_over_lru": leads, "best_over_current": lead_test(tuner, best, cur) if best != cur else None,
                      "switched_to": None if choice is None else choice_label(choice)})
        return choice

    tuner._decide = recorded


def where_the_gap_accrues(tuned_hits, best_hits) -> dict:
    """The hindsight best's cumulative lead over the tuned replay, request by request (hit tokens):
    its final value, the last request at which the best was not ahead, and how much of the final
    lead it gained in the last tenth of the trace. A lead gained only at the end was not there to
    be seen while the tuner decided."""
    lead = np.cumsum(np.asarray(best_hits, dtype=np.int64) - np.asarray(tuned_hits, dtype=np.int64))
    n = len(lead)
    not_ahead = np.flatnonzero(lead <= 0)
    tail = n - max(1, n // 10)
    return {"final_lead_tokens": int(lead[-1]) if n else 0,
            "last_request_not_ahead": int(not_ahead[-1]) + 1 if len(not_ahead) else 0,
            "lead_before_last_tenth_tokens": int(lead[tail - 1]) if tail > 0 else 0,
            "cumulative_lead": lead[:: max(1, n // 200)].tolist()}


def workload_named(name: str):
    """A workload the simulator reads, or one of the robustness suite's adversarial traces
    (`adversarial:KIND:seed=N`, `sim/robustness.py`)."""
    family, _, rest = name.partition(":")
    if family != "adversarial":
        return load_workload(name)
    kind, _, seed = rest.partition(":seed=")
    if kind not in robustness.ADVERSARIAL or not seed.isdigit():
        raise MarconiError(f"adversarial trace {name!r}: expected adversarial:KIND:seed=N, KIND one of "
                           f"{', '.join(robustness.ADVERSARIAL)}")
    return robustness.ADVERSARIAL[kind](int(seed))


def run(workload_name: str, model: str, capacity: int, out: Path | None, plot: bool, profile=None) -> dict:
    """`profile`: a profile object in place of the named `model` (e.g. a layer-ratio variant)."""
    workload = workload_named(workload_name)
    profile = load_profile(model) if profile is None else profile
    config = shadow_config_for(workload, profile, capacity, ShadowConfig(), None)
    best = replay_best(workload, profile, capacity, config, progress=True)
    labels = [choice_label(c) for c in config.choices]
    best_index = labels.index(best.best_choice)
    policy = build_policy("marconi", profile, capacity, tuning=config)
    trace: list = []
    record_decisions(policy.tuner, best_index, trace)
    tuned = replay(workload, policy, profile, capacity, progress=True)
    result = {"workload": workload_name, "model": model, "capacity_bytes": capacity, "sample_rate": config.sample_rate,
              "choices": labels, "tuned_hit_rate": tuned.token_hit_rate, "best_choice": best.best_choice,
              "best_hit_rate": best.token_hit_rate, "lru_hit_rate": best.candidates[labels[0]]["token_hit_rate"],
              "candidates": best.candidates, "decisions": [(n, choice_label(c)) for n, c in policy.tuner.log.decisions],
              "gap": where_the_gap_accrues(tuned.per_request["hit_tokens"], best.per_request["hit_tokens"]),
              "requests": tuned.requests, "margin_pts": 100 * config.margin, "z": config.z, "persist": config.persist,
              "trace": trace}
    print(summary(result))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"tuner_trace_{cell_name(workload_name, capacity)}"
        (out / f"{stem}.json").write_text(json.dumps(result))
        if plot:
            plot_trace(result, out / f"{stem}.png")
            print(f"wrote {out / stem}.json and .png")
    return result


def cell_name(workload_name: str, capacity: int) -> str:
    return f"{workload_name.replace(':', '-').replace(',', '_').replace('=', '')}@{capacity / 1e9:g}GB"


def summary(r: dict) -> str:
    lines = [f"{r['workload']} @ {r['capacity_bytes'] / 1e9:g} GB, {r['model']}, sample rate {r['sample_rate']:.3g}",
             f"tuned {100 * r['tuned_hit_rate']:.2f}%  best fixed {100 * r['best_hit_rate']:.2f}% ({r['best_choice']})"
             f"  LRU {100 * r['lru_hit_rate']:.2f}%"
             f"  tuned - best {100 * (r['tuned_hit_rate'] - r['best_hit_rate']):+.2f} pts",
             "decisions: " + " > ".join(f"{c}@{n}" for n, c in r["decisions"]),
             f"the hindsight best ({r['best_choice']}) against the choice in force, long window "
             f"(adopted when lead > bar and z > {r['z']:g} in both halves, or held >= {r['persist']:g}):",
             "| request | in force | best's lead over LRU, long / short (pts) | best over in force: lead / bar (pts) "
             "| z | both halves | held |", "|---|---|---|---|---|---|---|"]
    gap = r["gap"]
    lines.insert(3, f"the best fixed choice's lead over tuned, in hit tokens: {gap['final_lead_tokens']:,} at the end, "
                    f"{gap['lead_before_last_tenth_tokens']:,} before the last tenth of the trace;"
                    f" ahead of tuned for good only after request {gap['last_request_not_ahead']:,} of {r['requests']:,}")
    best = r["choices"].index(r["best_choice"])
    trace = r["trace"]
    for i in sorted({min(len(trace) - 1, round(k * (len(trace) - 1) / 9)) for k in range(10)} if trace else ()):
        t = trace[i]
        cmp = t["best_over_current"]
        test = ("in force", "", "", "") if cmp is None else (
            f"{cmp['lead_pts']:+.2f} / {cmp['bar_pts']:.2f}", f"{cmp['z']:.2f}", "yes" if cmp["both_halves"] else "no",
            f"{cmp['held']:.0f}")
        lines.append(f"| {t['request']} | {t['current']} | {t['lead_over_lru']['long'][best]:+.2f} / "
                     f"{t['lead_over_lru']['short'][best]:+.2f} | " + " | ".join(test) + " |")
    return "\n".join(lines)


def plot_trace(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = r["trace"]
    if not trace:
        return
    x = [t["request"] for t in trace]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for i, label in enumerate(r["choices"]):
        style = dict(lw=2.2, color="black") if label == r["best_choice"] else dict(lw=0.9, alpha=0.7)
        top.plot(x, [math.nan if i in t["pruned"] else t["lead_over_lru"]["long"][i] for t in trace], label=label,
                 **style)
    for n, choice in r["decisions"][1:]:
        top.axvline(n, color="tab:red", ls=":", lw=1)
        top.annotate(choice, (n, top.get_ylim()[1]), rotation=90, va="top", fontsize=7, color="tab:red")
    top.set_ylabel("long-window lead over LRU (pts)\n(a line ends where its shadow is pruned)")
    top.legend(fontsize=7, ncol=4)
    top.set_title(f"{r['workload']} @ {r['capacity_bytes'] / 1e9:.3g} GB, {r['model']}: "
                  f"tuned {100 * r['tuned_hit_rate']:.2f}%, "
                  f"best fixed {r['best_choice']} {100 * r['best_hit_rate']:.2f}%")
    best = r["choices"].index(r["best_choice"])
    tested = [t["best_over_current"] if t["best_over_current"] and best not in t["pruned"] else None for t in trace]
    for key, label, style in (("lead_pts", f"{r['best_choice']}'s lead over the choice in force (pts)", "-"),
                              ("bar_pts", "adoption bar (pts)", "--"),
                              ("z", "its lead in clustered std errors (capped at +-10)", "-")):
        middle.plot(x, [max(-10, min(10, t[key])) if t else math.nan for t in tested], ls=style, label=label)
    middle.axhline(r["z"], color="gray", lw=0.8)
    middle.legend(fontsize=7)
    lead = r["gap"]["cumulative_lead"]
    step = max(1, r["requests"] // 200)
    bottom.plot([1 + i * step for i in range(len(lead))], lead)
    bottom.axhline(0, color="gray", lw=0.8)
    bottom.set_ylabel(f"hit tokens {r['best_choice']} fixed\ngained over tuned (hindsight)")
    bottom.set_xlabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True,
                   help="a workload the simulator reads (e.g. synthetic:sharegpt), or adversarial:KIND:seed=N")
    p.add_argument("--capacity", required=True, type=parse_bytes, help="cache bytes, e.g. 5GB")
    p.add_argument("--model", default="paper-7b")
    p.add_argument("--out", type=Path, default=Path("out/tuner_trace"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        run(args.workload, args.model, args.capacity, args.out, not args.no_plot)
    except MarconiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

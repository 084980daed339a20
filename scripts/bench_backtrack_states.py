"""Backtrack states (`policy/rules/backtrack_states.py`) on agent traffic, per cell: upstream,
Marconi's fixed choices and tuned Marconi, each without and with the rule.

    python scripts/bench_backtrack_states.py [--traces agent,agent-backtrack,stress] [--per-request B]
        [--strategies no_buffer,extra_buffer] [--json OUT]

Upstream is SGLang 0.5.23's own cache on CPU (`bench_sglang_cache.py`'s `lru-py`: its admission, a
state at every chunk end, LRU). Marconi is the served-pools model (`policy/tree/served_cache.py`,
through `sim.policies.build_policy(served=...)`), which `check_sim_vs_served.py` proves equal to the
served cache request by request: `lru` (Marconi's admission, SGLang's LRU), alpha 0 and 1, and tuned
(the served runtime's protocol); `--choices` takes any fixed choice the served cache runs (an alpha,
`seglen:W`, `depth:B`, `depth:auto`, `coverage`). Pools: `bench_sglang_cache.pool_sizes` at fractions 0.25 (tight),
0.6 (mid) and 1.0 (ample) of the trace's footprint; prefill chunks of 512 tokens.

`--target PTS` (with upstream) adds, per cell where upstream is below 90%, whether tuned Marconi at
the default rule setting (the rule on in extra_buffer, off in no_buffer) is at least upstream + PTS,
and if not, what stands in the way: the trace's infinite-cache bound below upstream + PTS, or no
fixed choice of those run (with or without the rule) reaching it, or none of the tuner's own choices,
or only the tuner; and where tuned's misses lie against that bound: KV no longer held (evicted), or
KV held but no state to resume from at the right place (states, or the snapshot grid).

Traces: `agent` = synthetic swe-agent, 2 trajectories at scale 0.1 (the `--quick` agent of
`bench_sglang_cache.py`); `agent20` the same with 20; `agent-backtrack` = `sim/stress.agent_backtrack`
(8 interleaved trajectories that return to earlier message boundaries); `stress` =
`sim/stress.chain_fanout(600)`, pools at scale 0.125; `reasoning` = `sim/stress.reasoning_chat` (12
conversations x 10 turns whose template drops each answer's reasoning from the history), scale 0.1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

FRACTIONS = {"tight": 0.25, "mid": 0.6, "ample": 1.0}
CHUNK = 512


def traces():
    from sglang_marconi.sim.stress import agent_backtrack, chain_fanout, reasoning_chat
    from sglang_marconi.sim.synthetic import generate

    return {
        "agent": (0.1, lambda: list(generate("swe-agent", sessions=2, scale=0.1))),
        "agent20": (0.1, lambda: list(generate("swe-agent", sessions=20, scale=0.1))),
        "agent-backtrack": (0.1, lambda: list(agent_backtrack())),
        "stress": (0.125, lambda: list(chain_fanout(600))),
        "reasoning": (0.1, lambda: list(reasoning_chat())),
    }


def parse_choices(text: str) -> list:
    """`lru`, `auto` (tuned), an alpha, `seglen:W`, `depth:B` or `depth:auto`, comma-separated."""
    from sglang_marconi.policy.errors import MarconiError
    from sglang_marconi.policy.rules.eviction.depth import check_exponent
    from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha

    choices = []
    for item in filter(None, (c.strip() for c in text.split(","))):
        kind, sep, value = item.partition(":")
        try:
            if item in ("lru", "auto", "depth:auto", "coverage"):
                choices.append(item)
            elif sep and kind == "seglen":
                check_alpha(float(value))
                choices.append(item)
            elif sep and kind == "depth":
                check_exponent(float(value))
                choices.append(item)
            elif not sep:
                choices.append(check_alpha(float(item)))
            else:
                raise ValueError
        except (ValueError, MarconiError):
            raise SystemExit(f"--choices: {item!r} is not lru, auto, an alpha >= 0, seglen:W, depth:B, depth:auto "
                             "or coverage")
    return choices


def label(choice) -> str:
    return f"{choice:g}" if isinstance(choice, float) else choice


def marconi(requests, profile, pools, choice, reachable: list[int] | None = None):
    """Token hit % of a Marconi cell; with `reachable` (per request, what a cache that never evicts
    hits), also the % whose KV the cell still held up to that point (`overlap_tokens`): what a state
    at the right place would have hit."""
    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.sim.baselines.served import ServedPolicy

    if choice == "auto":
        policy = ServedPolicy("marconi", profile, pools, tuning=MarconiServingConfig(tune_workers=0).tuning())
    else:
        policy = ServedPolicy(label(choice), profile, pools, choice)
    hit = total = held = 0
    for i, r in enumerate(requests):
        outcome = policy.serve(r)
        hit += outcome.hit_tokens
        total += r.input_len
        if reachable is not None:
            held += min(outcome.overlap_tokens, reachable[i])
    if reachable is None:
        return 100.0 * hit / total
    return 100.0 * hit / total, 100.0 * held / total


def upstream(requests, info, kv, mamba, extra_buffer) -> float:
    import bench_sglang_cache as bench

    cell = bench.run_cell("lru-py", kv, mamba, info, CHUNK, bench._profile(), None, extra_buffer)
    return 100.0 * cell.hit_tokens / cell.input_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="agent,agent-backtrack,stress,reasoning")
    ap.add_argument("--strategies", default="extra_buffer,no_buffer")
    ap.add_argument("--pools", default="tight,mid,ample")
    ap.add_argument("--per-request", type=int, default=3,
                    help="backtrack states per request in the +bt columns (3: the rule's default in extra_buffer)")
    ap.add_argument("--no-upstream", action="store_true", help="skip SGLang's own cache (Marconi's cells only)")
    ap.add_argument("--choices", default="lru,0,1,auto",
                    help="Marconi's choices: lru, alphas, seglen:W, depth:B, depth:auto, coverage, auto (tuned)")
    ap.add_argument("--target", type=float, default=None, metavar="PTS",
                    help="per cell with upstream < 90%%: is tuned (the default rule setting) >= upstream + PTS, "
                         "and if not, why (needs upstream)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    choices = parse_choices(args.choices)
    if args.target is not None and args.no_upstream:
        ap.error("--target compares with upstream: drop --no-upstream")
    warnings.filterwarnings("ignore")
    import bench_sglang_cache as bench
    import torch

    from sglang_marconi.policy.tree.served_cache import ServedPools

    torch.set_num_threads(1)
    profile = bench._profile()
    rows = []
    started = time.perf_counter()
    all_traces = traces()
    for name in args.traces.split(","):
        scale, make = all_traces[name]
        requests = make()
        info = bench.describe(requests)
        reachable = infinite_hits(requests)
        bound = 100.0 * sum(reachable) / sum(r.input_len for r in requests)
        for strategy in args.strategies.split(","):
            for pools_label in args.pools.split(","):
                (kv, mamba), = bench.pool_sizes(info, (FRACTIONS[pools_label],), scale, profile)
                base = ServedPools(kv, mamba, strategy, CHUNK)
                up = None if args.no_upstream else upstream(requests, info, kv, mamba, strategy == "extra_buffer")
                row = {"trace": name, "strategy": strategy, "pools": pools_label, "kv": kv, "mamba": mamba,
                       "upstream": up, "bound": bound}
                for b in (0, args.per_request):
                    pools = replace(base, backtrack_states=b)
                    for choice in choices:
                        row[f"{label(choice)}{'+bt' if b else ''}"] = marconi(requests, profile, pools, choice)
                if args.target is not None:
                    row["tuned (default)"], row["tuned: KV held"] = marconi(requests, profile, base, "auto",
                                                                            reachable)
                rows.append(row)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    print(f"wall {time.perf_counter() - started:.0f} s")
    print("| trace | strategy | pools (KV / Mamba) | upstream | " + " | ".join(
        f"{label(c)} | {label(c)}+bt" for c in choices) + " |")
    print("|---" * (4 + 2 * len(choices)) + "|")
    for r in rows:
        up = "-" if r["upstream"] is None else f"{r['upstream']:.2f}"
        cells = " | ".join(f"{r[label(c)]:.2f} | {r[f'{label(c)}+bt']:.2f}" for c in choices)
        print(f"| {r['trace']} | {r['strategy']} | {r['pools']} {r['kv']:,} / {r['mamba']} | {up} | {cells} |")
    if args.target is not None:
        print_target(rows, choices, args.target, args.per_request)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def infinite_hits(requests) -> list[int]:
    """Per request, the tokens a cache that never evicts hits (every prefix seen before)."""
    from sglang_marconi.sim.baselines.infinite import InfiniteCache

    cache = InfiniteCache()
    return [cache.serve(r).hit_tokens for r in requests]


def tuner_columns(strategy: str, choices: list, per_request: int) -> list[str]:
    """The columns of the choices the served tuner can adopt, at the rule setting it runs with
    (`backtrack_states.default_setting`); empty if that setting was not run."""
    from sglang_marconi.policy.rules.backtrack_states import default_setting
    from sglang_marconi.policy.tuning.shadow_tuner import choice_label, served_config
    from sglang_marconi.serving.config import MarconiServingConfig

    setting = default_setting(strategy == "extra_buffer")
    if setting not in (0, per_request):
        return []
    tunable = {choice_label(c) for c in served_config(MarconiServingConfig(tune_workers=0).tuning()).choices}
    return [f"{label(c)}{'+bt' if setting else ''}" for c in choices if c != "auto" and label(c) in tunable]


def target_verdict(row: dict, fixed: list[str], tunable: list[str], target: float) -> str:
    """Why tuned Marconi is or is not >= upstream + target in one cell: met; above the trace's
    infinite-cache bound; no fixed choice run reaches it; none of the tuner's own choices does (at
    its rule setting), though another one run does; or one of the tuner's does and tuned does not."""
    need = row["upstream"] + target
    if row["tuned (default)"] >= need:
        return "met"
    if need > row["bound"]:
        return "above the bound"
    best = max(fixed, key=row.get, default=None)
    if best is None or row[best] < need:
        return "no fixed choice run reaches it"
    best_tunable = max(tunable, key=row.get, default=None)
    if best_tunable is None or row[best_tunable] < need:
        return f"none of the tuner's choices reaches it; {best} does"
    return f"the tuner's {best_tunable} reaches it; tuned does not"


def print_target(rows: list[dict], choices: list, target: float, per_request: int) -> None:
    fixed = [f"{label(c)}{suffix}" for c in choices if c != "auto" for suffix in ("", "+bt")]
    print(f"\n| trace | strategy | pools | upstream | upstream + {target:g} | bound | tuned (default) | "
          "tuned's loss to KV / to states | best fixed (choice) | best of the tuner's choices | verdict |")
    print("|---" * 11 + "|")
    met = cells = 0
    for r in rows:
        if r["upstream"] >= 90.0:
            continue
        tunable = tuner_columns(r["strategy"], choices, per_request)
        verdict = target_verdict(r, fixed, tunable, target)
        cells += 1
        met += verdict == "met"
        best = max(fixed, key=r.get, default=None)
        best_tunable = max(tunable, key=r.get, default=None)
        best_text = "-" if best is None else f"{r[best]:.2f} ({best})"
        tunable_text = "-" if best_tunable is None else f"{r[best_tunable]:.2f} ({best_tunable})"
        print(f"| {r['trace']} | {r['strategy']} | {r['pools']} | {r['upstream']:.2f} | {r['upstream'] + target:.2f} | "
              f"{r['bound']:.2f} | {r['tuned (default)']:.2f} | {r['bound'] - r['tuned: KV held']:.2f} / "
              f"{r['tuned: KV held'] - r['tuned (default)']:.2f} | {best_text} | {tunable_text} | {verdict} |")
    print(f"\ntuned >= upstream + {target:g} where upstream < 90%: {met} of {cells} cells")


if __name__ == "__main__":
    sys.exit(main())

"""Backtrack states (`policy/rules/backtrack_states.py`) on agent traffic, per cell: upstream,
Marconi's fixed choices and tuned Marconi, each without and with the rule.

    python scripts/bench_backtrack_states.py [--traces agent,agent-backtrack,stress] [--per-request B]
        [--strategies no_buffer,extra_buffer] [--json OUT]

Upstream is SGLang 0.5.23's own cache on CPU (`bench_sglang_cache.py`'s `lru-py`: its admission, a
state at every chunk end, LRU). Marconi is the served-pools model (`policy/tree/served_cache.py`,
through `sim.policies.build_policy(served=...)`), which `check_sim_vs_served.py` proves equal to the
served cache request by request: `lru` (Marconi's admission, SGLang's LRU), alpha 0 and 1, and tuned
(the served runtime's protocol). Pools: `bench_sglang_cache.pool_sizes` at fractions 0.25 (tight),
0.6 (mid) and 1.0 (ample) of the trace's footprint; prefill chunks of 512 tokens.

Traces: `agent` = synthetic swe-agent, 2 trajectories at scale 0.1 (the `--quick` agent of
`bench_sglang_cache.py`); `agent20` the same with 20; `agent-backtrack` = `sim/stress.agent_backtrack`
(8 interleaved trajectories that return to earlier message boundaries); `stress` =
`sim/stress.chain_fanout(600)`, pools at scale 0.125.
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
    from sglang_marconi.sim.stress import agent_backtrack, chain_fanout
    from sglang_marconi.sim.synthetic import generate

    return {
        "agent": (0.1, lambda: list(generate("swe-agent", sessions=2, scale=0.1))),
        "agent20": (0.1, lambda: list(generate("swe-agent", sessions=20, scale=0.1))),
        "agent-backtrack": (0.1, lambda: list(agent_backtrack())),
        "stress": (0.125, lambda: list(chain_fanout(600))),
    }


def marconi(requests, profile, pools, choice) -> float:
    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.sim.policies import build_policy

    tuned = choice == "auto"
    name = "marconi" if tuned else ("sglang+" if choice == "lru" else f"marconi:{choice:g}")
    policy = build_policy(name, profile, 0, served=pools, probation=True,
                          tuning=MarconiServingConfig(tune_workers=0).tuning() if tuned else None)
    hit = total = 0
    for r in requests:
        hit += policy.serve(r).hit_tokens
        total += r.input_len
    return 100.0 * hit / total


def upstream(requests, info, kv, mamba, extra_buffer) -> float:
    import bench_sglang_cache as bench

    cell = bench.run_cell("lru-py", kv, mamba, info, CHUNK, bench._profile(), None, extra_buffer)
    return 100.0 * cell.hit_tokens / cell.input_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="agent,agent-backtrack,stress")
    ap.add_argument("--strategies", default="extra_buffer,no_buffer")
    ap.add_argument("--pools", default="tight,mid,ample")
    ap.add_argument("--per-request", type=int, default=2)
    ap.add_argument("--no-upstream", action="store_true", help="skip SGLang's own cache (Marconi's cells only)")
    ap.add_argument("--choices", default="lru,0,1,auto", help="Marconi's choices: lru, alphas, auto (tuned)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import bench_sglang_cache as bench
    import torch

    from sglang_marconi.policy.tree.served_cache import ServedPools

    torch.set_num_threads(1)
    profile = bench._profile()
    choices = [c if c in ("lru", "auto") else float(c) for c in args.choices.split(",")]
    rows = []
    started = time.perf_counter()
    all_traces = traces()
    for name in args.traces.split(","):
        scale, make = all_traces[name]
        requests = make()
        info = bench.describe(requests)
        for strategy in args.strategies.split(","):
            for label in args.pools.split(","):
                (kv, mamba), = bench.pool_sizes(info, (FRACTIONS[label],), scale, profile)
                base = ServedPools(kv, mamba, strategy, CHUNK)
                up = None if args.no_upstream else upstream(requests, info, kv, mamba, strategy == "extra_buffer")
                row = {"trace": name, "strategy": strategy, "pools": label, "kv": kv, "mamba": mamba, "upstream": up}
                for b in (0, args.per_request):
                    pools = replace(base, backtrack_states=b)
                    for choice in choices:
                        row[f"{choice}{'+bt' if b else ''}"] = marconi(requests, profile, pools, choice)
                rows.append(row)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    print(f"wall {time.perf_counter() - started:.0f} s")
    print("| trace | strategy | pools (KV / Mamba) | upstream | " + " | ".join(
        f"{c} | {c}+bt" for c in choices) + " |")
    for r in rows:
        up = "-" if r["upstream"] is None else f"{r['upstream']:.2f}"
        cells = " | ".join(f"{r[str(c)]:.2f} | {r[f'{c}+bt']:.2f}" for c in choices)
        print(f"| {r['trace']} | {r['strategy']} | {r['pools']} {r['kv']:,} / {r['mamba']} | {up} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

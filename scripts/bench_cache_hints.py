"""Hit rate with client cache hints against without, on the synthetic kinds with their sessions as
keys (`sim/hinted.py`), at a tight and an ample capacity, under SGLang+ (LRU) and tuned Marconi.

Columns: no hints; every request keyed by its session (retention in-memory, then 24h); every
request but each session's last keyed (a client that knows its conversation ends). Prints a
markdown table (token hit %, and the change against no hints).

    python scripts/bench_cache_hints.py [--model paper-7b] [--share 0.5]
"""

from __future__ import annotations

import argparse
import sys
import time

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.hinted import HintedPolicy, with_session_keys
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.synthetic import generate

# (kind, tight GB, ample GB): tight where SGLang+ keeps under a tenth of what it could reuse, ample
# where it keeps most of it (docs/benchmarks.md, "Policy quality").
CELLS = (("lmsys", 5, 20), ("sharegpt", 2, 10), ("swe-agent", 5, 20), ("system-prompt", 0.5, 2))
POLICIES = ("sglang+", "marconi")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="paper-7b")
    ap.add_argument("--share", type=float, default=0.5, help="the hinted share of the cache")
    args = ap.parse_args(argv)
    profile = load_profile(args.model)
    print(f"| workload | capacity | policy | no hints | keys (in-memory) | keys (24h) | keys, last turn unkeyed |")
    print("|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for kind, *capacities in CELLS:
        workload = generate(kind)
        variants = (with_session_keys(workload), with_session_keys(workload, "24h"),
                    with_session_keys(workload, last_turn=False))
        for gb in capacities:
            capacity = int(gb * 1e9)
            for name in POLICIES:
                base = replay(workload, build_policy(name, profile, capacity), profile, capacity, progress=False)
                cells = [f"{100 * base.token_hit_rate:.2f}"]
                for keyed in variants:
                    policy = HintedPolicy(build_policy(name, profile, capacity), share=args.share)
                    run = replay(keyed, policy, profile, capacity, progress=False)
                    delta = 100 * (run.token_hit_rate - base.token_hit_rate)
                    cells.append(f"{100 * run.token_hit_rate:.2f} ({delta:+.2f})")
                print(f"| synthetic:{kind} | {gb:g} GB | {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n({args.model}, hinted share {args.share:g}; {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

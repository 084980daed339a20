"""Does a sampled shadow predict the full cache's gain? Per cell: each choice's gain over LRU in
points of token hit rate, as the tuner's sampled shadows see it (at the sample rate the simulator's
tuned configuration picks, or --rate) and over the whole trace with the choice fixed.

    python scripts/check_shadow_prediction.py --trace ../shared/data/mooncake/conversation_trace.jsonl \
        --model paper-7b --capacity 100GB,400GB
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, parse_alpha_grid
from sglang_marconi.sim.traces import load_workload
from sglang_marconi.sim.tuning import full_gains, shadow_config_for, shadow_predictions
from sglang_marconi.sim.units import parse_capacities


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--model", default="paper-7b")
    p.add_argument("--capacity", required=True, help="comma list, GB = 10^9 bytes")
    p.add_argument("--rate", type=float, default=None, help="sample rate (default: the simulator's automatic one)")
    p.add_argument("--alphas", default="0", help="alphas beside LRU and the depth choices (comma list)")
    p.add_argument("--no-full", action="store_true", help="the shadows' predictions only (no full-trace replays)")
    args = p.parse_args(argv)
    workload = load_workload(args.trace, "conversation")
    profile = load_profile(args.model)
    print("| model | capacity | rate | choice | shadows' gain (pts) | full cache's gain (pts) |\n|---|---|---|---|---|---|")
    for cap in parse_capacities(args.capacity):
        tuned = shadow_config_for(workload, profile, cap, ShadowConfig(), args.rate)  # the rate the tuner would use
        config = replace(tuned, alpha_grid=parse_alpha_grid(args.alphas), seglen_weights=())
        started = time.perf_counter()
        predicted = shadow_predictions(workload, profile, cap, config)
        full = {} if args.no_full else full_gains(workload, profile, cap, config.choices)
        for label in predicted:
            if label != "lru":
                whole = f"{full[label]:+.2f}" if full else "-"
                print(f"| {args.model} | {cap / 1e9:g} GB | {config.sample_rate:.3g} | {label} | {predicted[label]:+.2f} "
                      f"| {whole} |", flush=True)
        print(f"<!-- {time.perf_counter() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()

"""`python -m sglang_marconi.sim`: replay a trace for several policies and capacities.

Stable contract (scripts depend on it):
  python -m sglang_marconi.sim --trace PATH --model PROFILE --capacity 2GB,5GB
      --policies none,vllm+,sglang+,marconi --json OUT.json [--plot OUT.png] [--alpha A] [--block-size 32]
OUT.json holds a list of runs, each with policy, capacity_bytes, token_hit_rate, request_hit_rate,
flops_saved, wall_seconds and alpha_history (plus more fields).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_marconi.policy.alpha_tuner import TuningConfig, parse_alpha_grid
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.model_profile import load_profile
from sglang_marconi.sim.policies import CAPACITY_FREE, build_policy, check_policy_name
from sglang_marconi.sim.replay import RunResult, replay
from sglang_marconi.sim.traces import MOONCAKE_TOKEN_MODES, load_workload
from sglang_marconi.sim.units import format_bytes, parse_capacities

DEFAULT_WORKLOAD = "synthetic:swe-agent"
DEFAULT_POLICIES = "none,vllm+,sglang+,marconi,infinite"


def _alpha_grid(text: str) -> tuple[float, ...]:
    try:
        return parse_alpha_grid(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read alpha grid {text!r}: use START:STOP:STEP or a comma list") from None


def _sample_rate(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tune-sample-rate must be a number in (0, 1] or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_marconi.sim", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="trace file: the Marconi authors' JSONL or a Mooncake block-hash JSONL")
    src.add_argument("--workload", help=f"synthetic:KIND[:key=value,...] (default {DEFAULT_WORKLOAD})")
    p.add_argument("--mooncake-tokens", default="conversation", choices=MOONCAKE_TOKEN_MODES,
                   help="how a Mooncake trace's block ids become tokens: 'conversation' (a next turn repeats "
                        "the previous turn's tail and reply) or 'blocks' (only full blocks are shared)")
    p.add_argument("--model", default="paper-7b", help="built-in profile name or a config.json path (default paper-7b)")
    p.add_argument("--capacity", default="2GB,5GB,10GB,20GB", help="comma list, GB = 10^9 bytes, GiB = 2^30")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma list (default {DEFAULT_POLICIES}); marconi:A fixes alpha")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--plot", help="write a PNG of hit rate and FLOPs saved against capacity")
    p.add_argument("--alpha", type=float, help="fix Marconi's alpha instead of tuning it")
    p.add_argument("--block-size", type=int, default=32, help="vLLM+ block (and checkpoint) size in tokens")
    p.add_argument("--checkpoint-grid", type=int, default=1, help="branch checkpoints land on multiples of this (chunked prefill)")
    p.add_argument("--bootstrap-multiplier", type=float, default=5.0)
    p.add_argument("--alpha-grid", type=_alpha_grid, default=TuningConfig.alpha_grid, help="START:STOP:STEP or comma list")
    p.add_argument("--objective", default="flops", choices=("flops", "token_hit_rate"))
    p.add_argument("--no-retune", action="store_true", help="tune alpha once (the paper) instead of every window")
    p.add_argument("--tune-workers", type=int, default=2, help="worker processes for tuning replays (0: in-process)")
    p.add_argument("--tune-sample-rate", type=_sample_rate, default=None,
                   help="share of sessions the tuning replays use ('auto': all for small traces)")
    p.add_argument("--gpu", default="A100-80GB", help="GPU profile for the MODELED time to first token")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--with-requests", action="store_true", help="include per-request records in the JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def auto_sample_rate(n_requests: int, grid_size: int, workers: int) -> float:
    """Keep tuning replays near the main replay's own cost on long traces: a sample of
    (workers / grid) of the sessions once a trace has many thousands of requests."""
    if n_requests <= 4000:
        return 1.0
    return max(max(1, workers) / grid_size, 4000 / n_requests, 0.05)


def run(args: argparse.Namespace) -> list[RunResult]:
    policies = [check_policy_name(p.strip()) for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise MarconiError(f"--policies {args.policies!r} names no policy")
    if args.alpha is not None and args.alpha < 0:
        raise MarconiError(f"--alpha must be >= 0, got {args.alpha}")
    if args.block_size < 1:
        raise MarconiError(f"--block-size must be >= 1, got {args.block_size}")
    if args.limit is not None and args.limit < 1:
        raise MarconiError(f"--limit must be >= 1, got {args.limit}")
    capacities = parse_capacities(args.capacity)
    profile = load_profile(args.model)
    workload = load_workload(args.trace or args.workload or DEFAULT_WORKLOAD, args.mooncake_tokens)
    n = len(workload) if args.limit is None else min(args.limit, len(workload))
    rate = args.tune_sample_rate
    if rate is None:
        rate = auto_sample_rate(n, len(args.alpha_grid), args.tune_workers)
    tuning = TuningConfig(
        bootstrap_multiplier=args.bootstrap_multiplier, alpha_grid=args.alpha_grid, objective=args.objective,
        retune=not args.no_retune, workers=args.tune_workers, sample_rate=rate,
    )
    runs = []
    for policy_name in policies:
        for capacity in capacities[:1] if policy_name in CAPACITY_FREE else capacities:
            policy = build_policy(policy_name, profile, capacity, alpha=args.alpha, block_size=args.block_size,
                                  checkpoint_grid=args.checkpoint_grid, tuning=tuning)
            runs.append(replay(workload, policy, profile, capacity, gpu=args.gpu, progress=not args.no_progress,
                               limit=args.limit))
    return runs


def format_table(runs: list[RunResult]) -> str:
    ref = {(r.policy, r.capacity_bytes): r for r in runs}
    bound = next((r for r in runs if r.policy == "infinite"), None)
    head = (f"{'policy':<18}{'capacity':>10}{'tok hit%':>9}{'req hit%':>9}{'FLOPs sv%':>10}{'x sglang+':>10}"
            f"{'x vllm+':>9}{'%of inf':>8}{'states':>8}{'ev leaf/mid':>13}{'alpha':>7}{'TTFT p95*':>10}{'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        def ratio(base: str) -> str:
            other = ref.get((base, r.capacity_bytes))
            return f"{r.token_hit_rate / other.token_hit_rate:.2f}" if other and other.token_hit_rate else "-"
        share = f"{100 * r.token_hit_rate / bound.token_hit_rate:.0f}" if bound and bound.token_hit_rate else "-"
        cap = "-" if r.policy in CAPACITY_FREE else format_bytes(r.capacity_bytes)
        alpha = (r.choices_used() or [""])[-1] if r.policy.startswith("marconi") else ""
        s = r.stats
        lines.append(
            f"{r.policy:<18}{cap:>10}{100 * r.token_hit_rate:>9.2f}{100 * r.request_hit_rate:>9.1f}"
            f"{100 * r.flops_saved_fraction:>10.2f}{ratio('sglang+'):>10}{ratio('vllm+'):>9}{share:>8}"
            f"{s.ssm_states_cached:>8}{f'{s.evictions_leaf}/{s.evictions_intermediate}':>13}{alpha:>7}"
            f"{r.modeled_ttft_p95_s:>10.3f}{r.wall_seconds:>8.2f}"
        )
    lines.append(f"* TTFT is MODELED from prefill FLOPs on {runs[0].gpu if runs else '?'} (not measured).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = run(args)
    except MarconiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = args.trace or args.workload or DEFAULT_WORKLOAD
    print(f"workload {source}, model {args.model}, {runs[0].requests} requests, {runs[0].input_tokens:,} input tokens")
    print(format_table(runs))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.to_json(args.with_requests) for r in runs], indent=1))
        print(f"wrote {path}")
    if args.plot:
        from sglang_marconi.sim.plot import plot_runs

        print(f"wrote {plot_runs(runs, args.plot, title=f'{source} on {args.model}')}")
    return 0

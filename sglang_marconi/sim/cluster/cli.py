"""`python -m sglang_marconi.sim ... --workers N --routers LIST`: the cluster replay's flags and table.

One row per (router, policy, capacity): each of the N workers runs the policy with `--capacity`
of its own, and the router picks a worker for every request in arrival order.
"""

from __future__ import annotations

import argparse
from itertools import islice

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.cluster.replay import ClusterRun, replay_cluster
from sglang_marconi.sim.cluster.routers import ROUTER_NAMES, CacheAwareConfig, build_router, parse_routers
from sglang_marconi.sim.cluster.workers import BlockRequest, BlockWorker, TokenWorker
from sglang_marconi.sim.units import format_bytes

DEFAULT_ROUTERS = ",".join(ROUTER_NAMES)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    defaults = CacheAwareConfig()
    g = p.add_argument_group("cluster", "replay the trace over N workers behind a router")
    g.add_argument("--workers", type=int, help="replay over N workers, each with --capacity (default: one server)")
    g.add_argument("--routers", default=None,
                   help=f"with --workers: comma list of {', '.join(ROUTER_NAMES)} (default: all)")
    g.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold,
                   help="cache_aware routers: least match rate that pins a request to the best-matching worker "
                        f"(smg's default {defaults.cache_threshold})")
    g.add_argument("--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
                   help=f"cache_aware routers: spill gate's absolute margin in requests (smg's default "
                        f"{defaults.balance_abs_threshold})")
    g.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                   help=f"cache_aware routers: spill gate's multiple of the mean load (smg's default "
                        f"{defaults.balance_rel_threshold})")


def check_cluster_arguments(args: argparse.Namespace) -> bool:
    """True when the cluster replay is asked for; MarconiError names a bad flag value."""
    if args.workers is None:
        if args.routers is not None:
            raise MarconiError("--routers needs --workers N")
        return False
    if args.workers < 1:
        raise MarconiError(f"--workers must be >= 1, got {args.workers}")
    parse_routers(args.routers if args.routers is not None else DEFAULT_ROUTERS)
    return True


def run_cluster(args: argparse.Namespace) -> list[ClusterRun]:
    from sglang_marconi.policy.cost.model_profile import load_profile
    from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
    from sglang_marconi.sim.hindsight import BEST
    from sglang_marconi.sim.policies import check_policy_name, split_policies
    from sglang_marconi.sim.traces import DEFAULT_WORKLOAD, load_workload
    from sglang_marconi.sim.units import parse_capacities, parse_counts

    check_cluster_arguments(args)
    routers = parse_routers(args.routers if args.routers is not None else DEFAULT_ROUTERS)
    config = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
    policies = [check_policy_name(p) for p in split_policies(args.policies)]
    if not policies:
        raise MarconiError(f"--policies {args.policies!r} names no policy")
    if BEST in policies:
        raise MarconiError(f"policy {BEST!r} replays every candidate over the whole trace: not available with --workers")
    if args.alpha is not None and args.alpha < 0:
        raise MarconiError(f"--alpha must be >= 0, got {args.alpha}")
    if args.limit is not None and args.limit < 1:
        raise MarconiError(f"--limit must be >= 1, got {args.limit}")
    capacities = parse_capacities(args.capacity)
    blocks = parse_counts(args.capacity_blocks, "--capacity-blocks") if args.capacity_blocks else None
    profile = load_profile(args.model)
    workload = load_workload(args.trace or args.workload or DEFAULT_WORKLOAD, args.mooncake_tokens)
    tuning = ShadowConfig(alpha_grid=args.alpha_grid, seglen_weights=args.seglen_weights, objective=args.objective,
                          epoch=args.tune_epoch, margin=args.tune_margin, sample_rate=args.tune_sample_rate or 1.0)
    return replay_cells(workload, profile, routers, policies, capacities, args.workers, config=config,
                        tuning=tuning, alpha=args.alpha, block_size=args.block_size,
                        checkpoint_grid=args.checkpoint_grid, probation=args.probation, gpu=args.gpu,
                        limit=args.limit, progress=not args.no_progress, capacity_blocks=blocks,
                        tune_sample_rate=args.tune_sample_rate)


def replay_cells(workload, profile, routers: list[str], policies: list[str], capacities: list[int], workers: int, *,
                 config: CacheAwareConfig | None = None, tuning=None, alpha: float | None = None, block_size: int = 32,
                 checkpoint_grid: int = 1, probation: bool = False, gpu: str = "A100-80GB", limit: int | None = None,
                 progress: bool = False, capacity_blocks: list[int] | None = None,
                 tune_sample_rate: float | None = None) -> list[ClusterRun]:
    """Every (router, policy, capacity) cell over `workers` workers (the benchmark's entry point)."""
    from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
    from sglang_marconi.sim.kv_blocks.registry import build_block_cache, is_kv_policy
    from sglang_marconi.sim.kv_blocks.view import block_trace, kv_capacities
    from sglang_marconi.sim.policies import CAPACITY_FREE, build_policy
    from sglang_marconi.sim.tuning import shadow_config_for

    if workers < 1:
        raise MarconiError(f"--workers must be >= 1, got {workers}")
    tuning = tuning or ShadowConfig()
    total = len(workload) if limit is None else min(limit, len(workload))
    block_requests = None
    runs = []
    for policy_name in policies:
        kv = is_kv_policy(policy_name)
        if kv and block_requests is None:
            trace = block_trace(workload, block_size, limit)
            metas = [(r.session_id, r.arrival_s) for r in islice(workload, total)]
            block_requests = [BlockRequest(s, t, ids, n) for (s, t), (ids, n) in zip(metas, trace.requests)]
        cells = (kv_capacities(trace, profile, capacities, capacity_blocks) if kv
                 else [(None, c) for c in (capacities[:1] if policy_name in CAPACITY_FREE else capacities)])
        for count, capacity in cells:
            for router_name in routers:
                if kv:
                    pool = [BlockWorker(build_block_cache(policy_name, count), trace.block_size) for _ in range(workers)]
                    stream = block_requests
                else:
                    cfg = tuning
                    if policy_name == "marconi" and alpha is None:  # tuned: sample rate by capacity
                        cfg = shadow_config_for(workload, profile, capacity, tuning, tune_sample_rate)
                    pool = [TokenWorker(build_policy(policy_name, profile, capacity, alpha=alpha, block_size=block_size,
                                                     checkpoint_grid=checkpoint_grid, tuning=cfg, probation=probation))
                            for _ in range(workers)]
                    stream = iter(workload)
                runs.append(replay_cluster(stream, total, pool, build_router(router_name, workers, config), profile,
                                           policy=policy_name, capacity_bytes=capacity, workload=workload.name,
                                           gpu=gpu, progress=progress))
    return runs


def format_cluster_table(runs: list[ClusterRun]) -> str:
    width = max([18, *(len(r.policy) + 2 for r in runs)])
    head = (f"{'router':<19}{'policy':<{width}}{'capacity':>10}{'tok hit%':>9}{'FLOPs sv%':>10}{'expected':>14}"
            f"{'missed':>13}{'miss%':>7}{'CV work':>8}{'TTFT p50*':>10}{'TTFT p95*':>10}{'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        exp = "-" if r.expected_tokens is None else f"{r.expected_tokens:,}"
        miss = "-" if r.expected_missed_tokens is None else f"{r.expected_missed_tokens:,}"
        share = ("-" if not r.expected_tokens else f"{100 * r.expected_missed_tokens / r.expected_tokens:.1f}")
        lines.append(f"{r.router:<19}{r.policy:<{width}}{format_bytes(r.capacity_bytes):>10}"
                     f"{100 * r.token_hit_rate:>9.2f}{100 * r.flops_saved_fraction:>10.2f}{exp:>14}{miss:>13}"
                     f"{share:>7}{r.imbalance_cv:>8.3f}{r.modeled_ttft_p50_s:>10.3f}{r.modeled_ttft_p95_s:>10.3f}"
                     f"{r.wall_seconds:>8.2f}")
    gpu = runs[0].gpu if runs else "?"
    lines.append(f"capacity is per worker; expected/missed: hit tokens the router counted on, and those it did not get "
                 f"(miss% of expected); CV work: coefficient of variation of prefill work over workers.")
    lines.append(f"* TTFT is MODELED on {gpu}: FIFO prefill queue per worker from the trace's arrival times "
                 f"(not measured).")
    return "\n".join(lines)

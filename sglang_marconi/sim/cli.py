"""`python -m sglang_marconi.sim`: replay a trace for several policies and capacities.

Stable contract (scripts depend on it):
  python -m sglang_marconi.sim --trace PATH --model PROFILE --capacity 2GB,5GB
      --policies none,vllm+,sglang+,marconi --json OUT.json [--plot OUT.png] [--alpha A] [--block-size 32]
OUT.json holds a list of runs, each with policy, capacity_bytes, token_hit_rate, request_hit_rate,
flops_saved, wall_seconds and alpha_history (plus more fields).

KV-only block caches (`--policies kv-lru,kv-lfu,kv-fifo,kv-s3fifo:small_ratio=0.1,max_freq=3`)
replay the trace's block hash ids; `--capacity-blocks N[,M]` sizes them in blocks instead of
`--capacity` bytes, and their runs add capacity_blocks, block_size, total_hit_tokens,
total_prompt_tokens, overall_hit_rate, final_cache_blocks and evictions.

A host tier (`--host-capacity 100GB,400GB`, SGLang's HiCache with write_back) gives sglang+
(upstream's write-back rule, LRU on both tiers) and marconi (Marconi's demote-or-drop by FLOPs
saved per byte; `--host-depth B|auto` ranks its host by conversation depth instead) a host tier
per device capacity and host capacity; their runs add
host_capacity_bytes, device_hit_tokens, host_hit_tokens, device/host_token_hit_rate,
requests_host_hit, bytes_demoted, bytes_loaded, bytes_dropped, bytes_evicted_host,
bytes_reclaimed, states_demoted, states_dropped, states_evicted_host, load_backs (and more), and
their MODELED TTFT includes the load backs at an assumed host link bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, parse_alpha_grid, parse_seglen_weights
from sglang_marconi.sim.baselines.belady import BELADY, BeladyBound
from sglang_marconi.sim.cluster.cli import (add_cluster_arguments, check_cluster_arguments, format_cluster_table,
                                            run_cluster)
from sglang_marconi.sim.hindsight import BEST, replay_best
from sglang_marconi.sim.kv_blocks.registry import build_block_cache, is_kv_policy
from sglang_marconi.sim.kv_blocks.replay import replay_blocks
from sglang_marconi.sim.kv_blocks.view import BlockTrace, block_trace, kv_capacities
from sglang_marconi.sim.policies import (CAPACITY_FREE, SERVED_POLICY_NAMES, SWA_POLICY_NAMES, build_policy,
                                         check_policy_name, has_host_tier, split_policies)
from sglang_marconi.sim.replay import RunResult, replay
from sglang_marconi.sim.traces import DEFAULT_WORKLOAD, MOONCAKE_TOKEN_MODES, load_workload
from sglang_marconi.sim.tuning import shadow_config_for
from sglang_marconi.sim.units import format_bytes, parse_capacities, parse_counts, parse_host_capacities

DEFAULT_POLICIES = "none,vllm+,sglang+,marconi,marconi-best,infinite"


def _alpha_grid(text: str) -> tuple[float, ...]:
    try:
        return parse_alpha_grid(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read alpha grid {text!r}: use START:STOP:STEP or a comma list") from None


def _seglen_weights(text: str) -> tuple[float, ...]:
    try:
        return parse_seglen_weights(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read SegLen weights {text!r}: use a comma list or 'none'") from None


def _host_alpha(text: str) -> float | None:
    if text == "device":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--host-alpha must be a number >= 0 or 'device', got {text!r}")
    return value


def _host_depth(text: str) -> float | str | None:
    from sglang_marconi.policy.rules.tier_rules import parse_host_depth  # the launcher's own parser

    try:
        return parse_host_depth(text, "--host-depth")
    except MarconiError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backtrack_states(text: str) -> int | None:
    from sglang_marconi.policy.rules.backtrack_states import parse_backtrack_states  # the launcher's own parser

    try:
        return parse_backtrack_states(text, "--backtrack-states")
    except MarconiError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    src.add_argument("--workload", help="synthetic:KIND[:key=value,...] or stress:KIND[:key=value,...] "
                                        f"(default {DEFAULT_WORKLOAD})")
    p.add_argument("--mooncake-tokens", default="conversation", choices=MOONCAKE_TOKEN_MODES,
                   help="how a Mooncake trace's block ids become tokens: 'conversation' (a next turn repeats "
                        "the previous turn's tail and reply) or 'blocks' (only full blocks are shared)")
    p.add_argument("--model", default="paper-7b", help="built-in profile name or a config.json path (default paper-7b)")
    p.add_argument("--capacity", default="2GB,5GB,10GB,20GB", help="comma list, GB = 10^9 bytes, GiB = 2^30")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma list (default {DEFAULT_POLICIES}); marconi:A fixes alpha; marconi-best is the "
                        "best fixed choice in hindsight; belady an offline upper bound on any eviction under "
                        "Marconi's admission; coverage SGLang PR #38000's eviction rule; KV-only block caches "
                        "kv-lru, kv-lfu, kv-fifo, kv-s3fifo[:small_ratio=0.1,max_freq=3]")
    p.add_argument("--capacity-blocks", help="comma list of block counts for the kv-* policies (instead of --capacity)")
    p.add_argument("--host-capacity",
                   help="comma list of host-tier sizes (SGLang's HiCache, write_back): sglang+ and marconi run "
                        "with each beside each --capacity; 0 runs them without a host tier")
    p.add_argument("--host-alpha", type=_host_alpha, default=1.0,
                   help="marconi's host ranking: recency + A x FLOPs saved per byte (default 1: equal weights; "
                        "'device': the device's alpha in force)")
    p.add_argument("--host-depth", type=_host_depth, default=None, metavar="off|B|auto",
                   help="marconi's host ranking by conversation depth instead, age / (1 + depth)^B (a number B, "
                        "or 'auto' fitted from the stream), as the server's --marconi-host-depth (default off)")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--plot", help="write a PNG of hit rate and FLOPs saved against capacity")
    p.add_argument("--alpha", type=float, help="fix Marconi's alpha instead of tuning it")
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM+ block (and checkpoint) size in tokens; also the kv-* block size on a trace "
                        "without hash ids (a Mooncake trace keeps its 512)")
    p.add_argument("--checkpoint-grid", type=int, default=1, help="branch checkpoints land on multiples of this (chunked prefill)")
    p.add_argument("--alpha-grid", type=_alpha_grid, default=ShadowConfig.alpha_grid,
                   help="alphas the tuner's shadows run beside SGLang's LRU: START:STOP:STEP or comma list")
    p.add_argument("--seglen-weights", type=_seglen_weights, default=ShadowConfig.seglen_weights,
                   help="weights of the SegLen-style candidates beside them: comma list, or 'none'")
    p.add_argument("--objective", default="flops", choices=("flops", "token_hit_rate"))
    p.add_argument("--tune-sample-rate", type=_sample_rate, default=None,
                   help="share of sessions the shadow caches see ('auto': by trace size and capacity)")
    p.add_argument("--tune-epoch", type=int, default=ShadowConfig.epoch, help="sampled requests between decisions")
    p.add_argument("--tune-margin", type=float, default=ShadowConfig.margin,
                   help="lead a choice needs over the current one, as a share of the most the requests could save")
    p.add_argument("--probation", action="store_true",
                   help="SGLang+ and Marconi also keep a probationary state at the end of each input, evicted "
                        "first, confirmed by a hit (a prefix used exactly twice in a row then hits at the second use)")
    p.add_argument("--gpu", default="A100-80GB", help="GPU profile for the MODELED time to first token")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--with-requests", action="store_true",
                   help="include per-request records in the JSON (sliding-window models: why each hit ended)")
    p.add_argument("--swa-share", type=float,
                   help="sliding-window models: the SWA KV pool's share of --capacity (a static split); "
                        "default: furiosa's proportional split, one budget for sglang+ and marconi")
    served = p.add_argument_group("the served cache (SGLang's radix cache with the marconi backend, modeled request by "
                                  "request: policy/tree/served_cache.py); --kv-tokens and --mamba-slots select it")
    served.add_argument("--kv-tokens", type=int, help="the server's KV pool, in token slots (instead of --capacity)")
    served.add_argument("--mamba-slots", type=int, help="the server's Mamba pool, in state slots (running requests' included)")
    served.add_argument("--mamba-radix-cache-strategy", default="no_buffer", choices=("no_buffer", "extra_buffer"),
                        help="SGLang's Mamba strategy (default no_buffer; extra_buffer is SGLang's GPU default)")
    served.add_argument("--chunked-prefill-size", type=int, help="SGLang's prefill chunk (default: one extend per prompt)")
    served.add_argument("--mamba-cache-chunk-size", type=int, default=64,
                        help="extra_buffer: SGLang's prefill snapshot grid (the model's mamba_chunk_size; 64)")
    served.add_argument("--mamba-track-interval", type=int, default=256,
                        help="extra_buffer: decode snapshots every lcm(this, --mamba-cache-chunk-size) tokens (256)")
    served.add_argument("--swa-tokens", type=int,
                        help="sliding-window models: the server's SWA KV pool, in token slots (with --kv-tokens, the "
                             "full-KV pool): marconi runs as served on those two pools")
    served.add_argument("--backtrack-states", type=_backtrack_states, default=None, metavar="auto|B",
                        help="backtrack states per request, as the server's --marconi-backtrack-states (default "
                             "auto: the server's default, 3 in extra_buffer, off in no_buffer)")
    served.add_argument("--tune-sync-every", type=int, default=32,
                        help="tuned marconi: requests between the server's sync points (--marconi-tune-sync-every)")
    p.add_argument("--no-progress", action="store_true")
    add_cluster_arguments(p)  # --workers N --routers LIST: the cluster replay (sim/cluster)
    return p


def run(args: argparse.Namespace) -> list[RunResult]:
    policies = [check_policy_name(p) for p in split_policies(args.policies)]
    if not policies:
        raise MarconiError(f"--policies {args.policies!r} names no policy")
    if args.alpha is not None and args.alpha < 0:
        raise MarconiError(f"--alpha must be >= 0, got {args.alpha}")
    if args.block_size < 1:
        raise MarconiError(f"--block-size must be >= 1, got {args.block_size}")
    if args.limit is not None and args.limit < 1:
        raise MarconiError(f"--limit must be >= 1, got {args.limit}")
    profile = load_profile(args.model)
    swa_pools = served_swa_pools_of(args, profile)
    served = None if swa_pools else served_pools_of(args)
    capacities = parse_capacities(args.capacity)
    host_capacities = parse_host_capacities(args.host_capacity) if args.host_capacity else [0]
    if args.host_capacity and not any(map(has_host_tier, policies)):
        raise MarconiError("--host-capacity gives sglang+ and marconi a host tier, and --policies names neither")
    if args.host_depth is not None and not args.host_capacity:
        raise MarconiError(f"--host-depth {args.host_depth!r} ranks marconi's host tier: give --host-capacity")
    if args.host_capacity and (served is not None or swa_pools is not None):
        raise MarconiError("--host-capacity models a host tier on one byte budget (--capacity); the served pools "
                           "(--kv-tokens / --mamba-slots / --swa-tokens) have none modeled")
    blocks = parse_counts(args.capacity_blocks, "--capacity-blocks") if args.capacity_blocks else None
    if blocks and not any(map(is_kv_policy, policies)):
        raise MarconiError("--capacity-blocks sizes only kv-* policies, and --policies names none")
    if swa_pools is not None:
        from sglang_marconi.policy.tree.window_cache import pool_split

        capacities = [pool_split(profile, *swa_pools)[0]]
        if args.policies == DEFAULT_POLICIES:
            policies = list(SERVED_SWA_POLICY_NAMES)
        for name in policies:
            if name.partition(":")[0] not in SERVED_SWA_POLICY_NAMES:
                raise MarconiError(f"policy {name!r} is not a configuration of the served SWA cache; with "
                                   f"--swa-tokens choose from {', '.join(SERVED_SWA_POLICY_NAMES)} or marconi:ALPHA")
    elif served is not None:
        from sglang_marconi.sim.baselines.served import served_capacity_bytes

        capacities = [served_capacity_bytes(profile, served)]  # reported only: the pools decide
        if args.policies == DEFAULT_POLICIES:
            policies = list(SERVED_POLICY_NAMES)
    if profile.has_sliding_window and args.policies == DEFAULT_POLICIES and swa_pools is None:
        policies = list(SWA_POLICY_NAMES)  # the default list names policies that model no windows
    workload = load_workload(args.trace or args.workload or DEFAULT_WORKLOAD, args.mooncake_tokens)
    tuning = ShadowConfig(alpha_grid=args.alpha_grid, seglen_weights=args.seglen_weights, objective=args.objective,
                          epoch=args.tune_epoch, margin=args.tune_margin, sample_rate=args.tune_sample_rate or 1.0)
    trace = bound = None
    runs = []
    for policy_name in policies:
        if is_kv_policy(policy_name):
            if trace is None:
                trace = block_trace(workload, args.block_size, args.limit)
            for count, capacity in kv_capacities(trace, profile, capacities, blocks):
                runs.append(replay_blocks(trace, build_block_cache(policy_name, count), profile, name=policy_name,
                                          capacity_bytes=capacity, gpu=args.gpu, progress=not args.no_progress))
            continue
        for capacity in capacities[:1] if policy_name in CAPACITY_FREE else capacities:
            replay_args = dict(gpu=args.gpu, progress=not args.no_progress, limit=args.limit)
            if policy_name == BELADY:  # one pass over the trace, then one bound per capacity
                if bound is None:
                    bound = BeladyBound(workload, profile, checkpoint_grid=args.checkpoint_grid,
                                        probation=args.probation, limit=args.limit)
                runs.append(bound.run(capacity, gpu=args.gpu))
                continue
            if policy_name == BEST:
                if profile.has_sliding_window:
                    raise MarconiError(f"{BEST} does not model sliding-window layers ({profile.name})")
                runs.append(replay_best(workload, profile, capacity, tuning, checkpoint_grid=args.checkpoint_grid,
                                        probation=args.probation, **replay_args))
                continue
            config = tuning
            if policy_name == "marconi" and args.alpha is None and served is None and swa_pools is None:  # tuned: the sample rate may depend on capacity
                config = shadow_config_for(workload, profile, capacity, tuning, args.tune_sample_rate)
            if swa_pools is not None and policy_name.partition(":")[0] == "marconi":
                from sglang_marconi.sim.baselines.swa_radix import served_marconi_swa

                fixed = policy_name.partition(":")[2]
                policy = served_marconi_swa(profile, *swa_pools, alpha=float(fixed) if fixed else args.alpha,
                                            tuning=config, sync_every=args.tune_sync_every,
                                            chunk_size=args.chunked_prefill_size)
                runs.append(replay(workload, policy, profile, capacity, **replay_args))
                if hasattr(policy, "request_records"):  # SWA policies: hit-end reasons per request
                    runs[-1].per_request.update(policy.request_records())
                continue
            for host in host_capacities if has_host_tier(policy_name) and served is None else [0]:
                from sglang_marconi.sim.hinted import with_trace_hints

                policy = with_trace_hints(build_policy(  # the trace's cache hints (`sim/hinted.py`), if any
                    policy_name, profile, capacity, alpha=args.alpha, block_size=args.block_size,
                    swa_share=args.swa_share, served=served, sync_every=args.tune_sync_every,
                    checkpoint_grid=args.checkpoint_grid, tuning=config,
                    probation=args.probation, host_capacity=host, host_alpha=args.host_alpha,
                    host_depth=args.host_depth))
                runs.append(replay(workload, policy, profile, capacity, **replay_args))
                if hasattr(policy, "request_records"):  # SWA policies: hit-end reasons per request
                    runs[-1].per_request.update(policy.request_records())
    return runs


def _host(run: RunResult) -> int:
    return run.tiers["host_capacity_bytes"] if run.tiers else 0


SERVED_SWA_POLICY_NAMES = ("none", "marconi", "infinite")  # the served SWA cache: marconi at an alpha, or tuned


def served_swa_pools_of(args: argparse.Namespace, profile) -> tuple[int, int] | None:
    """A sliding-window model's served pools (`--kv-tokens` full-KV tokens, `--swa-tokens` SWA
    tokens), or None."""
    if getattr(args, "swa_tokens", None) is None and not (profile.has_sliding_window and args.kv_tokens is not None):
        return None
    if not profile.has_sliding_window:
        raise MarconiError(f"--swa-tokens sizes a sliding-window pool; {profile.name} has none")
    if args.kv_tokens is None or args.swa_tokens is None or args.mamba_slots is not None:
        raise MarconiError("a sliding-window model's served pools are --kv-tokens and --swa-tokens (no --mamba-slots)")
    return args.kv_tokens, args.swa_tokens


def served_pools_of(args: argparse.Namespace):
    """The served cache's pools from the command line (`--kv-tokens`, `--mamba-slots`, ...), or None."""
    if args.kv_tokens is None and args.mamba_slots is None:
        if getattr(args, "backtrack_states", None) is not None:
            raise MarconiError("--backtrack-states runs on the served cache's pools: give --kv-tokens and --mamba-slots")
        return None
    if args.kv_tokens is None or args.mamba_slots is None:
        raise MarconiError("--kv-tokens and --mamba-slots go together (the server's two pools)")
    import math

    from sglang_marconi.policy.tree.served_cache import ServedPools

    return ServedPools(args.kv_tokens, args.mamba_slots, args.mamba_radix_cache_strategy, args.chunked_prefill_size,
                       args.mamba_cache_chunk_size, math.lcm(args.mamba_cache_chunk_size, args.mamba_track_interval),
                       backtrack_states=getattr(args, "backtrack_states", None))


def format_table(runs: list[RunResult]) -> str:
    ref = {(r.policy, r.capacity_bytes, _host(r)): r for r in runs}
    bound = next((r for r in runs if r.policy == "infinite"), None)
    width = max([18, *(len(r.label()) + 2 for r in runs)])
    head = (f"{'policy':<{width}}{'capacity':>10}{'tok hit%':>9}{'req hit%':>9}{'FLOPs sv%':>10}{'x sglang+':>10}"
            f"{'x vllm+':>9}{'%of inf':>8}{'states':>8}{'ev leaf/mid':>13}{'choice':>12}{'TTFT p95*':>10}{'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        def ratio(base: str) -> str:
            other = ref.get((base, r.capacity_bytes, _host(r)))
            return f"{r.token_hit_rate / other.token_hit_rate:.2f}" if other and other.token_hit_rate else "-"
        share = f"{100 * r.token_hit_rate / bound.token_hit_rate:.0f}" if bound and bound.token_hit_rate else "-"
        cap = "-" if r.policy in CAPACITY_FREE else format_bytes(r.capacity_bytes)
        choice = (r.choices_used() or [""])[-1] if r.policy.startswith("marconi") else ""
        s = r.stats
        lines.append(
            f"{r.label():<{width}}{cap:>10}{100 * r.token_hit_rate:>9.2f}{100 * r.request_hit_rate:>9.1f}"
            f"{100 * r.flops_saved_fraction:>10.2f}{ratio('sglang+'):>10}{ratio('vllm+'):>9}{share:>8}"
            f"{s.ssm_states_cached:>8}{f'{s.evictions_leaf}/{s.evictions_intermediate}':>13}{choice:>12}"
            f"{r.modeled_ttft_p95_s:>10.3f}{r.wall_seconds:>8.2f}"
        )
    lines.append(f"* TTFT is MODELED from prefill FLOPs on {runs[0].gpu if runs else '?'} (not measured).")
    kv = [r for r in runs if r.block_cache]
    if kv:
        lines += ["", format_block_table(kv, width)]
    tiered = [r for r in runs if r.tiers]
    if tiered:
        lines += ["", format_tier_table(tiered, width)]
    return "\n".join(lines)


def format_tier_table(runs: list[RunResult], width: int = 18) -> str:
    """The host-tier runs: hits by tier and the traffic between the tiers."""
    head = (f"{'host tier':<{width}}{'device':>9}{'host':>9}{'tok hit%':>9}{'dev hit%':>9}{'host hit%':>10}"
            f"{'req host':>9}{'GB demoted':>11}{'GB loaded':>10}{'GB dropped':>11}{'st dropped':>11}"
            f"{'host st':>8}{'TTFT p95*':>10}")
    lines = [head, "-" * len(head)]
    for r in runs:
        t = r.tiers
        dropped = (t["bytes_dropped"] + t["bytes_evicted_host"]) / 1e9
        states_lost = t["states_dropped"] + t["states_evicted_host"]
        lines.append(f"{r.policy:<{width}}{format_bytes(r.capacity_bytes):>9}{format_bytes(t['host_capacity_bytes']):>9}"
                     f"{100 * r.token_hit_rate:>9.2f}{100 * t['device_token_hit_rate']:>9.2f}"
                     f"{100 * t['host_token_hit_rate']:>10.2f}{t['requests_host_hit']:>9}"
                     f"{t['bytes_demoted'] / 1e9:>11.1f}{t['bytes_loaded'] / 1e9:>10.1f}{dropped:>11.1f}"
                     f"{states_lost:>11}{t['host_states_cached']:>8}{r.modeled_ttft_p95_s:>10.3f}")
    lines.append("dev/host hit%: input tokens served from the device alone / only with the host tier (loaded back); "
                 "GB dropped: left the cache (device drops and host evictions; duplicates freed not counted); "
                 "st dropped: states lost either way. * TTFT MODELED, load backs included at the assumed host link "
                 "bandwidth (sim/host_link.py).")
    return "\n".join(lines)


def format_block_table(runs: list[RunResult], width: int = 18) -> str:
    """The kv-* runs: capacity in blocks, token totals, hit rate, final contents."""
    head = (f"{'KV-only policy':<{width}}{'blocks':>9}{'block':>7}{'hit tokens':>14}{'prompt tokens':>15}"
            f"{'hit%':>8}{'final blocks':>13}{'evictions':>11}{'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        b = r.block_cache
        lines.append(f"{r.policy:<{width}}{b['capacity_blocks']:>9}{b['block_size']:>7}{b['total_hit_tokens']:>14,}"
                     f"{b['total_prompt_tokens']:>15,}{100 * b['overall_hit_rate']:>8.2f}{b['final_cache_blocks']:>13}"
                     f"{b['evictions']:>11}{r.wall_seconds:>8.2f}")
    derived = [r for r in runs if r.block_cache["hashes_derived"]]
    if derived:
        lines.append(f"(block hash ids derived from tokens, {derived[0].block_cache['block_size']}-token blocks: "
                     "the workload has none of its own)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cluster = check_cluster_arguments(args)
        runs = run_cluster(args) if cluster else run(args)
    except MarconiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = args.trace or args.workload or DEFAULT_WORKLOAD
    workers = f"{args.workers} workers, " if cluster else ""
    print(f"workload {source}, model {args.model}, {workers}{runs[0].requests} requests, "
          f"{runs[0].input_tokens:,} input tokens")
    print(format_cluster_table(runs) if cluster else format_table(runs))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.to_json(args.with_requests) for r in runs], indent=1))
        print(f"wrote {path}")
    if args.plot and not cluster:
        from sglang_marconi.sim.plot import plot_runs

        print(f"wrote {plot_runs(runs, args.plot, title=f'{source} on {args.model}')}")
    return 0

"""`python -m sglang_marconi.plan`: which split of a GPU's cache memory, which Mamba strategy, which
eviction and whether a host tier suit an operator's own traffic, and the SGLang flags for it.

    python -m sglang_marconi.plan --trace FILE --model PROFILE --memory 100GB [--host-memory 400GB]
        [--limit N] [--json OUT.json] [--plot OUT.png | --out DIR] [--gpu-memory 141GB]

Every figure is the simulator's (`sim/`) for that configuration: hit rate, prefill FLOPs saved, and
MODELED time to first token (`sim/ttft_model.py`, from prefill FLOPs, not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_marconi.plan import grid
from sglang_marconi.plan.grid import Plan, Row
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.traces import DEFAULT_WORKLOAD, MOONCAKE_TOKEN_MODES, load_workload
from sglang_marconi.sim.units import format_bytes, parse_bytes

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, never a requirement
    tqdm = None


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        shares = ()
    if not shares or not all(0 < s < 1 for s in shares):
        raise argparse.ArgumentTypeError(f"--mamba-shares {text!r}: expected a comma list of numbers in (0, 1)")
    return shares


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_marconi.plan", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="your trace: a Mooncake block-hash JSONL or the Marconi authors' JSONL")
    src.add_argument("--workload", help="synthetic:KIND[:key=value,...] or stress:KIND[:key=value,...] "
                                        "instead of a trace")
    p.add_argument("--mooncake-tokens", default="conversation", choices=MOONCAKE_TOKEN_MODES,
                   help="how a Mooncake trace's block ids become tokens (as the simulator's flag)")
    p.add_argument("--model", required=True, help="built-in profile name or a config.json path")
    p.add_argument("--memory", required=True, help="GPU memory for the KV and Mamba pools together, e.g. 80GB")
    p.add_argument("--host-memory", help="host memory for SGLang's HiCache (write_back), e.g. 400GB")
    p.add_argument("--mamba-shares", type=_shares, default=grid.DEFAULT_MAMBA_SHARES,
                   help="the Mamba pool's shares of --memory to try (default "
                        f"{','.join(f'{s:g}' for s in grid.DEFAULT_MAMBA_SHARES)})")
    p.add_argument("--chunked-prefill-size", type=int, help="the server's prefill chunk (default: one extend per prompt)")
    p.add_argument("--probation", default="on", choices=("on", "off"),
                   help="the served rows' --marconi-probation (the server's default: on)")
    p.add_argument("--gpu", default="A100-80GB", help="GPU profile for the MODELED time to first token")
    p.add_argument("--gpu-memory", help="the GPU's memory: recommend --mem-fraction-static instead of --max-total-tokens")
    p.add_argument("--weights-memory", help="with --gpu-memory: the model weights' bytes (default: estimated from "
                                            "the profile, 2 FLOPs per parameter per token; dense models only)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", help="write the table here")
    p.add_argument("--plot", help="write a PNG here")
    p.add_argument("--out", help="a folder for plan.json and plan.png (where --json / --plot are not given)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    return p


def _bytes(flag: str, text: str) -> int:
    try:
        return parse_bytes(text)
    except MarconiError as exc:
        raise MarconiError(f"{flag}: {exc}") from None


def make_plan(args: argparse.Namespace, progress: bool = False):
    """Check the inputs, replay every configuration; (plan, workload, profile, memory, host)."""
    if args.limit is not None and args.limit < 1:
        raise MarconiError(f"--limit must be >= 1, got {args.limit}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size < 1:
        raise MarconiError(f"--chunked-prefill-size must be >= 1, got {args.chunked_prefill_size}")
    memory = _bytes("--memory", args.memory)
    host = _bytes("--host-memory", args.host_memory) if args.host_memory else 0
    profile = load_profile(args.model)
    if profile.has_sliding_window or not profile.ssm_state_bytes or not profile.kv_bytes_per_token:
        raise MarconiError(f"--model {args.model!r}: the planner splits memory between KV and Mamba pools; "
                           "it needs a model with both attention and SSM layers and no sliding window")
    if args.gpu_memory:
        _gpu_fraction(args, profile, memory)  # bad sizes fail before the replays
    workload = load_workload(args.trace or args.workload, args.mooncake_tokens)
    if len(workload) == 0:
        raise MarconiError(f"{args.trace or args.workload}: no requests")
    longest = grid.max_request_tokens(workload, args.limit)
    configs, skipped = grid.served_configs(profile, memory, args.mamba_shares, args.chunked_prefill_size, longest)
    if not configs:
        raise MarconiError(
            f"--memory {args.memory!r} is too small for one request: the longest request needs {longest:,} KV "
            f"tokens ({format_bytes(longest * profile.kv_bytes_per_token)}) beside at least 2 Mamba states "
            f"({format_bytes(2 * profile.ssm_state_bytes)}) in every split tried")
    if host:
        configs += grid.tiered_configs(memory, host)
    bar = tqdm(total=len(configs) + 1, unit="run", file=sys.stderr, leave=False) if progress else None
    common = dict(limit=args.limit, gpu=args.gpu)
    rows = []
    for config in configs:
        if bar is not None:
            bar.set_description(f"{config.policy}: {config.label()}")
        rows.append(Row(config, grid.run_config(config, workload, profile, chunk_size=args.chunked_prefill_size,
                                                probation=args.probation == "on", progress=progress, **common)))
        if bar is not None:
            bar.update()
    infinite = grid.run_infinite(workload, profile, **common)
    if bar is not None:
        bar.close()
    return Plan(rows, infinite, skipped), workload, profile, memory, host


# ---------------------------------------------------------------- what the plan says


def format_table(plan: Plan) -> str:
    width = max(len(r.config.label()) for r in plan.rows) + 2
    head = (f"{'configuration':<{width}}{'policy':<9}{'KV tokens':>12}{'Mamba slots':>12}{'tok hit%':>9}"
            f"{'FLOPs sv%':>10}{'TTFT p50*':>10}{'TTFT p95*':>10}  choices")
    lines = [head, "-" * len(head)]
    best = plan.best()
    for row in plan.rows:
        c, r = row.config, row.run
        if c.model == "tiered" and row is plan.tiered()[0]:
            lines.append("byte-budget tiered model (the served-pools model has no host tier): one budget of "
                         f"{format_bytes(c.device_bytes)}, no split, no Mamba strategy, no probation")
        kv = f"{c.kv_tokens:,}" if c.kv_tokens is not None else "-"
        slots = f"{c.mamba_slots:,}" if c.mamba_slots is not None else "-"
        choices = " > ".join(r.choices_used()[:4]) if c.policy == "marconi" else ""
        mark = "  <- best" if row is best else ""
        lines.append(f"{c.label():<{width}}{c.policy:<9}{kv:>12}{slots:>12}{100 * r.token_hit_rate:>9.2f}"
                     f"{100 * r.flops_saved_fraction:>10.2f}{r.modeled_ttft_p50_s:>10.3f}{r.modeled_ttft_p95_s:>10.3f}"
                     f"  {choices}{mark}")
    inf = plan.infinite
    lines.append(f"{'infinite cache (bound)':<{width}}{'':<9}{'-':>12}{'-':>12}{100 * inf.token_hit_rate:>9.2f}"
                 f"{100 * inf.flops_saved_fraction:>10.2f}{inf.modeled_ttft_p50_s:>10.3f}{inf.modeled_ttft_p95_s:>10.3f}")
    lines.append(f"* TTFT is MODELED from prefill FLOPs on {inf.gpu} (not measured); lru is SGLang's LRU eviction "
                 "(the simulator's sglang+: the marconi backend's lru choice, Marconi's admission), marconi is tuned "
                 "online as the server tunes it.")
    lines += [f"left out: {s}" for s in plan.skipped]
    return "\n".join(lines)


def verdict(plan: Plan) -> str:
    """The gain of the best Marconi configuration over the best LRU one, or why there is none."""
    m, l = plan.best("marconi"), plan.best("lru")
    inf = plan.infinite
    if grid.gains(m.run, l.run):
        return (f"verdict: tuned Marconi saves {100 * m.run.flops_saved_fraction:.2f}% of prefill FLOPs "
                f"({m.config.label()}) against LRU's best {100 * l.run.flops_saved_fraction:.2f}% "
                f"({l.config.label()}): x{m.run.flops_saved / max(l.run.flops_saved, 1e-30):.3f} FLOPs saved, token "
                f"hit rate {100 * m.run.token_hit_rate:.2f}% vs {100 * l.run.token_hit_rate:.2f}%, modeled TTFT p95 "
                f"{m.run.modeled_ttft_p95_s:.3f} s vs {l.run.modeled_ttft_p95_s:.3f} s")
    if inf.token_hit_rate < grid.LITTLE_REUSE:
        reason = f"the trace has little reuse: infinite-cache token hit rate {100 * inf.token_hit_rate:.2f}%"
    elif all(grid.same_hits(a.run, b.run) for a, b in _pairs(plan)):
        if all(b.run.choices_used() == ["lru"] for _, b in _pairs(plan)):
            why = f"the tuner found nothing better than LRU to adopt in {inf.requests:,} requests"
        else:
            why = "the choices the tuner adopted evicted as LRU does"
        reason = (f"every split's LRU already equals Marconi ({why}; best token hit rate "
                  f"{100 * l.run.token_hit_rate:.2f}% of an infinite cache's {100 * inf.token_hit_rate:.2f}%)")
    elif grid.gains(l.run, m.run):
        reason = (f"LRU's best saves {100 * l.run.flops_saved_fraction:.2f}% of prefill FLOPs ({l.config.label()}), "
                  f"more than tuned Marconi's best {100 * m.run.flops_saved_fraction:.2f}% ({m.config.label()})")
    else:
        reason = (f"tuned Marconi's best saves {100 * m.run.flops_saved_fraction:.2f}% of prefill FLOPs, LRU's best "
                  f"{100 * l.run.flops_saved_fraction:.2f}%: within {100 * grid.GAIN_THRESHOLD:g}% of each other")
    gaining = [(b.run.flops_saved_fraction - a.run.flops_saved_fraction, a, b) for a, b in _pairs(plan)
               if grid.gains(b.run, a.run)]
    if gaining:  # the best splits tie, yet a split short of one pool's room is where Marconi earns
        _, a, b = max(gaining, key=lambda g: g[0])
        reason += (f"; at a worse split Marconi does gain: most at {a.config.label()}, "
                   f"{100 * a.run.flops_saved_fraction:.2f}% -> {100 * b.run.flops_saved_fraction:.2f}%")
    return f"verdict: nothing to gain here: {reason}"


def _pairs(plan: Plan):
    by_config = {}
    for row in plan.served():
        c = row.config
        by_config.setdefault((c.mamba_share, c.strategy), {})[c.policy] = row
    return [(d["lru"], d["marconi"]) for d in by_config.values() if len(d) == 2]


def host_line(plan: Plan, host: int) -> str | None:
    if not host:
        return None
    policy = plan.best().config.policy
    rows = {r.config.host_bytes > 0: r.run for r in plan.tiered(policy)}
    with_host, without = rows[True], rows[False]
    change = with_host.flops_saved_fraction - without.flops_saved_fraction
    word = "wins" if plan.host_tier_wins() else "does not win"
    return (f"host tier ({policy}, byte-budget model): {100 * without.flops_saved_fraction:.2f}% -> "
            f"{100 * with_host.flops_saved_fraction:.2f}% of prefill FLOPs saved ({100 * change:+.2f} points, "
            f"token hit {100 * without.token_hit_rate:.2f}% -> {100 * with_host.token_hit_rate:.2f}%): {word}")


def recommended_flags(plan: Plan, profile, memory: int, host: int, args: argparse.Namespace) -> list[str]:
    """The SGLang flags of the best served configuration (and HiCache's when the host tier wins)."""
    c = plan.best().config
    flags = ["--max-mamba-cache-size", str(c.mamba_slots)]
    if args.gpu_memory:
        flags += ["--mem-fraction-static", f"{_gpu_fraction(args, profile, memory):.3f}"]
    else:
        flags += ["--max-total-tokens", str(c.kv_tokens)]
    flags += ["--mamba-radix-cache-strategy", c.strategy]
    if args.chunked_prefill_size:
        flags += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if c.policy == "marconi":
        flags += ["--radix-cache-backend", "marconi", "--marconi-alpha", "auto", "--marconi-probation", args.probation]
    if plan.host_tier_wins():
        flags += ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
                  "--hicache-size", f"{host / 1e9:g}"]
    return flags


def _gpu_fraction(args: argparse.Namespace, profile, memory: int) -> float:
    """SGLang's --mem-fraction-static: weights and cache pools over the GPU's memory."""
    gpu = _bytes("--gpu-memory", args.gpu_memory)
    if args.weights_memory:
        weights = _bytes("--weights-memory", args.weights_memory)
    elif profile.moe is not None:
        raise MarconiError(f"--model {args.model!r} is a mixture of experts: its FLOPs do not give its weights; "
                           "pass --weights-memory")
    else:
        weights = profile.linear_flops_per_token // 2 * profile.dtype_bytes
    fraction = (weights + memory) / gpu
    if fraction >= 1:
        raise MarconiError(f"--gpu-memory {args.gpu_memory!r} holds less than the weights "
                           f"({format_bytes(weights)}) and --memory {args.memory!r} together")
    return fraction


def plan_json(plan: Plan, flags: list[str], verdict_line: str, host: str | None) -> dict:
    return {"rows": [r.to_json() for r in plan.rows],
            "best": plan.rows.index(plan.best()),
            "best_marconi": plan.rows.index(plan.best("marconi")),
            "best_lru": plan.rows.index(plan.best("lru")),
            "infinite": {"token_hit_rate": plan.infinite.token_hit_rate,
                         "flops_saved_fraction": plan.infinite.flops_saved_fraction},
            "host_tier_wins": plan.host_tier_wins(), "host": host,
            "skipped": plan.skipped, "recommended_flags": flags, "verdict": verdict_line}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = not args.no_progress and tqdm is not None and sys.stderr.isatty()
    try:
        plan, workload, profile, memory, host = make_plan(args, progress)
    except MarconiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = args.trace or args.workload
    print(f"plan for {source} on {profile.name}: {plan.infinite.requests:,} requests, "
          f"{plan.infinite.input_tokens:,} input tokens; --memory {format_bytes(memory)} "
          f"(KV {format_bytes(profile.kv_bytes_per_token)}/token, Mamba state {format_bytes(profile.ssm_state_bytes)})"
          + (f", --host-memory {format_bytes(host)}" if host else ""))
    print(format_table(plan))
    best = plan.best()
    print(f"best: {best.config.policy}, {best.config.label()} ({100 * best.run.flops_saved_fraction:.2f}% of prefill "
          f"FLOPs saved, token hit {100 * best.run.token_hit_rate:.2f}%)")
    host_text = host_line(plan, host)
    if host_text:
        print(host_text)
    verdict_line = verdict(plan)
    print(verdict_line)
    flags = recommended_flags(plan, profile, memory, host, args)
    launcher = "python -m sglang_marconi.launch_server" if best.config.policy == "marconi" else "python -m sglang.launch_server"
    print(f"flags: {launcher} --model-path MODEL {' '.join(flags)}")
    json_path = args.json or (Path(args.out) / "plan.json" if args.out else None)
    plot_path = args.plot or (Path(args.out) / "plan.png" if args.out else None)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan_json(plan, flags, verdict_line, host_text), indent=1))
        print(f"wrote {path}")
    if plot_path:
        from sglang_marconi.plan.plot import plot_plan

        print(f"wrote {plot_plan(plan, plot_path, title=f'{source} on {profile.name}, {format_bytes(memory)}')}")
    return 0

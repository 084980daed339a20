"""Host tier benchmark: hits by tier for upstream's write-back (SGLang+: LRU on both
tiers) and Marconi (tuned device eviction, demote-or-drop by FLOPs saved per byte with recency)
on the Mooncake conversation trace and the synthetic kinds, a few device / host capacity pairs.

    python scripts/bench_host_tier.py [--out out/host] [--quick] [--only mooncake,synthetic:lmsys,...]
        [--plot docs/host_tier.png]

Per device capacity, host capacities 0 (no host tier), 2x (SGLang's default --hicache-ratio) and 6x
(a fleet's ratio) the device's. Per cell: SGLang+ and Marconi's token hit
rate split into device and host hits, the ablation "Marconi's device eviction with upstream's
write-back rule" (what the tier rule alone is worth), states lost (dropped at a device eviction
or evicted by the host), GB loaded back and the MODELED p95 TTFT with load backs (A100-80GB).
Prints markdown tables; writes JSON and a PNG.

    python scripts/bench_host_tier.py --grid [--jobs 2] [--out out/host]

The Mooncake grid: profiles paper-7b and nemotron-h-8b, device 50 / 100 / 200 GB, host 2x / 5x /
10x the device; per cell the token hit % of LRU write-back (SGLang+: LRU device,
`UpstreamWriteBack`, LRU host), Marconi's tier rule (`MarconiTiering`: demote or drop, the host
ranked by recency + FLOPs saved per byte; device LRU, so the tier rule alone differs) and the
tier rule with the continuation signal (`MarconiTiering(depth="auto")`: the host ranked by
age / (1 + depth)^B, B fitted from the record; device `depth:auto`), each a fixed rule, so a
cell's difference is the rule's; and Marconi as it runs by default (`marconi`: the device tuned
over its choices, the depth-aware ones behind the tuner's guard, and the tier rule on the host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from sglang_marconi.policy.rules.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.rules.eviction.depth import CalibratedDepthEviction
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.policy.rules.tier_rules import MarconiTiering, UpstreamWriteBack
from sglang_marconi.sim.baselines.tiered_radix import TieredRadixPolicy
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import load_workload
from sglang_marconi.sim.tuning import shadow_config_for

MOONCAKE = Path(__file__).resolve().parents[1].parent / "shared/data/mooncake/conversation_trace.jsonl"
# device capacities (GB, paper-7b): the contended end of bench_policies' sweeps, where a host tier matters
DEVICE_GB = {
    "mooncake": (100, 500),
    "synthetic:swe-agent": (5, 10),
    "synthetic:lmsys": (2, 5),
    "synthetic:sharegpt": (1, 2),
    "synthetic:system-prompt": (0.2, 0.5),
}
HOST_RATIOS = (0, 2, 6)
ABLATION = "marconi/wb"  # Marconi's tuned device eviction, upstream's write-back rule
GRID_PROFILES = ("paper-7b", "nemotron-h-8b")
GRID_DEVICE_GB = (50, 100, 200)
GRID_HOST_RATIOS = (2, 5, 10)
GRID_POLICIES = ("lru-write-back", "tier-rule", "tier-rule+depth", "marconi")


def grid_policy(name: str, profile, cap: int, host: int, workload=None) -> TieredRadixPolicy:
    """One of `GRID_POLICIES` at device `cap` and host `host` bytes: fixed rules, no tuner, but for
    `marconi`, what `python -m sglang_marconi.sim` and the server run by default (the device tuned
    over its choices, the depth ones included, for `workload`; the tier rule on the host)."""
    if name == "lru-write-back":
        return TieredRadixPolicy(name, profile, cap, host, UpstreamWriteBack(), LruLeafEviction())
    if name == "tier-rule":
        return TieredRadixPolicy(name, profile, cap, host, MarconiTiering(1.0), FlopAwareEviction(0.0))
    if name == "tier-rule+depth":
        return TieredRadixPolicy(name, profile, cap, host, MarconiTiering(depth="auto"), CalibratedDepthEviction())
    if name == "marconi":
        tuning = shadow_config_for(workload, profile, cap, ShadowConfig(), None)
        return build_policy("marconi", profile, cap, tuning=tuning, host_capacity=host)
    raise ValueError(f"unknown grid policy {name!r}; choose from {', '.join(GRID_POLICIES)}")


def grid_cell(args) -> dict:
    profile_name, device_gb, ratio = args
    workload, profile = load("mooncake"), load_profile(profile_name)
    cap = int(device_gb * 1e9)
    host = cap * ratio
    hits = {}
    for name in GRID_POLICIES:
        run = replay(workload, grid_policy(name, profile, cap, host, workload), profile, cap, progress=False)
        hits[name] = figures(run)
    return {"profile": profile_name, "device_gb": device_gb, "host_gb": host / 1e9, "ratio": ratio, "runs": hits}


GRID_HEADER = ("| profile | device | host | LRU write-back hit% (device + host) | tier rule hit% | "
               "tier rule + depth hit% | Marconi (tuned device + tier rule) hit% | Δ tier rule | Δ + depth "
               "| Δ Marconi | Marconi's choices |\n|---|---|---|---|---|---|---|---|---|---|---|")


def grid_row(c) -> str:
    r = c["runs"]
    lru, tier, depth, tuned = (r[n] for n in GRID_POLICIES)
    pct = lambda f: f"{100 * f['hit']:.2f} ({100 * f['device_hit']:.2f} + {100 * f['host_hit']:.2f})"  # noqa: E731
    return (f"| {c['profile']} | {c['device_gb']:g} GB | {c['host_gb']:g} GB ({c['ratio']}x) | {pct(lru)} "
            f"| {pct(tier)} | {pct(depth)} | {pct(tuned)} | {100 * (tier['hit'] - lru['hit']):+.2f} "
            f"| {100 * (depth['hit'] - lru['hit']):+.2f} | {100 * (tuned['hit'] - lru['hit']):+.2f} "
            f"| {' > '.join(tuned['choices'])} |")


def run_grid(out: Path, jobs: int) -> int:
    from concurrent.futures import ProcessPoolExecutor

    if not MOONCAKE.exists():
        print(f"the grid needs the Mooncake trace: {MOONCAKE} not found", file=sys.stderr)
        return 2
    cells = [(p, gb, r) for p in GRID_PROFILES for gb in GRID_DEVICE_GB for r in GRID_HOST_RATIOS]
    print(f"machine: {machine()}, Python {platform.python_version()}; Mooncake grid, {len(cells)} cells, "
          f"{jobs} processes\n\n{GRID_HEADER}", flush=True)
    started = time.perf_counter()
    results = []
    with ProcessPoolExecutor(jobs) as pool:
        for c in pool.map(grid_cell, cells):  # in grid order, each row as soon as it and those before it are done
            results.append(c)
            print(grid_row(c), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_host_tier_grid.json").write_text(json.dumps(results, indent=1))
    return 0


def load(name):
    return load_workload(str(MOONCAKE)) if name == "mooncake" else load_workload(name)


def cell(workload, profile, device_gb: float, ratio: int) -> dict:
    cap = int(device_gb * 1e9)
    host = cap * ratio
    config = shadow_config_for(workload, profile, cap, ShadowConfig(), None)
    runs = {name: replay(workload, build_policy(name, profile, cap, tuning=config, host_capacity=host), profile, cap,
                         progress=False) for name in ("sglang+", "marconi")}
    if host:
        ablation = TieredRadixPolicy(ABLATION, profile, cap, host, UpstreamWriteBack(), FlopAwareEviction(0.0),
                                     tuning=config)
        runs[ABLATION] = replay(workload, ablation, profile, cap, progress=False)
    return {"device_gb": device_gb, "host_gb": host / 1e9, "ratio": ratio,
            "runs": {name: figures(r) for name, r in runs.items()}}


def figures(run) -> dict:
    t = run.tiers or {}
    host_hit = t.get("host_token_hit_rate", 0.0)
    return {"hit": run.token_hit_rate, "device_hit": run.token_hit_rate - host_hit, "host_hit": host_hit,
            "flops_saved": run.flops_saved_fraction, "ttft_p95_s": run.modeled_ttft_p95_s,
            "states_lost": t.get("states_dropped", 0) + t.get("states_evicted_host", 0),
            "states_dropped_at_demotion": t.get("states_dropped", 0), "gb_loaded": t.get("bytes_loaded", 0) / 1e9,
            "gb_demoted": t.get("bytes_demoted", 0) / 1e9, "requests_host_hit": t.get("requests_host_hit", 0),
            "choices": run.choices_used(), "wall_s": run.wall_seconds}


HEADER = ("| device | host | SGLang+ hit% (device + host) | Marconi hit% (device + host) | Δ pts | "
          "Marconi device + upstream write-back hit% | states lost S / M (at demotion) | GB loaded S / M | "
          "TTFT p95* S / M (s) | Marconi's choices |\n|---|---|---|---|---|---|---|---|---|---|")


def row(c) -> str:
    s, m = c["runs"]["sglang+"], c["runs"]["marconi"]
    split = lambda f: (f"{100 * f['hit']:.2f} ({100 * f['device_hit']:.2f} + {100 * f['host_hit']:.2f})"  # noqa: E731
                       if c["ratio"] else f"{100 * f['hit']:.2f}")
    ablation = c["runs"].get(ABLATION)
    ablation = f"{100 * ablation['hit']:.2f}" if ablation else "-"
    return (f"| {c['device_gb']:g} GB | {c['host_gb']:g} GB ({c['ratio']}x) | {split(s)} | {split(m)} "
            f"| {100 * (m['hit'] - s['hit']):+.2f} | {ablation} "
            f"| {s['states_lost']} ({s['states_dropped_at_demotion']}) / {m['states_lost']} "
            f"({m['states_dropped_at_demotion']}) | {s['gb_loaded']:.1f} / {m['gb_loaded']:.1f} "
            f"| {s['ttft_p95_s']:.3f} / {m['ttft_p95_s']:.3f} | {' > '.join(m['choices'])} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        cells = results[name]
        labels = [f"{c['device_gb']:g}\n+{c['ratio']}x" for c in cells]
        x = range(len(cells))
        for offset, policy, color in ((-0.2, "sglang+", "tab:blue"), (0.2, "marconi", "tab:orange")):
            device = [100 * c["runs"][policy]["device_hit"] for c in cells]
            host = [100 * c["runs"][policy]["host_hit"] for c in cells]
            xs = [i + offset for i in x]
            ax.bar(xs, device, 0.4, color=color, label=f"{policy}: device")
            ax.bar(xs, host, 0.4, bottom=device, color=color, alpha=0.45, hatch="//", label=f"{policy}: host")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("device GB + host ratio", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("token hit rate (%)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Hits by tier: SGLang+ (upstream write-back, LRU) vs Marconi (paper-7b)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def machine() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{os.cpu_count()} cores of {names[0] if names else platform.machine()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/host", type=Path)
    ap.add_argument("--quick", action="store_true", help="the first device capacity of each workload only")
    ap.add_argument("--only", help="comma list of workloads (" + ",".join(DEVICE_GB) + ")")
    ap.add_argument("--plot", type=Path, help="PNG path (default OUT/host_tier.png)")
    ap.add_argument("--grid", action="store_true", help="the Mooncake grid (see the module docstring)")
    ap.add_argument("--jobs", type=int, default=2, help="processes for --grid")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        print(f"--jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.grid:
        return run_grid(args.out, args.jobs)
    chosen = args.only.split(",") if args.only else list(DEVICE_GB)
    unknown = [n for n in chosen if n not in DEVICE_GB]
    if unknown:
        print(f"unknown workload {unknown[0]!r}; choose from {', '.join(DEVICE_GB)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    profile = load_profile("paper-7b")
    print(f"machine: {machine()}, Python {platform.python_version()}; "
          f"model paper-7b; TTFT MODELED on A100-80GB with load backs at 25 GB/s (sim/host_link.py)")
    results, started = {}, time.perf_counter()
    for name in chosen:
        if name == "mooncake" and not MOONCAKE.exists():
            print(f"\n(skipping mooncake: {MOONCAKE} not found)")
            continue
        workload = load(name)
        print(f"\n### {name} ({len(workload)} requests)\n\n{HEADER}")
        results[name] = []
        for gb in DEVICE_GB[name][:1] if args.quick else DEVICE_GB[name]:
            for ratio in HOST_RATIOS:
                c = cell(workload, profile, gb, ratio)
                results[name].append(c)
                print(row(c), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    (args.out / "bench_host_tier.json").write_text(json.dumps(results, indent=1))
    plot(results, args.plot or args.out / "host_tier.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

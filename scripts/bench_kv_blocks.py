"""KV-only block caches on the Mooncake conversation trace: token hit rate and replay time of
kv-lru, kv-lfu, kv-fifo and kv-s3fifo across capacities, libCacheSim's FIFO, ARC, SIEVE, S3FIFO
and Belady as reference rows, and the hybrid policies (vLLM+, SGLang+, Marconi) at the same bytes.
Prints markdown tables; writes JSON and a PNG of hit rate against capacity to --out.

    python scripts/bench_kv_blocks.py [--out out/bench_kv] [--quick] [--model paper-7b]
        [--capacities-gb 100,500,1000,2000] [--hybrid-tokens blocks|conversation] [--no-hybrid]

Capacities are bytes of the model profile: a 512-token block holds 512 * kv_bytes_per_token
bytes of KV (33.6 MB on paper-7b), so C bytes hold floor(C / that) blocks. The hybrid policies
spend the same bytes on KV and SSM states together. By default they replay the trace with
`--mooncake-tokens blocks` (requests share exactly the full blocks the hash ids share, as the KV
replay does); `conversation` rebuilds next turns instead (see docs/simulator.md). Marconi tunes alpha online
with the CLI's automatic session sample rate.

libcachesim (GPL-3.0-or-later, test-only) is imported here only; without it its rows are
skipped with a note. Belady is the offline optimum of block misses over the access sequence (every
block of every request), a reference, not an optimum of prefix hits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.sim.kv_blocks.registry import build_block_cache
from sglang_marconi.sim.kv_blocks.replay import replay_blocks
from sglang_marconi.sim.kv_blocks.view import block_trace
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import load_trace
from sglang_marconi.sim.tuning import shadow_config_for
from sglang_marconi.sim.units import format_bytes

MOONCAKE = Path(__file__).resolve().parents[1].parent / "shared/data/mooncake/conversation_trace.jsonl"
KV_POLICIES = ("kv-lru", "kv-lfu", "kv-fifo", "kv-s3fifo")
LCS_POLICIES = {"FIFO": "FIFO", "ARC": "ARC", "SIEVE": "Sieve", "S3FIFO": "S3FIFO", "Belady": "Belady"}
HYBRID_POLICIES = ("vllm+", "sglang+", "marconi")
NEVER = 2**63 - 1  # libCacheSim's "no next access"


def lcs_replay(lcs, cls_name: str, capacity: int, requests, block: int) -> tuple[int, float]:
    """Total hit tokens of `requests` through libCacheSim's `cls_name` (prefix semantics: leading
    blocks `find` without update, then `get` every block), and the wall seconds."""
    cache = getattr(lcs, cls_name)(cache_size=capacity)
    belady = cls_name == "Belady"
    if belady:  # next access (in the get sequence) of each get
        seq = [h for ids, _ in requests for h in ids]
        nxt, last = [NEVER] * len(seq), {}
        for i in range(len(seq) - 1, -1, -1):
            nxt[i] = last.get(seq[i], NEVER)
            last[seq[i]] = i
    req = lcs.Request()
    req.obj_size = 1
    find, get, hit_tokens, at = cache.find, cache.get, 0, 0
    started = time.perf_counter()
    for ids, length in requests:
        k = 0
        for h in ids:
            req.obj_id = h
            if find(req, False) is None:
                break
            k += 1
        hit_tokens += min(k * block, length)
        for h in ids:
            req.obj_id = h
            if belady:
                req.next_access_vtime = nxt[at]
                at += 1
            get(req)
    return hit_tokens, time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/bench_kv")
    p.add_argument("--trace", default=str(MOONCAKE))
    p.add_argument("--model", default="paper-7b")
    p.add_argument("--capacities-gb", default="100,500,1000,2000")
    p.add_argument("--hybrid-tokens", default="blocks", choices=("blocks", "conversation"))
    p.add_argument("--no-hybrid", action="store_true", help="skip the hybrid policies (the slow part)")
    p.add_argument("--quick", action="store_true", help="every other capacity")
    args = p.parse_args(argv)
    if not Path(args.trace).exists():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.model)
    workload = load_trace(args.trace, args.hybrid_tokens)
    trace = block_trace(workload, 512)
    block = trace.block_size
    block_bytes = profile.kv_bytes_per_token * block
    gbs = [float(x) for x in args.capacities_gb.split(",")]
    gbs = gbs[::2] if args.quick else gbs
    caps = [(gb, int(gb * 1e9) // block_bytes) for gb in gbs]
    accesses = sum(len(ids) for ids, _ in trace.requests)
    distinct = len({h for ids, _ in trace.requests for h in ids})
    prompt = sum(n for _, n in trace.requests)

    rows = []  # {policy, source, capacity_gb, capacity_blocks, token_hit_rate, wall_seconds}
    cells = [("ours", s) for s in KV_POLICIES] + [("libcachesim", s) for s in (LCS_POLICIES if lcs else ())]
    hybrid = () if args.no_hybrid else HYBRID_POLICIES
    bar = tqdm(total=(len(cells) + len(hybrid)) * len(caps) + 1, desc="bench kv blocks", unit="run")
    bound = replay_blocks(trace, build_block_cache("kv-lru", distinct), profile, progress=False)
    bar.update()
    for gb, blocks in caps:
        for source, name in cells:
            if source == "ours":
                run = replay_blocks(trace, build_block_cache(name, blocks), profile, progress=False)
                hit, wall = run.hit_tokens, run.wall_seconds
            else:
                hit, wall = lcs_replay(lcs, LCS_POLICIES[name], blocks, trace.requests, block)
            rows.append(dict(policy=name, source=source, capacity_gb=gb, capacity_blocks=blocks,
                             token_hit_rate=hit / prompt, wall_seconds=wall))
            bar.update()
        for name in hybrid:
            cap = int(gb * 1e9)
            tuning = shadow_config_for(workload, profile, cap, ShadowConfig(), None)
            run = replay(workload, build_policy(name, profile, cap, tuning=tuning), profile, cap, progress=False)
            rows.append(dict(policy=name, source=f"hybrid ({args.hybrid_tokens})", capacity_gb=gb,
                             capacity_blocks=None, token_hit_rate=run.token_hit_rate, wall_seconds=run.wall_seconds))
            bar.update()
    bar.close()

    def rate(policy, gb, source=None):
        return next(r["token_hit_rate"] for r in rows if r["policy"] == policy and r["capacity_gb"] == gb
                    and (source is None or r["source"] == source))

    print(f"\n### KV-only block caches: {trace.name} ({len(trace):,} requests, {prompt:,} prompt tokens, "
          f"{accesses:,} block accesses, {distinct:,} distinct {block}-token blocks; {profile.name}: "
          f"{format_bytes(block_bytes)} of KV per block)\n")
    print("| policy | " + " | ".join(f"{gb:g} GB ({b:,} blocks)" for gb, b in caps) + " | wall s per run (max) |")
    print("|---|" + "---|" * (len(caps) + 1))
    for source, name in cells:
        label = name if source == "ours" else f"libCacheSim {name}"
        mine = [r for r in rows if r["policy"] == name and r["source"] == source]
        print(f"| {label} | " + " | ".join(f"{100 * rate(name, gb, source):.2f}" for gb, _ in caps)
              + f" | {max(r['wall_seconds'] for r in mine):.2f} |")
    print(f"\nEvery block kept ({distinct:,} blocks, {format_bytes(distinct * block_bytes)}): "
          f"{100 * bound.token_hit_rate:.2f}% of prompt tokens hit.")
    if lcs is None:
        print("\n(libcachesim is not installed: its reference rows are skipped; pip install libcachesim==0.3.5)")

    if hybrid:
        print(f"\n### What SSM states cost: KV-only against hybrid policies at the same bytes ({profile.name}, "
              f"hybrids with `--mooncake-tokens {args.hybrid_tokens}`)\n")
        ref = ["kv-lru", "kv-s3fifo"] + (["Belady"] if lcs else [])
        print("| capacity | " + " | ".join(ref) + " | " + " | ".join(hybrid) + " | SGLang+ / kv-lru |")
        print("|---|" + "---|" * (len(ref) + len(hybrid) + 1))
        for gb, blocks in caps:
            kv = rate("kv-lru", gb)
            print(f"| {gb:g} GB ({blocks:,} blocks) | " + " | ".join(f"{100 * rate(n, gb):.2f}" for n in ref)
                  + " | " + " | ".join(f"{100 * rate(n, gb):.2f}" for n in hybrid)
                  + f" | {rate('sglang+', gb) / kv:.2f}x |")
    (out / "kv_blocks.json").write_text(json.dumps({"trace": trace.name, "model": profile.name, "block_size": block,
                                                    "block_bytes": block_bytes, "unbounded_hit_rate": bound.token_hit_rate,
                                                    "rows": rows}, indent=1))
    plot(rows, caps, out / "kv_blocks.png", f"{trace.name}: token hit rate, {profile.name}")
    print(f"\nwrote {out / 'kv_blocks.json'} and {out / 'kv_blocks.png'}")
    return 0


def plot(rows, caps, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, color in zip(dict.fromkeys((r["source"], r["policy"]) for r in rows), plt.cm.tab20.colors):
        mine = sorted((r for r in rows if (r["source"], r["policy"]) == key), key=lambda r: r["capacity_gb"])
        style = {"ours": "-", "libcachesim": ":"}.get(key[0], "--")
        label = key[1] if key[0] == "ours" else f"{key[1]} ({key[0]})"
        ax.plot([r["capacity_gb"] for r in mine], [100 * r["token_hit_rate"] for r in mine], style, marker="o",
                color=color, label=label)
    ax.set_xscale("log")
    ax.set_xticks([gb for gb, _ in caps], [f"{gb:g}" for gb, _ in caps])
    ax.set_xlabel("cache capacity (GB)")
    ax.set_ylabel("token hit rate (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

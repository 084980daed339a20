"""Upstream SGLang vs sglang-marconi through the real server, side by side.

Starts upstream (`python -m sglang.launch_server`: its default cache and tree core for the model)
and ours (`python -m sglang_marconi.launch_server`) with the same model and flags, one at a time,
in the order upstream, ours, upstream (the second upstream run measures run-to-run noise), and
drives each with the same workloads at a bounded concurrency, the cache flushed before each:

- `shared-prefix`: SGLang's `bench_serving --dataset-name generated-shared-prefix` (groups of
  requests sharing a long system prompt);
- `multi-turn`: the same generator with `--gsp-num-turns 3` (SGLang's multi-turn variant);
- `mooncake`: SGLang's `bench_serving --dataset-name mooncake --mooncake-workload conversation`
  over the local `../shared/data/mooncake/conversation_trace.jsonl` (never the network);
- `mooncake-turns`: the same trace with a conversation's next turn rebuilt as the simulator does
  (`MooncakeTrace.scaled`: each 512-token block mapped to `--mooncake-block-tokens` tokens), the
  previous turn's actual output in place of the trace's (`serving_load.replay_sessions`);
- `agent`: synthetic SWE-agent trajectories (`sim/synthetic.py`), replayed the same way.

Reports per workload and server: cached tokens and token hit rate (SGLang's own counters on
/metrics), TTFT p50/p95/p99 and throughput; a markdown table, `--out`/serving.json and
`--out`/serving.png. On this CPU the default model is a tiny random gated-delta hybrid served by
SGLang's CPU engine (`tests/server/`): its times are CPU/tiny-model times, only their ratios mean
anything. On a GPU host pass `--model-path` of a real hybrid model, `--device cuda`, and any SGLang
flags after `--`.

`--mamba-radix-cache-strategy` picks SGLang's Mamba radix-cache strategy for both servers:
`no_buffer` (the CPU default here: overlap scheduling off, which that mode requires) or
`extra_buffer` (SGLang's GPU default: overlap scheduling on; on CPU through the test-only
state-snapshot stand-in of `tests/cpu_engine/snapshot_platform.py`), or `auto` (SGLang resolves
it; on CPU with overlap scheduling on). On a GPU the default leaves SGLang's own choice.

    python scripts/bench_serving_compare.py [--quick] [--workloads shared-prefix,agent] [--out out/serving]
    python scripts/bench_serving_compare.py --quick --mamba-radix-cache-strategy extra_buffer --out out/serving-xbuf
    python scripts/bench_serving_compare.py --device cuda --model-path nvidia/NVIDIA-Nemotron-Nano-9B-v2 -- --tp 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
sys.path.insert(0, str(REPO / "tests" / "server"))  # the server harness and the tiny models

import live_server  # noqa: E402
from live_server import start_server  # noqa: E402
from serving_load import LoadResult, replay_sessions, run_bench_serving  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "mooncake", "mooncake-turns", "agent")
RUNS = (("upstream", "sglang"), ("marconi", "marconi"), ("upstream-2", "sglang"))  # (label, launcher)
# Bench pools on CPU: KV for long Mooncake prompts; few SSM slots, the scarce resource on real hybrids.
CPU_BENCH_FLAGS = ("--max-total-tokens", "32768", "--max-mamba-cache-size", "24")
STRATEGIES = ("auto", "no_buffer", "extra_buffer")
TINY_KINDS = ("gated-delta", "mamba2", "sliding-window")
# The sliding-window tiny model (32-token window): an SWA pool of 1/8 of the full one, so cached
# windows compete for it, and prefill chunks that keep a running request's window share small.
CPU_SWA_BENCH_FLAGS = ("--swa-full-tokens-ratio", "0.125", "--chunked-prefill-size", "512")


@contextlib.contextmanager
def cpu_strategy(strategy: str):
    """`live_server.CPU_FLAGS` (which start_server puts first on CPU) with this Mamba radix-cache
    strategy, and overlap scheduling left on unless it is no_buffer (which requires it off)."""
    saved = live_server.CPU_FLAGS
    flags = list(saved)
    flags[flags.index("--mamba-radix-cache-strategy") + 1] = strategy
    if strategy != "no_buffer":
        flags.remove("--disable-overlap-schedule")
    live_server.CPU_FLAGS = tuple(flags)
    try:
        yield
    finally:
        live_server.CPU_FLAGS = saved


def workload_sizes(quick: bool) -> dict:
    return dict(groups=2 if quick else 4, per_group=4 if quick else 8, mooncake_prompts=4 if quick else 12,
                mooncake_turns=80 if quick else 300, agents=3 if quick else 8)


def run_workload(name: str, url: str, model: str, args, sizes: dict, scratch: Path) -> LoadResult:
    c = args.max_concurrency
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(sizes["groups"]),
           "--gsp-prompts-per-group", str(sizes["per_group"]), "--gsp-system-prompt-len", "384",
           "--gsp-question-len", "48", "--gsp-output-len", "16"]
    n_gsp = sizes["groups"] * sizes["per_group"]
    if name == "shared-prefix":
        return run_bench_serving(url, model, gsp, n_gsp, c, scratch / f"{name}.jsonl")
    if name == "multi-turn":
        return run_bench_serving(url, model, [*gsp, "--gsp-num-turns", "3"], n_gsp, c, scratch / f"{name}.jsonl",
                                 backend="sglang-oai-chat")
    if name == "mooncake":
        dataset = ["--dataset-name", "mooncake", "--mooncake-workload", "conversation",
                   "--dataset-path", str(MOONCAKE)]
        return run_bench_serving(url, model, dataset, sizes["mooncake_prompts"], c, scratch / f"{name}.jsonl")
    if name == "mooncake-turns":
        from sglang_marconi.sim.traces import load_trace

        trace = list(load_trace(MOONCAKE).scaled(args.mooncake_block_tokens, sizes["mooncake_turns"]))
        return replay_sessions(url, trace, c, args.vocab_size, args.max_new_tokens)
    if name == "agent":
        from sglang_marconi.sim.synthetic import generate

        trace = list(generate("swe-agent", sessions=sizes["agents"], scale=0.1))
        return replay_sessions(url, trace, c, args.vocab_size, args.max_new_tokens)
    raise ValueError(name)


def flush(url: str) -> None:
    import requests

    requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=600).raise_for_status()


def format_tables(results: dict, hardware: str) -> str:
    """results[workload][run label] -> LoadResult."""
    lines = [f"Times: {hardware}.", "",
             "| workload | server | requests | prompt tokens | cached tokens | token hit % | TTFT p50 ms | TTFT p95 ms "
             "| TTFT p99 ms | output tok/s | req/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload, runs in results.items():
        for label, r in runs.items():
            t = r.ttft_ms
            lines.append(f"| {workload} | {label} | {r.requests} | {r.prompt_tokens:,} | {r.cached_tokens:,} "
                         f"| {100 * r.token_hit_rate:.1f} | {t['p50']:.0f} | {t['p95']:.0f} | {t['p99']:.0f} "
                         f"| {r.output_throughput:.1f} | {r.request_throughput:.2f} |")
    lines += ["", "| workload | hit rate ours − upstream (pts) | TTFT p95 ours / upstream | upstream run-to-run p95 "
              "spread | hit ≥ upstream | TTFT p95 within noise |", "|---|---|---|---|---|---|"]
    for workload, runs in results.items():
        s = summary(runs)
        if s is None:
            continue
        lines.append(f"| {workload} | {s['hit_delta_pts']:+.1f} | {s['ttft_p95_ratio']:.2f}x | ±{100 * s['noise']:.0f}% "
                     f"| {'yes' if s['hit_ok'] else 'NO'} | {'yes' if s['ttft_ok'] else 'NO'} |")
    return "\n".join(lines)


def summary(runs: dict) -> dict | None:
    """Ours against the upstream runs: hit rate vs the best upstream run; TTFT p95 vs their mean,
    allowed the upstream runs' own spread (|run1 - run2| / mean) as noise."""
    ours = runs.get("marconi")
    upstream = [r for label, r in runs.items() if label.startswith("upstream")]
    if ours is None or not upstream:
        return None
    p95 = [r.ttft_ms["p95"] for r in upstream]
    mean = sum(p95) / len(p95)
    noise = (max(p95) - min(p95)) / mean if mean else 0.0
    best_hit = max(r.token_hit_rate for r in upstream)
    ratio = ours.ttft_ms["p95"] / mean if mean else float("nan")
    return {"hit_delta_pts": 100 * (ours.token_hit_rate - best_hit), "ttft_p95_ratio": ratio, "noise": noise,
            "hit_ok": ours.token_hit_rate >= best_hit, "ttft_ok": ratio <= 1 + noise}


def plot(results: dict, path: Path, hardware: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(results)
    labels = [label for label, _ in RUNS]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(workloads))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        hit = [100 * results[w][label].token_hit_rate if label in results[w] else 0 for w in workloads]
        p95 = [results[w][label].ttft_ms["p95"] if label in results[w] else 0 for w in workloads]
        axes[0].bar(x + i * width, hit, width, label=label)
        axes[1].bar(x + i * width, p95, width, label=label)
    for ax, title in zip(axes, ("token hit rate (%)", "TTFT p95 (ms)")):
        ax.set_xticks(x + width * (len(labels) - 1) / 2, workloads, rotation=20)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"upstream SGLang vs sglang-marconi ({hardware})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to both servers unchanged.")
    p.add_argument("--model-path", help="model to serve (default on CPU: a tiny random gated-delta hybrid)")
    p.add_argument("--tiny-kind", default="gated-delta", choices=TINY_KINDS,
                   help="which tiny model when no --model-path is given (sliding-window: global + SWA "
                        "attention, SGLang's SWA cache component; its SWA pool is 1/8 of the full pool)")
    p.add_argument("--device", default="cpu", help="cpu (SGLang's CPU engine, tiny model) or cuda")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32, help="output cap for the session replays")
    p.add_argument("--mooncake-block-tokens", type=int, default=64, help="tokens per 512-token Mooncake block")
    p.add_argument("--quick", action="store_true", help="small workloads (~3 min on a 2-core CPU)")
    p.add_argument("--out", default="out/serving")
    p.add_argument("--ours-args", default="", help="flags for our server only, e.g. \"--marconi-alpha 1\" (A/B runs)")
    p.add_argument("--mamba-radix-cache-strategy", choices=STRATEGIES, default=None,
                   help="SGLang's Mamba radix-cache strategy for both servers (default: no_buffer on CPU, "
                        "SGLang's own elsewhere); extra_buffer and auto run with overlap scheduling")
    own, extra = _split(argv)
    args = p.parse_args(own)
    args.extra = extra
    if args.mamba_radix_cache_strategy is None and args.device == "cpu":
        args.mamba_radix_cache_strategy = "no_buffer"
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    if args.max_concurrency < 1:
        p.error(f"--max-concurrency {args.max_concurrency}: must be >= 1")
    if "mooncake" in args.workloads and not MOONCAKE.exists():
        p.error(f"the Mooncake workloads need {MOONCAKE}")
    return args


def _split(argv):
    """(our arguments, the SGLang flags after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    scratch = out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    if args.model_path:
        model = args.model_path
    else:
        from tiny_models import DIR_NAMES, write_tiny_model

        model = str(write_tiny_model(args.tiny_kind, out / "models" / DIR_NAMES[args.tiny_kind]))
    from transformers import AutoConfig

    args.vocab_size = min(AutoConfig.from_pretrained(model).vocab_size, 32000)
    strategy = args.mamba_radix_cache_strategy
    hardware = (f"CPU/tiny-model ({platform.processor() or platform.machine()}, SGLang CPU engine; only ratios "
                "mean anything)" if args.device == "cpu" else f"{args.device}, {model}")
    hardware += f"; Mamba radix cache {strategy or 'SGLang default'}"
    flags = CPU_BENCH_FLAGS if args.device == "cpu" else ()
    if args.device == "cpu" and not args.model_path and args.tiny_kind == "sliding-window":
        flags += CPU_SWA_BENCH_FLAGS
    flags = (*flags, *args.extra)
    if strategy is not None and args.device != "cpu":
        flags = ("--mamba-radix-cache-strategy", strategy, *flags)
    strategy_flags = (lambda: cpu_strategy(strategy)) if args.device == "cpu" else contextlib.nullcontext
    sizes = workload_sizes(args.quick)
    workloads = args.workloads.split(",")
    results: dict = {w: {} for w in workloads}
    for label, launcher in RUNS:
        t0 = time.perf_counter()
        ours = shlex.split(args.ours_args) if launcher == "marconi" else []
        with strategy_flags():
            server = start_server(model, launcher=launcher, extra_args=(*flags, *ours), device=args.device,
                                  log_path=scratch / f"{label}.log")
        print(f"{label}: ready in {time.perf_counter() - t0:.0f} s ({server.url})", flush=True)
        try:
            for w in workloads:
                flush(server.url)
                t0 = time.perf_counter()
                results[w][label] = r = run_workload(w, server.url, model, args, sizes, scratch)
                print(f"  {w}: {r.requests} requests, hit {100 * r.token_hit_rate:.1f}%, TTFT p95 "
                      f"{r.ttft_ms['p95']:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            server.stop()
    print(format_tables(results, hardware))
    report = {"hardware": hardware, "model": model, "flags": list(flags), "ours_args": args.ours_args,
              "mamba_radix_cache_strategy": strategy,
              "max_concurrency": args.max_concurrency,
              "sizes": sizes, "results": {w: {k: {**asdict(v), "token_hit_rate": v.token_hit_rate}
                                              for k, v in runs.items()} for w, runs in results.items()},
              "summary": {w: summary(runs) for w, runs in results.items()}}
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'serving.json'} and {plot(results, out / 'serving.png', hardware)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

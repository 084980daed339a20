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
- `agent`: synthetic SWE-agent trajectories (`sim/synthetic.py`), replayed the same way;
- `sharegpt`: synthetic ShareGPT-like short multi-turn chains (`sim/synthetic.py`), the same way.

Per workload at least 300 requests (`--quick`: a few dozen, a smoke test of the harness, not
evidence), at each pool size of `--kv-tokens` / `--mamba-slots` (lists, tight to ample) and each
strategy of `--mamba-radix-cache-strategy` (a list). Beside each measured cell of a replayed
workload (mooncake-turns, agent, sharegpt), the simulator's prediction for ours: the request
stream our server was sent (inputs and its actual outputs, in the order it finished them)
replayed through the simulator's model of the served cache on the same pools
(`--kv-tokens/--mamba-slots/--mamba-radix-cache-strategy/--chunked-prefill-size`). SGLang's
own generators (shared-prefix, multi-turn, mooncake) send text we do not record: no prediction.

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
    python scripts/bench_serving_compare.py --kv-tokens 4096,16384,65536 --mamba-slots 8,24,96 \
        --mamba-radix-cache-strategy no_buffer,extra_buffer --workloads sharegpt,agent
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

WORKLOADS = ("shared-prefix", "multi-turn", "mooncake", "mooncake-turns", "agent", "sharegpt")
REPLAYED = ("mooncake-turns", "agent", "sharegpt")  # token streams we send: the simulator can predict them
RUNS = (("upstream", "sglang"), ("marconi", "marconi"), ("upstream-2", "sglang"))  # (label, launcher)
# Bench pools on CPU, tight to ample: KV for long Mooncake prompts; few SSM slots, the scarce
# resource on real hybrids.
DEFAULT_KV_TOKENS = (8192, 32768, 131072)
DEFAULT_MAMBA_SLOTS = (12, 24, 96)
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
    """Per workload >= 300 requests (quick: a smoke test). agent: swe-agent trajectories at scale
    0.1 run about 40 requests each; sharegpt sessions 10-16 turns."""
    return dict(groups=2 if quick else 10, per_group=4 if quick else 30, mooncake_prompts=4 if quick else 300,
                mooncake_turns=80 if quick else 300, agents=3 if quick else 8, sharegpt_sessions=3 if quick else 25)


def run_workload(name: str, url: str, model: str, args, sizes: dict, scratch: Path,
                 sent_log: list | None = None) -> LoadResult:
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
        return replay_sessions(url, trace, c, args.vocab_size, args.max_new_tokens, sent_log=sent_log)
    if name in ("agent", "sharegpt"):
        from sglang_marconi.sim.synthetic import generate

        trace = list(generate("swe-agent", sessions=sizes["agents"], scale=0.1) if name == "agent"
                     else generate("sharegpt", sessions=sizes["sharegpt_sessions"]))
        return replay_sessions(url, trace, c, args.vocab_size, args.max_new_tokens, sent_log=sent_log)
    raise ValueError(name)


def predict(sent_log: list, model: str, pools: dict, strategy: str, chunk: int | None, scratch: Path) -> tuple:
    """(predicted token hit rate of ours, None) from the simulator's model of the served cache on
    the stream our server was sent, or (None, why not)."""
    if not sent_log:
        return None, "nothing recorded"
    try:
        from sglang_marconi.sim.cli import build_parser
        from sglang_marconi.sim.cli import run as run_sim
        from sglang_marconi.sim.traces import save_trace
        from sglang_marconi.sim.workload import ListWorkload, Request

        requests_ = [Request(session, i, float(i), ids, out) for i, (session, ids, out) in enumerate(sent_log)]
        path = save_trace(ListWorkload("served", requests_), scratch / "served-stream.jsonl")
        argv = ["--trace", str(path), "--model", model, "--kv-tokens", str(pools["kv_tokens"]), "--policies", "marconi",
                "--no-progress"]
        if pools.get("mamba_slots") is not None:
            argv += ["--mamba-slots", str(pools["mamba_slots"]), "--mamba-radix-cache-strategy", strategy]
        else:
            argv += ["--swa-tokens", str(pools["swa_tokens"])]
        if chunk:
            argv += ["--chunked-prefill-size", str(chunk)]
        (result,) = run_sim(build_parser().parse_args(argv))
        return result.token_hit_rate, None
    except (Exception, SystemExit) as exc:  # a prediction we cannot make is reported, never fatal
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:120]


def flush(url: str) -> None:
    import requests

    requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=600).raise_for_status()


def format_tables(results: dict, predictions: dict, hardware: str, quick: bool) -> str:
    """results[cell][workload][run label] -> LoadResult; a cell is (strategy, pool label);
    predictions[cell][workload] -> (hit rate, why not)."""
    lines = [f"Times: {hardware}."]
    if quick:
        lines.append("QUICK MODE: a smoke test of the harness (a few dozen requests per workload), not evidence.")
    lines += ["", "| strategy | pools | workload | server | requests | prompt tokens | cached tokens | token hit % "
              "| TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | output tok/s | req/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (strategy, pools), workloads in results.items():
        for workload, runs in workloads.items():
            for label, r in runs.items():
                t = r.ttft_ms
                lines.append(f"| {strategy} | {pools} | {workload} | {label} | {r.requests} | {r.prompt_tokens:,} "
                             f"| {r.cached_tokens:,} | {100 * r.token_hit_rate:.1f} | {t['p50']:.0f} | {t['p95']:.0f} "
                             f"| {t['p99']:.0f} | {r.output_throughput:.1f} | {r.request_throughput:.2f} |")
    lines += ["", "| strategy | pools | workload | upstream hit % | ours hit % | simulator predicts ours % "
              "| ours − upstream (pts) | TTFT p95 ours / upstream | upstream run-to-run p95 spread "
              "| hit ≥ upstream − 0.5 | TTFT p95 within noise |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, workloads in results.items():
        for workload, runs in workloads.items():
            s = summary(runs)
            if s is None:
                continue
            hit, why = predictions.get(cell, {}).get(workload, (None, "not replayed by us"))
            predicted = f"{100 * hit:.1f}" if hit is not None else f"- ({why})"
            lines.append(f"| {cell[0]} | {cell[1]} | {workload} | {100 * s['upstream_hit']:.1f} | {100 * s['ours_hit']:.1f} "
                         f"| {predicted} | {s['hit_delta_pts']:+.1f} | {s['ttft_p95_ratio']:.2f}x "
                         f"| ±{100 * s['noise']:.0f}% | {'yes' if s['hit_ok'] else 'NO'} "
                         f"| {'yes' if s['ttft_ok'] else 'NO'} |")
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
            "upstream_hit": best_hit, "ours_hit": ours.token_hit_rate,
            "hit_ok": ours.token_hit_rate >= best_hit - 0.005, "ttft_ok": ratio <= 1 + noise}


def plot(results: dict, path: Path, hardware: str) -> Path:
    """Hit rate and TTFT p95 per (strategy, pools, workload), one bar per server run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = [(cell, w) for cell, workloads in results.items() for w in workloads]
    labels = [label for label, _ in RUNS]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(keys) + 3), 8))
    x = np.arange(len(keys))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        runs = [results[cell][w].get(label) for cell, w in keys]
        axes[0].bar(x + i * width, [100 * r.token_hit_rate if r else 0 for r in runs], width, label=label)
        axes[1].bar(x + i * width, [r.ttft_ms["p95"] if r else 0 for r in runs], width, label=label)
    names = [f"{w}\n{cell[0]} {cell[1]}" for cell, w in keys]
    for ax, title in zip(axes, ("token hit rate (%)", "TTFT p95 (ms)")):
        ax.set_xticks(x + width * (len(labels) - 1) / 2, names, rotation=60, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"upstream SGLang vs sglang-marconi ({hardware})", fontsize=9)
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
    p.add_argument("--mamba-radix-cache-strategy", default=None,
                   help=f"comma list of {', '.join(STRATEGIES)}: SGLang's Mamba radix-cache strategy for both "
                        "servers (default: no_buffer on CPU, SGLang's own elsewhere); extra_buffer and auto run "
                        "with overlap scheduling")
    p.add_argument("--kv-tokens", default=",".join(map(str, DEFAULT_KV_TOKENS)),
                   help="comma list of KV pool sizes in tokens (--max-total-tokens), tight to ample")
    p.add_argument("--mamba-slots", default=",".join(map(str, DEFAULT_MAMBA_SLOTS)),
                   help="comma list of Mamba pool sizes in states (--max-mamba-cache-size), one per --kv-tokens; "
                        "ignored for the sliding-window model (its SWA pool is --swa-full-tokens-ratio of the KV)")
    own, extra = _split(argv)
    args = p.parse_args(own)
    args.extra = extra
    if args.mamba_radix_cache_strategy is None and args.device == "cpu":
        args.mamba_radix_cache_strategy = "no_buffer"
    args.strategies = (None,) if args.mamba_radix_cache_strategy is None else tuple(args.mamba_radix_cache_strategy.split(","))
    bad = [x for x in args.strategies if x not in STRATEGIES and x is not None]
    if bad:
        p.error(f"--mamba-radix-cache-strategy: unknown {', '.join(bad)}; choose from {', '.join(STRATEGIES)}")
    args.pools = list(zip(_counts(p, "--kv-tokens", args.kv_tokens), _counts(p, "--mamba-slots", args.mamba_slots)))
    if len(args.kv_tokens.split(",")) != len(args.mamba_slots.split(",")):
        p.error(f"--kv-tokens {args.kv_tokens} and --mamba-slots {args.mamba_slots}: one Mamba size per KV size")
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    if args.max_concurrency < 1:
        p.error(f"--max-concurrency {args.max_concurrency}: must be >= 1")
    if "mooncake" in args.workloads and not MOONCAKE.exists():
        p.error(f"the Mooncake workloads need {MOONCAKE}")
    return args


def _counts(p, flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag} {text}: not a comma list of integers")
    if any(v < 1 for v in values):
        p.error(f"{flag} {text}: sizes must be >= 1")
    return values


def _split(argv):
    """(our arguments, the SGLang flags after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def server_chunk(url: str) -> int | None:
    import requests

    info = requests.get(url + "/server_info", timeout=60).json()
    chunk = info.get("chunked_prefill_size")
    return int(chunk) if chunk and int(chunk) > 0 else None


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
    swa = args.device == "cpu" and not args.model_path and args.tiny_kind == "sliding-window"
    hardware = (f"CPU/tiny-model ({platform.processor() or platform.machine()}, SGLang CPU engine; only ratios "
                "mean anything)" if args.device == "cpu" else f"{args.device}, {model}")
    sizes = workload_sizes(args.quick)
    workloads = args.workloads.split(",")
    results: dict = {}
    predictions: dict = {}
    for strategy in args.strategies:
        strategy_flags = (lambda: cpu_strategy(strategy)) if args.device == "cpu" else contextlib.nullcontext
        for kv_tokens, mamba_slots in args.pools:
            flags = ("--max-total-tokens", str(kv_tokens))
            if swa:
                flags += CPU_SWA_BENCH_FLAGS
                ratio = float(CPU_SWA_BENCH_FLAGS[CPU_SWA_BENCH_FLAGS.index("--swa-full-tokens-ratio") + 1])
                pools = {"kv_tokens": kv_tokens, "swa_tokens": int(kv_tokens * ratio)}
                pool_label = f"kv {kv_tokens}, swa {pools['swa_tokens']}"
            else:
                flags += ("--max-mamba-cache-size", str(mamba_slots))
                pools = {"kv_tokens": kv_tokens, "mamba_slots": mamba_slots}
                pool_label = f"kv {kv_tokens}, mamba {mamba_slots}"
            flags = (*flags, *args.extra)
            if strategy is not None and args.device != "cpu":
                flags = ("--mamba-radix-cache-strategy", strategy, *flags)
            cell = (strategy or "SGLang default", pool_label)
            results[cell] = {w: {} for w in workloads}
            predictions[cell] = {}
            for label, launcher in RUNS:
                t0 = time.perf_counter()
                ours = shlex.split(args.ours_args) if launcher == "marconi" else []
                with strategy_flags():
                    server = start_server(model, launcher=launcher, extra_args=(*flags, *ours), device=args.device,
                                          log_path=scratch / f"{label}.log")
                print(f"[{cell[0]}; {pool_label}] {label}: ready in {time.perf_counter() - t0:.0f} s ({server.url})",
                      flush=True)
                try:
                    chunk = server_chunk(server.url)
                    for w in workloads:
                        flush(server.url)
                        t0 = time.perf_counter()
                        sent = [] if launcher == "marconi" and w in REPLAYED else None
                        results[cell][w][label] = r = run_workload(w, server.url, model, args, sizes, scratch, sent)
                        print(f"  {w}: {r.requests} requests, hit {100 * r.token_hit_rate:.1f}%, TTFT p95 "
                              f"{r.ttft_ms['p95']:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
                        if sent is not None:
                            predictions[cell][w] = predict(sent, model, pools, strategy or "no_buffer", chunk, scratch)
                finally:
                    server.stop()
    print(format_tables(results, predictions, hardware, args.quick))
    report = {"hardware": hardware, "model": model, "ours_args": args.ours_args, "quick": args.quick,
              "max_concurrency": args.max_concurrency, "sizes": sizes,
              "cells": [{"strategy": cell[0], "pools": cell[1], "workload": w,
                         "runs": {k: {**asdict(v), "token_hit_rate": v.token_hit_rate} for k, v in runs.items()},
                         "predicted_ours": predictions[cell].get(w, (None, None))[0],
                         "summary": summary(runs)}
                        for cell, workloads_ in results.items() for w, runs in workloads_.items()]}
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'serving.json'} and {plot(results, out / 'serving.png', hardware)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""smg's round_robin against cache_aware, live, over upstream and marconi workers.

For each launcher (`sglang`: upstream's cache; `marconi`: ours) it starts `--workers` servers once,
then for each gateway policy starts `smg launch` in front of them, flushes every worker's cache and
replays the workloads through the gateway; a `single` row replays the same workloads on one of the
workers alone (the hits one server gets, the reference the live test holds the gateway to). Sessions
run `--max-concurrency` at a time, each turn sent with the previous turn's actual reply in place of
the trace's (`serving_load`), so reuse is real.

Per row: token hit rate (the servers' `cached_tokens` over prompt tokens, as each response reports
them), hit tokens against the single server's, TTFT p50/p95 against round_robin's, and the largest
worker's share of prompt tokens (its /metrics): how evenly the gateway spread the work. On this CPU
the default model is a tiny random gated-delta hybrid on SGLang's CPU engine (`tests/server/`):
its times are CPU/tiny-model times, so only ratios are printed. On a GPU host pass `--device cuda
--model-path MODEL` (absolute TTFTs are printed too) and SGLang flags after `--`.

    python scripts/bench_cluster_live.py [--quick] [--workers 2] [--out out/cluster-live]
    python scripts/bench_cluster.py --live --quick        # the same (bench_cluster delegates here)
    python scripts/bench_cluster_live.py --device cuda --model-path nvidia/NVIDIA-Nemotron-Nano-9B-v2 -- --tp 1
    python scripts/bench_cluster_live.py --device cuda --model-path M --gpus-per-worker 0 -- --mem-fraction-static 0.4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # serving_load
sys.path.insert(0, str(REPO / "tests" / "server"))  # the cluster harness and the tiny models

from cluster_server import gateway_ready, spawn_gateway, spawn_worker, stop_all, wait_ready  # noqa: E402
from live_server import free_port  # noqa: E402
from serving_load import replay_samples, server_counters  # noqa: E402

LAUNCHERS = ("sglang", "marconi")
POLICIES = ("round_robin", "cache_aware")
WORKLOADS = ("lmsys", "system-prompt")  # multi-turn chat; many users sharing a system prompt
CPU_BENCH_FLAGS = ("--max-total-tokens", "16384", "--max-mamba-cache-size", "24")


def workload(kind: str, quick: bool):
    from sglang_marconi.sim.synthetic import generate

    sessions = {"lmsys": 3 if quick else 6, "system-prompt": 12 if quick else 32}[kind]
    return list(generate(kind, sessions=sessions, scale=0.1 if kind == "lmsys" else 0.5))


def flush(url: str) -> None:
    requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=600).raise_for_status()


def measure(url: str, workers: list[str], trace, args) -> dict:
    """Flush every worker, replay through url, and summarise (client-side hits and TTFT, worker shares)."""
    for w in workers:
        flush(w)
    before = [server_counters(w)["prompt_tokens"] for w in workers]
    samples = replay_samples(url, trace, args.max_concurrency, args.vocab_size, args.max_new_tokens)
    per_worker = [server_counters(w)["prompt_tokens"] - b for w, b in zip(workers, before)]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    ttft = 1000 * np.asarray([s.ttft_s for s in samples])
    return {"requests": len(samples), "prompt_tokens": prompt, "cached_tokens": cached,
            "token_hit_rate": cached / prompt if prompt else 0.0,
            "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p95": float(np.percentile(ttft, 95))},
            "worker_prompt_tokens": per_worker,
            "max_worker_share": max(per_worker) / sum(per_worker) if sum(per_worker) else float("nan")}


def run_launcher(launcher: str, model, traces: dict, args, logs: Path) -> dict:
    """Every workload under each gateway policy and on a single worker, over one set of workers."""
    flags = (*(CPU_BENCH_FLAGS if args.device == "cpu" else ()), *args.extra)
    threads = max(1, args.cpus // args.workers) if args.device == "cpu" else None
    def gpu(i):  # worker i's first GPU (SGLang's --base-gpu-id); 0 GPUs per worker: all share GPU 0
        return ("--base-gpu-id", str(i * args.gpus_per_worker)) if args.device == "cuda" else ()

    workers = [spawn_worker(model, free_port(), launcher=launcher, extra_args=(*gpu(i), *flags), device=args.device,
                            log_path=logs / f"{launcher}-worker{i}.log", threads=threads, hard_limit_s=7200)
               for i in range(args.workers)]
    results: dict = {w: {} for w in traces}
    try:
        t0 = time.perf_counter()
        wait_ready(workers, time.monotonic() + args.ready_timeout)
        print(f"{launcher}: {args.workers} workers ready in {time.perf_counter() - t0:.0f} s", flush=True)
        urls = [w.url for w in workers]
        for policy in args.policies:
            gateway = spawn_gateway(free_port(), urls, policy=policy, extra_args=args.gateway_args,
                                    log_path=logs / f"{launcher}-gateway-{policy}.log", hard_limit_s=7200)
            try:
                wait_ready([gateway], time.monotonic() + 60, lambda g: gateway_ready(g, len(urls)))
                for name, trace in traces.items():
                    results[name][policy] = r = measure(gateway.url, urls, trace, args)
                    print(f"  {name} via {policy}: hit {100 * r['token_hit_rate']:.1f}%, "
                          f"largest worker share {r['max_worker_share']:.2f}", flush=True)
            finally:
                stop_all([gateway])
        for name, trace in traces.items():  # one server alone: the first worker, asked directly
            results[name]["single"] = r = measure(urls[0], urls[:1], trace, args)
            print(f"  {name} on one server: hit {100 * r['token_hit_rate']:.1f}%", flush=True)
    finally:
        stop_all(workers)
    return results


def format_table(results: dict, hardware: str, absolute_times: bool) -> str:
    lines = [f"Live cluster ({hardware}): smg's policies over the same workers; hits against one server's,"
             " TTFT against round_robin's.", "",
             "| workload | workers' cache | gateway | token hit rate | hits / single server | TTFT p50 / RR | "
             "TTFT p95 / RR | largest worker share |" + (" TTFT p50 ms | TTFT p95 ms |" if absolute_times else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if absolute_times else "")]
    for launcher, by_workload in results.items():
        for name, rows in by_workload.items():
            single, rr = rows.get("single"), rows.get("round_robin")
            for policy, r in rows.items():
                has_hits = single and single["cached_tokens"]
                hits = f"{r['cached_tokens'] / single['cached_tokens']:.2f}" if has_hits else "-"
                ratio = (lambda q: f"{r['ttft_ms'][q] / rr['ttft_ms'][q]:.2f}") if rr and policy != "single" \
                    else (lambda q: "-")
                share = f"{r['max_worker_share']:.2f}" if policy != "single" else "-"
                cache = "upstream" if launcher == "sglang" else launcher
                row = (f"| {name} | {cache} | {policy} | {100 * r['token_hit_rate']:.1f}% | {hits} | "
                       f"{ratio('p50')} | {ratio('p95')} | {share} |")
                if absolute_times:
                    row += f" {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p95']:.0f} |"
                lines.append(row)
    return "\n".join(lines)


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma list of sglang (upstream), marconi")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of smg policies")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of synthetic kinds (sim/synthetic.py)")
    p.add_argument("--gateway-args", default="", help="more smg flags, one string (e.g. \"--cache-threshold 0.5\")")
    p.add_argument("--model-path", help="model to serve (default on CPU: a tiny random gated-delta hybrid)")
    p.add_argument("--device", default="cpu", help="cpu (SGLang's CPU engine, tiny model) or cuda")
    p.add_argument("--gpus-per-worker", type=int, default=1,
                   help="with --device cuda: worker i starts at GPU i x this (0: all on GPU 0; then pass "
                        "SGLang's --mem-fraction-static after --)")
    p.add_argument("--max-concurrency", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--quick", action="store_true", help="small workloads")
    p.add_argument("--out", default="out/cluster-live")
    args = p.parse_args(argv)
    args.extra = extra
    args.gateway_args = args.gateway_args.split()
    args.launchers = args.launchers.split(",")
    args.policies = args.policies.split(",")
    from sglang_marconi.sim.synthetic import SYNTHETIC_KINDS

    for name, given, known in (("launcher", args.launchers, LAUNCHERS),
                               ("workload", args.workloads.split(","), SYNTHETIC_KINDS)):
        bad = [g for g in given if g not in known]
        if bad:
            p.error(f"unknown {name} {bad[0]!r}: expected one of {', '.join(known)}")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if args.device != "cpu" and not args.model_path:
        p.error(f"--device {args.device} needs --model-path (the tiny model runs on the CPU engine only)")
    return args


def main(argv=None) -> int:
    import os

    args = parse_args(argv)
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    args.cpus = len(os.sched_getaffinity(0))
    if args.model_path:
        model = args.model_path
    else:
        from tiny_models import DIR_NAMES, write_tiny_model

        model = str(write_tiny_model("gated-delta", out / "models" / DIR_NAMES["gated-delta"]))
    from transformers import AutoConfig

    args.vocab_size = min(AutoConfig.from_pretrained(model).vocab_size, 32000)
    traces = {kind: workload(kind, args.quick) for kind in args.workloads.split(",")}
    hardware = (f"CPU/tiny-model ({platform.processor() or platform.machine()}, {args.cpus} cores shared by every "
                "server; only ratios mean anything)" if args.device == "cpu" else f"{args.device}, {model}")
    results = {launcher: run_launcher(launcher, model, traces, args, logs) for launcher in args.launchers}
    table = format_table(results, hardware, absolute_times=args.device != "cpu")
    print(table)
    (out / "cluster_live.json").write_text(json.dumps(
        {"hardware": hardware, "model": model, "workers": args.workers, "flags": args.extra,
         "gateway_args": args.gateway_args, "max_concurrency": args.max_concurrency, "quick": args.quick,
         "requests": {k: len(v) for k, v in traces.items()}, "results": results}, indent=1))
    (out / "cluster_live.md").write_text(table + "\n")
    print(f"wrote {out / 'cluster_live.json'} and {out / 'cluster_live.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

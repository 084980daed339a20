"""Load a live SGLang server and measure it: the parts `bench_serving_compare.py` runs.

- `run_bench_serving`: SGLang's own load generator (`python -m sglang.bench_serving`), for the
  workloads it has (generated shared prefix, single- and multi-turn; Mooncake).
- `replay_sessions`: what it lacks, request streams with sessions whose next turn repeats the
  previous turn (agent trajectories; the Mooncake trace with turns rebuilt as the simulator does).
  A session's turns run in order; a turn that continues an earlier one is sent with that turn's
  *actual* output in place of the trace's (a live model says something else), so reuse is real.
  Sessions run `concurrency` at a time, each request streamed to time its first token.
- `server_counters`: SGLang's own prompt and cached token counters from /metrics, read before and
  after a workload, give cached tokens and the token hit rate for any load generator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 900


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class LoadResult:
    """A workload's figures on one server (cached/prompt tokens: SGLang's counters)."""

    requests: int
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_ms: dict  # p50, p95, p99
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def server_counters(url: str) -> dict[str, float]:
    """SGLang's cumulative `prompt_tokens` and `cached_tokens` counters (all label sets summed)."""
    text = requests.get(url + "/metrics", timeout=60).text
    totals = {"prompt_tokens": 0.0, "cached_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in totals:
                if sample.name == f"sglang:{key}_total":
                    totals[key] += sample.value
    return totals


def percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    ms = 1000 * np.asarray(seconds)
    return {f"p{q}": float(np.percentile(ms, q)) for q in (50, 95, 99)}


# -- SGLang's own load generator ---------------------------------------------------------------

def run_bench_serving(url: str, model_path: str, dataset_args: list[str], num_prompts: int, concurrency: int,
                      out_file: Path, seed: int = 1, backend: str = "sglang") -> LoadResult:
    """`python -m sglang.bench_serving` against `url` (closed loop at `concurrency`); `backend`
    "sglang" is /generate, "sglang-oai-chat" the OpenAI chat API (its multi-turn mode needs it)."""
    out_file.unlink(missing_ok=True)
    before = server_counters(url)
    argv = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
            "--model", model_path, "--tokenizer", model_path, "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--warmup-requests", "0",
            "--seed", str(seed), "--output-file", str(out_file), *dataset_args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S * 4)
    if done.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"sglang.bench_serving failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    after = server_counters(url)
    return LoadResult(
        requests=int(result["completed"]), duration_s=float(result["duration"]),
        prompt_tokens=int(after["prompt_tokens"] - before["prompt_tokens"]),
        cached_tokens=int(after["cached_tokens"] - before["cached_tokens"]),
        output_tokens=int(result["total_output_tokens"]),
        ttft_ms={"p50": result["median_ttft_ms"], "p95": result["p95_ttft_ms"], "p99": result["p99_ttft_ms"]},
        request_throughput=float(result["request_throughput"]), output_throughput=float(result["output_throughput"]),
    )


# -- session replay (what SGLang's generators lack) --------------------------------------------

def to_vocab(tokens, vocab_size: int) -> list[int]:
    """Trace token ids -> ids of the served model (>= 2: clear of the usual special ids), by a
    fixed multiplicative hash: equal ids stay equal, different ones almost always differ."""
    t = np.asarray(tokens, dtype=np.uint64)
    return ((t * np.uint64(2654435761)) % np.uint64(2**32) % np.uint64(vocab_size - 2) + np.uint64(2)).tolist()


def stream_generate(url: str, input_ids: list[int], max_new_tokens: int) -> tuple[Sample, list[int]]:
    """One greedy streamed /generate; (the sample, the output ids)."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    started = time.perf_counter()
    first, last = None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("output_ids"):
                first = time.perf_counter()
            last = chunk
    end = time.perf_counter()
    meta = last["meta_info"]
    sample = Sample(ttft_s=(first or end) - started, latency_s=end - started, prompt_tokens=meta["prompt_tokens"],
                    cached_tokens=meta["cached_tokens"], output_tokens=meta["completion_tokens"])
    return sample, list(last["output_ids"])


def _continuation(prev, request) -> int:
    """How many leading tokens of `request`'s input are the earlier request `prev`'s input and
    output (the trace's next turn), or 0."""
    n_in, n_out = prev.input_len, prev.output_len
    if request.input_len < n_in + n_out or not n_in:
        return 0
    head = request.input_tokens[: n_in + n_out]
    if np.array_equal(head[:n_in], prev.input_tokens) and np.array_equal(head[n_in:], prev.output_tokens):
        return n_in + n_out
    return 0


def replay_samples(url: str, trace_requests, concurrency: int, vocab_size: int, max_new_tokens: int = 64,
                   progress: bool = False, sent_log: list | None = None) -> list[Sample]:
    """Replay `trace_requests` (sim `Request`s in arrival order), sessions `concurrency` at a time; a
    turn that continues an earlier one is sent as that turn's input and actual output plus its rest.
    One `Sample` per request; `sent_log` (if given) gets (session id, input ids, output ids) of
    each request in the order the server finished them (what a simulator replays as served)."""
    from tqdm import tqdm

    sessions: dict[str, list] = {}
    for r in trace_requests:
        sessions.setdefault(r.session_id, []).append(r)
    samples: list[Sample] = []
    lock = threading.Lock()
    bar = tqdm(total=len(trace_requests), desc="requests", unit="req", leave=False, disable=not progress,
               mininterval=2.0)

    def run_session(turns) -> None:
        sent: list[tuple[object, list[int], list[int]]] = []  # (trace request, input ids, output ids)
        for r in turns:
            ids = to_vocab(r.input_tokens, vocab_size)
            for prev, prev_in, prev_out in reversed(sent):  # the latest earlier turn it continues
                k = _continuation(prev, r)
                if k:
                    ids = prev_in + prev_out + ids[k:]
                    break
            sample, out = stream_generate(url, ids, max(1, min(r.output_len, max_new_tokens)))
            sent.append((r, ids, out))
            with lock:
                samples.append(sample)
                if sent_log is not None:
                    sent_log.append((r.session_id, ids, out))
                bar.update()

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(run_session, turns) for turns in sessions.values()]:
            future.result()
    bar.close()
    return samples


def replay_sessions(url: str, trace_requests, concurrency: int, vocab_size: int, max_new_tokens: int = 64,
                    progress: bool = True, sent_log: list | None = None) -> LoadResult:
    """Replay `trace_requests` (`replay_samples`) and summarise it with the server's counters."""
    before = server_counters(url)
    started = time.perf_counter()
    samples = replay_samples(url, trace_requests, concurrency, vocab_size, max_new_tokens, progress, sent_log)
    duration = time.perf_counter() - started
    after = server_counters(url)
    out_tokens = sum(s.output_tokens for s in samples)
    return LoadResult(
        requests=len(samples), duration_s=duration,
        prompt_tokens=int(after["prompt_tokens"] - before["prompt_tokens"]),
        cached_tokens=int(after["cached_tokens"] - before["cached_tokens"]),
        output_tokens=out_tokens, ttft_ms=percentiles_ms([s.ttft_s for s in samples]),
        request_throughput=len(samples) / duration, output_throughput=out_tokens / duration,
    )

"""Replay a request stream over N workers behind a router, one request at a time."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np

from sglang_marconi.sim.cluster.load_model import PrefillQueues
from sglang_marconi.sim.cluster.routers import Router, WorkerView
from sglang_marconi.sim.replay import Progress


@dataclass
class ClusterRun:
    router: str
    policy: str
    capacity_bytes: int  # per worker
    workers: int
    workload: str
    model: str
    gpu: str
    requests: int
    input_tokens: int
    hit_tokens: int
    token_hit_rate: float
    flops_total: float
    flops_saved: float
    flops_saved_fraction: float
    # hit tokens the router counted on (its match on the worker it chose) and the shortfall
    expected_tokens: int | None  # None: a router that expects nothing (round_robin, least_load, session)
    expected_missed_tokens: int | None
    requests_short: int | None  # requests that got fewer hit tokens than the router expected
    imbalance_cv: float  # coefficient of variation of prefill work (uncached FLOPs) over workers
    requests_per_worker: list[int]
    prefill_flops_per_worker: list[float]
    modeled_ttft_p50_s: float  # MODELED: queueing behind earlier prefills + own prefill
    modeled_ttft_p95_s: float
    wall_seconds: float
    per_request: dict[str, list] = field(default_factory=dict, repr=False)

    def to_json(self, with_requests: bool = False) -> dict:
        out = asdict(self)
        if not with_requests:
            out.pop("per_request")
        return out


def replay_cluster(stream: Iterable, total: int, workers: list, router: Router, profile, *, policy: str,
                   capacity_bytes: int, workload: str, gpu: str = "A100-80GB", progress: bool = True) -> ClusterRun:
    """Route each request of `stream` (objects with session_id, arrival_s, input_len; whatever
    the workers serve) to one of `workers` (`workers.TokenWorker` / `BlockWorker`) by `router`."""
    n = len(workers)
    queues = PrefillQueues(n, gpu)
    inputs = np.zeros(total, dtype=np.int64)
    hits = np.zeros(total, dtype=np.int64)
    chosen = np.zeros(total, dtype=np.int64)
    ttft = np.zeros(total)
    expected = missed = short = 0
    expects = False
    bar = Progress(total, f"{router.name} x{n} {policy} @ {capacity_bytes / 1e9:g} GB", progress)
    started = time.perf_counter()
    served = 0
    for i, request in enumerate(stream):
        if i >= total:
            break
        served = i + 1
        now, length = float(request.arrival_s), int(request.input_len)
        queues.advance(now)
        view = WorkerView(queues.in_flight(), queues.outstanding_s(now))
        if router.needs_matches:
            view.matches = [w.peek(request) for w in workers]
        w, believed = router.choose(request.session_id, length, view)
        hit = workers[w].serve(request)
        if believed is not None:
            expects = True
            expected += believed
            if believed > hit:
                missed += believed - hit
                short += 1
        flops_left = float(profile.prefill_flops(hit, length))
        ttft[i] = queues.submit(w, now, flops_left)
        inputs[i], hits[i], chosen[i] = length, hit, w
        bar.update()
    for worker in workers:
        worker.close()
    wall = time.perf_counter() - started
    total = served
    inputs, hits, chosen, ttft = inputs[:total], hits[:total], chosen[:total], ttft[:total]
    flops_total = float(profile.prefill_flops_array(np.zeros_like(inputs), inputs).sum())
    work = np.asarray(queues.prefill_flops)
    flops_saved = flops_total - float(work.sum())
    cv = float(work.std() / work.mean()) if work.mean() > 0 else 0.0
    run = ClusterRun(
        router=router.name, policy=policy, capacity_bytes=int(capacity_bytes), workers=n, workload=workload,
        model=profile.name, gpu=gpu, requests=int(total), input_tokens=int(inputs.sum()), hit_tokens=int(hits.sum()),
        token_hit_rate=float(hits.sum() / max(1, inputs.sum())), flops_total=flops_total, flops_saved=flops_saved,
        flops_saved_fraction=flops_saved / flops_total if flops_total else 0.0,
        expected_tokens=expected if expects else None, expected_missed_tokens=missed if expects else None,
        requests_short=short if expects else None, imbalance_cv=cv,
        requests_per_worker=list(queues.requests), prefill_flops_per_worker=[float(x) for x in work],
        modeled_ttft_p50_s=float(np.percentile(ttft, 50)) if total else 0.0,
        modeled_ttft_p95_s=float(np.percentile(ttft, 95)) if total else 0.0,
        wall_seconds=wall,
        per_request={"input_tokens": inputs.tolist(), "hit_tokens": hits.tolist(), "worker": chosen.tolist(),
                     "modeled_ttft_s": np.round(ttft, 6).tolist()},
    )
    bar.finish(run)
    return run

"""Replay a workload through one policy and measure what it saved."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from sglang_marconi.sim.host_link import modeled_load_seconds
from sglang_marconi.sim.policy_api import Policy, PolicyStats
from sglang_marconi.sim.ttft_model import modeled_ttft_seconds
from sglang_marconi.sim.units import format_bytes
from sglang_marconi.sim.workload import Workload

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, never a requirement
    tqdm = None


@dataclass
class RunResult:
    policy: str
    capacity_bytes: int
    workload: str
    model: str
    requests: int
    input_tokens: int
    hit_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    flops_total: float
    flops_saved: float
    flops_saved_fraction: float
    wall_seconds: float
    tuning_seconds: float
    alpha_history: list[tuple[int, float]]
    stats: PolicyStats
    gpu: str
    modeled_ttft_p50_s: float  # MODELED from prefill FLOPs, not measured
    modeled_ttft_p95_s: float
    per_request: dict[str, list] = field(default_factory=dict, repr=False)
    # KV-only block-cache runs (`kv_blocks`): capacity_blocks, block_size, total_hit_tokens,
    # total_prompt_tokens, overall_hit_rate, final_cache_blocks, evictions (top-level in the JSON)
    block_cache: dict | None = None
    # marconi-best: every candidate's token_hit_rate, flops_saved and wall_seconds, and the best
    candidates: dict | None = None
    best_choice: str | None = None
    # runs with a host tier (`--host-capacity`): host_capacity_bytes, hits by tier, bytes demoted /
    # loaded / dropped, ... (`tier_fields`; top-level in the JSON)
    tiers: dict | None = None

    def label(self) -> str:
        """The policy, and its host tier if it has one."""
        if not self.tiers:
            return self.policy
        return f"{self.policy} +host {format_bytes(self.tiers['host_capacity_bytes'])}"

    def choice_history(self) -> list[tuple[int, str]]:
        """(request index, choice) at each adoption: an alpha, 'lru' (SGLang's LRU, which
        `alpha_history` records as alpha 0, like FLOP-aware eviction at alpha 0) or 'seglen:W'
        (`alpha_history` records its weight W)."""
        labels = {"lru-leaves": lambda a: "lru", "seglen": lambda a: f"seglen:{a:g}", "depth": lambda a: f"depth:{a:g}",
                  "depth-auto": lambda a: "depth:auto"}
        return [(at, labels.get(name, lambda a: f"{a:g}")(alpha))
                for (at, alpha), (_, name) in zip(self.alpha_history, self.stats.eviction_history or [])]

    def choices_used(self) -> list[str]:
        """Eviction choices a run went through in order: an alpha, or 'lru' (SGLang's LRU)."""
        labels = []
        for _, label in self.choice_history():
            if not labels or labels[-1] != label:
                labels.append(label)
        return labels

    def to_json(self, with_requests: bool = False) -> dict:
        out = asdict(self)
        out["alpha_history"] = [list(x) for x in self.alpha_history]
        out["stats"]["alpha_history"] = out["alpha_history"]
        out["choice_history"] = [list(x) for x in self.choice_history()]
        if not with_requests:
            out.pop("per_request")
        for key in ("candidates", "best_choice"):
            if out[key] is None:
                out.pop(key)
        out.update(out.pop("block_cache") or {})
        out.update(out.pop("tiers") or {})
        return out


def replay(workload: Workload, policy: Policy, profile, capacity_bytes: int, *, gpu: str = "A100-80GB",
           progress: bool = True, limit: int | None = None) -> RunResult:
    total = len(workload) if limit is None else min(limit, len(workload))
    inputs = np.zeros(total, dtype=np.int64)
    hits = np.zeros(total, dtype=np.int64)
    overlaps = np.zeros(total, dtype=np.int64)
    states = np.zeros(total, dtype=np.int64)
    host_hits = np.zeros(total, dtype=np.int64)
    loaded = np.zeros(total, dtype=np.int64)
    bar = Progress(total, f"{policy.name} @ {capacity_bytes / 1e9:g} GB", progress)
    started = time.perf_counter()
    for i, request in enumerate(workload):
        if i >= total:
            break
        outcome = policy.serve(request)
        inputs[i], hits[i] = outcome.input_tokens, outcome.hit_tokens
        overlaps[i], states[i] = outcome.overlap_tokens, outcome.states_admitted
        host_hits[i], loaded[i] = outcome.host_hit_tokens, outcome.loaded_bytes
        bar.update()
    if hasattr(policy, "close"):
        policy.close()  # waits for a tuning replay still in flight
    wall = time.perf_counter() - started
    per_request = {"overlap_tokens": overlaps.tolist(), "states_admitted": states.tolist()}
    tiers = None
    if hasattr(policy, "tier_summary"):  # a host tier: hits by tier, and load backs cost modeled time
        tiers = tier_fields(policy.tier_summary(), inputs, hits, host_hits, loaded)
        per_request.update(host_hit_tokens=host_hits.tolist(), loaded_bytes=loaded.tolist())
    run = summarize(policy.name, workload.name, profile, capacity_bytes, inputs, hits, policy.stats(), wall, gpu,
                    per_request, load_bytes=None if tiers is None else loaded, tiers=tiers)
    bar.finish(run)
    return run


class Progress:
    """Progress of one run over `total` requests, on stderr: a tqdm bar where stderr is a terminal
    (and tqdm is installed), else one line when the run finishes (a log gets no carriage-return
    frames). Nothing at all when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool, stream=None):
        self.desc, self.stream = desc, stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._bar = None
        if enabled and tqdm is not None and _isatty(self.stream):
            self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, file=self.stream)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update()

    def finish(self, run: RunResult) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(f"{self.desc}: {run.requests} requests, token hit {100 * run.token_hit_rate:.2f}%, "
                  f"{run.wall_seconds:.2f} s", file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def tier_fields(summary: dict, inputs: np.ndarray, hits: np.ndarray, host_hits: np.ndarray,
                loaded: np.ndarray) -> dict:
    """A host-tier run's figures: the policy's `tier_summary()` and the hits by tier."""
    total_in = max(1, int(inputs.sum()))
    host = int(host_hits.sum())
    device = int(hits.sum()) - host
    return {**summary, "device_hit_tokens": device, "host_hit_tokens": host,
            "device_token_hit_rate": device / total_in, "host_token_hit_rate": host / total_in,
            "requests_host_hit": int((host_hits > 0).sum()), "loaded_bytes_total": int(loaded.sum())}


def summarize(policy: str, workload: str, profile, capacity_bytes: int, inputs: np.ndarray, hits: np.ndarray,
              stats: PolicyStats, wall: float, gpu: str, per_request: dict[str, list],
              block_cache: dict | None = None, load_bytes: np.ndarray | None = None,
              tiers: dict | None = None) -> RunResult:
    """A `RunResult` from per-request input and hit tokens: rates, FLOPs saved, MODELED TTFT (with
    `load_bytes`, each request's load back added at the assumed host link bandwidth)."""
    total = int(inputs.size)
    zeros = np.zeros(total, dtype=np.int64)
    flops_total_each = profile.prefill_flops_array(zeros, inputs)
    flops_left_each = profile.prefill_flops_array(hits, inputs)
    ttft = modeled_ttft_seconds(flops_left_each, gpu) if total else np.zeros(0)
    if load_bytes is not None and total:
        ttft = ttft + modeled_load_seconds(load_bytes, gpu)
    flops_total = float(flops_total_each.sum())
    flops_saved = flops_total - float(flops_left_each.sum())
    return RunResult(
        policy=policy,
        capacity_bytes=int(capacity_bytes),
        workload=workload,
        model=profile.name,
        requests=total,
        input_tokens=int(inputs.sum()),
        hit_tokens=int(hits.sum()),
        token_hit_rate=float(hits.sum() / max(1, inputs.sum())),
        request_hit_rate=float((hits > 0).mean()) if total else 0.0,
        flops_total=flops_total,
        flops_saved=flops_saved,
        flops_saved_fraction=flops_saved / flops_total if flops_total else 0.0,
        wall_seconds=wall,
        tuning_seconds=stats.tuning_seconds,
        alpha_history=stats.alpha_history,
        stats=stats,
        gpu=gpu,
        modeled_ttft_p50_s=float(np.percentile(ttft, 50)) if total else 0.0,
        modeled_ttft_p95_s=float(np.percentile(ttft, 95)) if total else 0.0,
        per_request={
            "input_tokens": inputs.tolist(),
            "hit_tokens": hits.tolist(),
            **per_request,
            "modeled_ttft_s": np.round(ttft, 6).tolist(),
        },
        block_cache=block_cache,
        tiers=tiers,
    )

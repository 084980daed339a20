"""The configurations the planner replays, run through the simulator's own policies and replay
loop (`sim.policies.build_policy`, `sim.replay.replay`), and the best of them.

A configuration of the served pools splits `--memory` bytes between SGLang's KV pool (token slots
of `profile.kv_bytes_per_token`) and its Mamba pool (slots of `profile.ssm_state_bytes`), under one
Mamba strategy, evicting by SGLang's LRU (the simulator's `sglang+`: the `marconi` backend's `lru`
choice, Marconi's admission) or by tuned Marconi (`marconi`, tuned online as the server tunes it).
The served-pools model has no host tier, so the host-tier comparison runs the byte-budget tiered
simulator (`sim/baselines/tiered_radix.py`) on one budget of `--memory` bytes, with and without
the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tree.served_cache import EXTRA_BUFFER, NO_BUFFER, ServedPools
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import RunResult, replay
from sglang_marconi.sim.tuning import shadow_config_for
from sglang_marconi.sim.units import format_bytes
from sglang_marconi.sim.workload import Workload

# The Mamba pool's share of --memory, from state-heavy to KV-heavy.
DEFAULT_MAMBA_SHARES = (0.7, 0.5, 0.35, 0.2, 0.1, 0.05)
STRATEGIES = (NO_BUFFER, EXTRA_BUFFER)
# planner name -> simulator policy name
POLICIES = {"lru": "sglang+", "marconi": "marconi"}
# Below this relative lead in FLOPs saved, two configurations count as equal.
GAIN_THRESHOLD = 0.01
# Below this infinite-cache token hit rate a trace has too little reuse for any cache to matter.
LITTLE_REUSE = 0.05


@dataclass(frozen=True)
class Config:
    """One configuration: `model` "served" (the two pools) or "tiered" (one byte budget, host tier)."""

    model: str
    policy: str  # "lru" or "marconi"
    mamba_share: float | None = None  # served: the Mamba pool's share of --memory
    kv_tokens: int | None = None
    mamba_slots: int | None = None
    strategy: str | None = None
    device_bytes: int = 0  # tiered: the one byte budget
    host_bytes: int = 0  # tiered: the host tier (0: none)

    def label(self) -> str:
        if self.model == "served":
            return f"Mamba {100 * self.mamba_share:g}% / KV {100 * (1 - self.mamba_share):g}%, {self.strategy}"
        host = f"+ host {format_bytes(self.host_bytes)}" if self.host_bytes else "no host"
        return f"byte budget {format_bytes(self.device_bytes)}, {host}"

    def pools(self, chunk_size: int | None) -> ServedPools:
        return ServedPools(self.kv_tokens, self.mamba_slots, self.strategy, chunk_size)


@dataclass
class Row:
    config: Config
    run: RunResult

    def key(self) -> tuple:
        """What ranks configurations: FLOPs saved, then token hit rate, then the lower modeled TTFT."""
        r = self.run
        return (r.flops_saved_fraction, r.token_hit_rate, -r.modeled_ttft_p95_s)

    def to_json(self) -> dict:
        c, r = self.config, self.run
        out = {"label": c.label(), "model": c.model, "policy": c.policy, "simulator_policy": POLICIES[c.policy],
               "mamba_share": c.mamba_share, "kv_tokens": c.kv_tokens, "mamba_slots": c.mamba_slots,
               "strategy": c.strategy, "device_bytes": c.device_bytes or None, "host_bytes": c.host_bytes,
               "requests": r.requests, "input_tokens": r.input_tokens, "hit_tokens": r.hit_tokens,
               "token_hit_rate": r.token_hit_rate, "request_hit_rate": r.request_hit_rate,
               "flops_saved": r.flops_saved, "flops_saved_fraction": r.flops_saved_fraction,
               "modeled_ttft_p50_s": r.modeled_ttft_p50_s, "modeled_ttft_p95_s": r.modeled_ttft_p95_s,
               "choices_used": r.choices_used() if c.policy == "marconi" else []}
        return out


@dataclass
class Plan:
    rows: list[Row]
    infinite: RunResult
    skipped: list[str] = field(default_factory=list)  # splits too small for one request, and why

    def served(self, policy: str | None = None) -> list[Row]:
        return [r for r in self.rows if r.config.model == "served" and policy in (None, r.config.policy)]

    def tiered(self, policy: str | None = None) -> list[Row]:
        return [r for r in self.rows if r.config.model == "tiered" and policy in (None, r.config.policy)]

    def best(self, policy: str | None = None) -> Row:
        """The best served configuration (of `policy`); the first listed wins a tie."""
        return max(self.served(policy), key=Row.key)

    def host_tier_wins(self) -> bool:
        """Whether the byte-budget model gains from the host tier under the best row's policy."""
        policy = self.best().config.policy
        rows = {r.config.host_bytes > 0: r for r in self.tiered(policy)}
        if True not in rows or False not in rows:
            return False
        return gains(rows[True].run, rows[False].run)


def gains(run: RunResult, base: RunResult) -> bool:
    """`run` saves more than GAIN_THRESHOLD (relative) more prefill FLOPs than `base`."""
    return run.flops_saved > base.flops_saved * (1 + GAIN_THRESHOLD) and run.flops_saved > 0


def max_request_tokens(workload, limit: int | None) -> int:
    """The most KV one replayed request holds at once: its input and output."""
    if type(workload).request_lengths is Workload.request_lengths:  # no cheap version: rebuild the first `limit`
        lengths = [r.input_len + r.output_len for r in itertools.islice(workload, limit)]
        return max(lengths, default=0)
    lengths = workload.request_lengths()[:limit]
    return int(lengths.sum(axis=1).max()) if len(lengths) else 0


def served_configs(profile, memory: int, shares, chunk_size: int | None,
                   longest: int) -> tuple[list[Config], list[str]]:
    """Every (split, strategy, policy) of `memory` bytes whose pools hold one request; and a line
    for each split left out."""
    configs, skipped = [], []
    for share in shares:
        kv_tokens = int((1 - share) * memory // profile.kv_bytes_per_token)
        slots = int(share * memory // profile.ssm_state_bytes)
        for strategy in STRATEGIES:
            config = Config("served", "lru", share, kv_tokens, slots, strategy)
            try:
                config.pools(chunk_size)
            except MarconiError as exc:
                skipped.append(f"{config.label()}: {exc}")
                continue
            if kv_tokens < longest:
                skipped.append(f"{config.label()}: {kv_tokens:,} KV tokens hold no request of {longest:,}")
                continue
            configs += [Config("served", p, share, kv_tokens, slots, strategy) for p in POLICIES]
    return configs, skipped


def tiered_configs(memory: int, host: int) -> list[Config]:
    return [Config("tiered", p, device_bytes=memory, host_bytes=h) for h in (0, host) for p in POLICIES]


def run_config(config: Config, workload, profile, *, limit: int | None, gpu: str, chunk_size: int | None,
               probation: bool, sync_every: int = 32, tuning: ShadowConfig | None = None,
               progress: bool = False) -> RunResult:
    """One configuration, replayed as `python -m sglang_marconi.sim` replays it (same policy, same
    tuning defaults)."""
    tuning = tuning or ShadowConfig()
    name = POLICIES[config.policy]
    if config.model == "served":
        policy = build_policy(name, profile, 0, served=config.pools(chunk_size), probation=probation,
                              sync_every=sync_every, tuning=tuning)
        capacity = config.kv_tokens * profile.kv_bytes_per_token + config.mamba_slots * profile.ssm_state_bytes
    else:
        capacity = config.device_bytes
        if name == "marconi":  # the sim's automatic shadow sample rate for a byte budget
            tuning = shadow_config_for(workload, profile, capacity, tuning, None)
        policy = build_policy(name, profile, capacity, tuning=tuning, host_capacity=config.host_bytes)
    return replay(workload, policy, profile, capacity, gpu=gpu, progress=progress, limit=limit)


def run_infinite(workload, profile, *, limit: int | None, gpu: str) -> RunResult:
    return replay(workload, build_policy("infinite", profile, 0), profile, 0, gpu=gpu, progress=False, limit=limit)


def same_hits(a: RunResult, b: RunResult) -> bool:
    return a.hit_tokens == b.hit_tokens and np.isclose(a.flops_saved, b.flops_saved, rtol=1e-12, atol=0)

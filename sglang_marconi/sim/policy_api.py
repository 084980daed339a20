"""The one interface every simulated caching policy implements.

The replay loop hands each request to `serve` in arrival order and reads back an
`Outcome`; everything a policy keeps (tree, blocks, alpha) stays behind this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from sglang_marconi.sim.workload import Request


@dataclass(frozen=True, slots=True)
class Outcome:
    """What serving one request reused and what it left in the cache."""

    input_tokens: int
    hit_tokens: int  # prefix whose prefill was skipped (KV and SSM state both cached)
    overlap_tokens: int = 0  # raw KV overlap with the cache, reusable or not
    states_admitted: int = 0  # SSM checkpoints this request added to the cache
    host_hit_tokens: int = 0  # of hit_tokens, those only the host tier could serve (loaded back)
    loaded_bytes: int = 0  # copied host -> device for this request's hit


@dataclass(slots=True)
class PolicyStats:
    """Cache contents and eviction counters, read after (or during) a replay."""

    kv_tokens_cached: int = 0
    ssm_states_cached: int = 0
    bytes_used: int = 0
    evictions_leaf: int = 0
    evictions_intermediate: int = 0
    admissions_skipped: int = 0  # requests (or states) not cached because they could not fit
    alpha_history: list[tuple[int, float]] = field(default_factory=list)  # (request index, alpha)
    eviction_history: list[tuple[int, str]] = field(default_factory=list)  # (request index, eviction policy)
    tuning_seconds: float = 0.0


class Policy(Protocol):
    name: str

    def serve(self, request: Request) -> Outcome: ...

    def stats(self) -> PolicyStats: ...

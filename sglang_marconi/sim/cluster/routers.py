"""Routers: which worker serves a request.

Every router sees the same per-worker figures at the request's arrival (`WorkerView`): in-flight
requests (smg's load: requests routed and not yet done, here not yet through prefill), outstanding
prefill seconds (MODELED, `load_model`), and, for the cache-aware routers, each worker's `Match`.

* `round_robin`: request i goes to worker i mod N.
* `least_load`: least outstanding prefill work (modeled seconds); ties to the lowest index.
* `session`: consistent hashing on the session id (a ring of `VNODES` points per worker, 64-bit
  blake2b; a session keeps its worker whatever the load), as smg's `consistent_hashing` policy
  routes on `X-SMG-Routing-Key`.
* `cache_aware`: smg's rule (below) on the full-KV match, what a router fed SGLang's KV events
  (full-KV blocks only) or its own approximate tree of routed prompts believes a worker holds.
* `cache_aware_state`: the same rule on the deepest reusable point (KV and an SSM state).

smg's cache_aware rule, with smg's defaults (overridable: `CacheAwareConfig`):
  cache_threshold = 0.3, balance_abs_threshold = 64, balance_rel_threshold = 1.5 (smg 1.13.0,
  `smg/router_args.py` in the wheel on PyPI, `RouterArgs`; the same in `smg launch --help`).
  1. match rate = best match / input tokens. If it is > cache_threshold (strictly, as
     `match_rate > self.config.cache_threshold` in smg's `model_gateway/src/policies/cache_aware.rs`),
     the request goes to the worker with the best match, else to the least-loaded worker
     (fewest in-flight requests; `min_by_key` there: ties to the lowest index).
  2. Spill gate (smg 1.13.0's `--balance-abs-threshold` / `--balance-rel-threshold` help): the
     matched worker is skipped for the least-loaded one when its load exceeds the fleet mean by
     the absolute margin AND exceeds rel_threshold x the mean; the margin is balance_abs_threshold
     capped at the in-flight count's natural swing at the current mean, "two standard deviations,
     never under four unless this value is lower": we read the swing of a Poisson count,
     margin = min(abs, max(4, 2 sqrt(mean))). (Older smg sources, e.g. lightseekorg/smg commit
     1cb0593's cache_aware.rs, gated on the whole pool instead: imbalanced when max - min > abs and
     max > rel x min, then every request went to the least loaded; 1.13.0 documents the per-worker
     gate above, which is what this implements.)
  Ties between workers with the same best match are not ordered by smg's documentation; here they
  go to the one with fewer in-flight requests, then the lowest index.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.cluster.workers import Match

ROUTER_NAMES = ("round_robin", "least_load", "session", "cache_aware", "cache_aware_state")
VNODES = 160  # ring points per worker: keeps the session router's shares within a few % of 1/N


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """smg's cache_aware parameters (defaults: smg 1.13.0's `RouterArgs`)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not (isinstance(self.cache_threshold, (int, float)) and 0.0 <= self.cache_threshold <= 1.0):
            raise MarconiError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold!r}")
        if isinstance(self.balance_abs_threshold, bool) or not isinstance(self.balance_abs_threshold, int) \
                or self.balance_abs_threshold < 0:
            raise MarconiError(f"--balance-abs-threshold must be an integer >= 0, got {self.balance_abs_threshold!r}")
        if not (isinstance(self.balance_rel_threshold, (int, float)) and math.isfinite(self.balance_rel_threshold)
                and self.balance_rel_threshold >= 1.0):
            raise MarconiError(f"--balance-rel-threshold must be finite and >= 1, got {self.balance_rel_threshold!r}")


@dataclass(slots=True)
class WorkerView:
    """What a router sees of the workers when a request arrives."""

    in_flight: list[int]
    outstanding_s: list[float]
    matches: list[Match] | None = None  # only for routers with `needs_matches`


class Router:
    name = ""
    needs_matches = False

    def choose(self, session_id: str, input_len: int, view: WorkerView) -> tuple[int, int | None]:
        """(worker index, hit tokens the router expects there; None: it expects nothing)."""
        raise NotImplementedError


def _least(values) -> int:
    """Index of the smallest value, ties to the lowest index."""
    return min(range(len(values)), key=values.__getitem__)


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, workers: int):
        self.workers, self.next = workers, 0

    def choose(self, session_id, input_len, view):
        i = self.next
        self.next = (i + 1) % self.workers
        return i, None


class LeastLoad(Router):
    name = "least_load"

    def choose(self, session_id, input_len, view):
        return _least(view.outstanding_s), None


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class SessionAffinity(Router):
    name = "session"

    def __init__(self, workers: int):
        ring = sorted((_hash64(f"worker-{w}#{v}"), w) for w in range(workers) for v in range(VNODES))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]
        self._memo: dict[str, int] = {}

    def worker_of(self, session_id: str) -> int:
        w = self._memo.get(session_id)
        if w is None:
            i = bisect.bisect_left(self._points, _hash64(session_id)) % len(self._points)
            w = self._memo[session_id] = self._owners[i]
        return w

    def choose(self, session_id, input_len, view):
        return self.worker_of(session_id), None


class CacheAware(Router):
    """smg's cache_aware rule (module docstring) on each worker's full-KV match, or with
    `state_aware` on its deepest reusable point."""

    needs_matches = True

    def __init__(self, config: CacheAwareConfig, state_aware: bool):
        self.config, self.state_aware = config, state_aware
        self.name = "cache_aware_state" if state_aware else "cache_aware"

    def score(self, m: Match) -> int:
        return m.reusable_tokens if self.state_aware else m.kv_tokens

    def overloaded(self, load: int, in_flight: list[int]) -> bool:
        mean = sum(in_flight) / len(in_flight)
        abs_t = self.config.balance_abs_threshold
        margin = min(abs_t, max(4.0, 2.0 * math.sqrt(mean)))
        return load > mean + margin and load > self.config.balance_rel_threshold * mean

    def choose(self, session_id, input_len, view):
        scores = [self.score(m) for m in view.matches]
        loads = view.in_flight
        best = max(scores)
        if input_len and best / input_len > self.config.cache_threshold:
            w = min((i for i, s in enumerate(scores) if s == best), key=lambda i: (loads[i], i))
            if not self.overloaded(loads[w], loads):
                return w, best
        w = _least(loads)
        return w, scores[w]


def parse_routers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise MarconiError(f"--routers {text!r} names no router; choose from {', '.join(ROUTER_NAMES)}")
    for n in names:
        if n not in ROUTER_NAMES:
            raise MarconiError(f"unknown router {n!r}; choose from {', '.join(ROUTER_NAMES)}")
    return names


def build_router(name: str, workers: int, config: CacheAwareConfig | None = None) -> Router:
    config = config or CacheAwareConfig()
    if name == "round_robin":
        return RoundRobin(workers)
    if name == "least_load":
        return LeastLoad()
    if name == "session":
        return SessionAffinity(workers)
    if name in ("cache_aware", "cache_aware_state"):
        return CacheAware(config, state_aware=name == "cache_aware_state")
    raise MarconiError(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")

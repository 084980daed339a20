"""Alpha tuning (paper §4.3), extended to re-tune every window.

alpha stays 0 (LRU) until the cache's first eviction. From then on requests are recorded in
windows of `bootstrap_multiplier x (requests seen before the first eviction)`; at the end of
each window the window is replayed from a snapshot of the cache taken at its start, once per
alpha of the grid, in worker processes, and the best alpha is adopted.

Beyond the paper, "alpha = 0 (LRU)" is SGLang's own LRU (leaves only, whole-path refresh: the
SGLang+ baseline): the cache starts with it, the replays include it, and it wins ties. Marconi
leaves LRU only for an alpha that did better on the window just seen, so where LRU is right (or
no window has completed yet) it behaves exactly like LRU.

With `sample_rate` < 1 the replays run over a hash-sampled subset of sessions against a shadow
cache of proportionally scaled capacity (spatial sampling, as in SHARDS), cutting tuning work
by that factor; the shadow follows the adopted alpha so its snapshots stay representative.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.eviction.flop_aware import check_alpha
from sglang_marconi.policy.hybrid_cache import CacheSnapshot, HybridPrefixCache
from sglang_marconi.policy.sampling import session_in_sample

log = logging.getLogger(__name__)

OBJECTIVES = ("flops", "token_hit_rate")
DEFAULT_ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(21))
LRU = "lru"  # the tuning choice that stands for SGLang's LRU (LruLeafEviction)


def parse_alpha_grid(text: str) -> tuple[float, ...]:
    """'0:2:0.1' (START:STOP:STEP, inclusive) or '0,0.5,1'; ValueError if it is neither."""
    if ":" in text:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise ValueError(f"alpha grid {text!r}: need STEP > 0 and STOP >= START")
        return tuple(round(start + i * step, 6) for i in range(int(round((stop - start) / step)) + 1))
    return tuple(float(x) for x in text.split(","))


@dataclass(frozen=True)
class TuningConfig:
    bootstrap_multiplier: float = 5.0
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    objective: str = "flops"
    retune: bool = True  # beyond the paper: re-tune every window so alpha follows drift
    lru_baseline: bool = True  # beyond the paper: SGLang's LRU is a choice too, and wins ties
    workers: int = 2
    sample_rate: float = 1.0
    timeout_s: float = 600.0

    def __post_init__(self):
        if not self.bootstrap_multiplier > 0:
            raise MarconiError(f"bootstrap_multiplier must be > 0, got {self.bootstrap_multiplier!r}")
        if not self.alpha_grid:
            raise MarconiError("alpha_grid is empty")
        grid = tuple(sorted({check_alpha(a) for a in self.alpha_grid} | {0.0}))
        object.__setattr__(self, "alpha_grid", grid)
        if self.objective not in OBJECTIVES:
            raise MarconiError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0 < self.sample_rate <= 1:
            raise MarconiError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise MarconiError(f"workers must be an integer >= 0 (0 replays in-process), got {self.workers!r}")


@dataclass(frozen=True, slots=True)
class WindowRequest:
    input_tokens: np.ndarray
    output_tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class AlphaScore:
    choice: float | str  # an alpha, or LRU
    flops_saved: float
    hit_tokens: int
    input_tokens: int

    @property
    def alpha(self) -> float:
        return 0.0 if self.choice == LRU else float(self.choice)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def eviction_for(choice: float | str) -> EvictionPolicy:
    return LruLeafEviction() if choice == LRU else FlopAwareEviction(choice)


def replay_window(profile, snapshot: CacheSnapshot, window: Sequence[WindowRequest], choices: Sequence[float | str]) -> list[AlphaScore]:
    """Replay `window` from `snapshot` once per choice (runs in a worker process)."""
    scores = []
    for choice in choices:
        cache = HybridPrefixCache.from_snapshot(profile, snapshot, eviction_for(choice))
        flops = 0.0
        hits = total = 0
        for req in window:
            lookup, _ = cache.serve(req.input_tokens, req.output_tokens)
            n = len(req.input_tokens)
            flops += profile.prefill_flops(0, lookup.hit_tokens) if lookup.hit_tokens else 0.0
            hits += lookup.hit_tokens
            total += n
        scores.append(AlphaScore(choice, flops, hits, total))
    return scores


def pick_choice(scores: Sequence[AlphaScore], objective: str) -> float | str:
    """Best choice by the objective. The baseline (LRU if replayed, else alpha 0) is kept unless
    another choice strictly beats it; among equals the smallest alpha wins."""
    key = (lambda s: s.flops_saved) if objective == "flops" else (lambda s: s.hit_tokens)
    baseline = next((s for s in scores if s.choice == LRU), None) or next(s for s in scores if s.choice == 0.0)
    best = max(scores, key=lambda s: (key(s), s is baseline, -s.alpha))
    return best.choice if key(best) > key(baseline) else baseline.choice


@dataclass(slots=True)
class _PendingTuning:
    parts: list[cf.Future]
    started: float
    at: int  # request index the window ended at


@dataclass
class TuningLog:
    history: list[tuple[int, float]] = field(default_factory=list)  # (request index, adopted alpha)
    choices: list[tuple[int, str]] = field(default_factory=list)  # (request index, "lru" or "marconi")
    windows: list[list[AlphaScore]] = field(default_factory=list)
    seconds: float = 0.0
    failures: int = 0


class AlphaTuner:
    """Drives alpha for one `HybridPrefixCache` whose eviction is `FlopAwareEviction`.

    Call `after_request(session_key, input, output)` once per served request. In blocking
    mode (the simulator) the grid replay finishes before the next request, so replays are
    deterministic; otherwise (a serving engine) the result is adopted when it is ready and the
    caller never waits."""

    def __init__(self, cache: HybridPrefixCache, config: TuningConfig = TuningConfig(), *, blocking: bool = True):
        if not isinstance(cache.eviction, FlopAwareEviction):
            raise MarconiError("alpha tuning starts from a cache with FlopAwareEviction (alpha 0 until the first eviction)")
        self.cache = cache
        self.config = config
        self.blocking = blocking
        if config.sample_rate < 1 and cache.capacity_bytes * config.sample_rate < 2 * cache.ssm_state_bytes:
            raise MarconiError(
                f"sample_rate={config.sample_rate} scales capacity {cache.capacity_bytes} below one request's two "
                f"SSM states ({2 * cache.ssm_state_bytes} bytes); raise the sample rate"
            )
        if config.lru_baseline:
            _adopt(cache, LRU)
        self.log = TuningLog(history=[(0, self.alpha)], choices=[(0, cache.eviction.name)])
        self.requests_seen = 0
        self.window_len = 0  # 0 until the first eviction
        self.window: list[WindowRequest] = []
        self.window_start = 0
        self.snapshot: CacheSnapshot | None = None
        self.shadow: HybridPrefixCache | None = None
        self._pending: _PendingTuning | None = None
        self._executor: cf.Executor | None = None
        self._evictions_seen = 0

    @property
    def alpha(self) -> float:
        return getattr(self.cache.eviction, "alpha", 0.0)

    @property
    def choices(self) -> tuple[float | str, ...]:
        return ((LRU,) if self.config.lru_baseline else ()) + self.config.alpha_grid

    def after_request(self, session_key: str, input_tokens: np.ndarray, output_tokens: np.ndarray) -> None:
        self.requests_seen += 1
        self._collect_result()
        sampled = session_in_sample(session_key, self.config.sample_rate)
        if sampled and self.config.sample_rate < 1:
            self._shadow().serve(input_tokens, output_tokens)
        if self.window_len == 0:
            if self._evictions() == 0:
                return
            self.window_len = max(1, round(self.config.bootstrap_multiplier * self.requests_seen))
            self._start_window()
            return
        if sampled:
            self.window.append(WindowRequest(input_tokens, output_tokens))
        if self.requests_seen - self.window_start >= self.window_len:
            self._finish_window()

    def _evictions(self) -> int:
        c = self.cache.counters
        return c.evictions_leaf + c.evictions_single_child

    def _shadow(self) -> HybridPrefixCache:
        # The sampled sessions' own cache, at capacity scaled by the sampling rate.
        if self.shadow is None:
            self.shadow = HybridPrefixCache(
                self.cache.profile, int(self.cache.capacity_bytes * self.config.sample_rate),
                eviction_for(LRU if isinstance(self.cache.eviction, LruLeafEviction) else self.alpha),
                checkpoint_grid=self.cache.checkpoint_grid, page_size=self.cache.tree.page_size,
            )
        return self.shadow

    def _start_window(self) -> None:
        self.window = []
        self.window_start = self.requests_seen
        source = self._shadow() if self.config.sample_rate < 1 else self.cache
        self.snapshot = source.snapshot()

    def _finish_window(self) -> None:
        window, snapshot = self.window, self.snapshot
        at = self.requests_seen
        if self.config.retune:
            self._start_window()
        else:
            self.window_len = 10**18  # tune once, as the paper does
        if not window or self._pending is not None:
            return
        self._pending = self._submit(snapshot, window, at)
        if self.blocking:
            self._collect_result(wait=True)

    def _submit(self, snapshot, window, at) -> _PendingTuning:
        started = time.perf_counter()
        grid = self.choices
        if self.config.workers == 0:
            done: cf.Future = cf.Future()
            done.set_result(replay_window(self.cache.profile, snapshot, window, grid))
            return _PendingTuning([done], started, at)
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(self.config.workers, mp_context=multiprocessing.get_context("spawn"))
        chunks = [grid[i :: self.config.workers] for i in range(self.config.workers)]
        parts = [self._executor.submit(replay_window, self.cache.profile, snapshot, window, c) for c in chunks if c]
        return _PendingTuning(parts, started, at)

    def _collect_result(self, wait: bool = False) -> None:
        pending = self._pending
        if pending is None:
            return
        elapsed = time.perf_counter() - pending.started
        if not wait and not all(p.done() for p in pending.parts) and elapsed < self.config.timeout_s:
            return
        self._pending = None
        try:
            deadline = max(0.0, self.config.timeout_s - elapsed)
            scores = [s for p in pending.parts for s in p.result(timeout=deadline)]
        except Exception as exc:  # a dead or stuck worker must not stop serving
            self.log.failures += 1
            log.warning("alpha tuning failed (%s: %s); keeping alpha=%s", type(exc).__name__, exc, self.alpha)
            self._reset_executor()
            return
        finally:
            self.log.seconds += time.perf_counter() - pending.started
        scores.sort(key=lambda s: (s.choice != LRU, s.alpha))
        self.log.windows.append(scores)
        choice = pick_choice(scores, self.config.objective)
        for cache in (self.cache, self.shadow):
            if cache is not None:
                _adopt(cache, choice)
        self.log.history.append((pending.at, self.alpha))
        self.log.choices.append((pending.at, self.cache.eviction.name))

    def _reset_executor(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def close(self) -> None:
        self._collect_result(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _adopt(cache: HybridPrefixCache, choice: float | str) -> None:
    if hasattr(cache, "apply_choice"):  # a cache that is not ours (the SGLang adapter)
        cache.apply_choice(choice)
        return
    if choice == LRU:
        if not isinstance(cache.eviction, LruLeafEviction):
            cache.set_eviction(LruLeafEviction())
    elif isinstance(cache.eviction, FlopAwareEviction):
        cache.eviction.alpha = float(choice)
    else:
        cache.set_eviction(FlopAwareEviction(float(choice)))

"""Continuous shadow tuning: which eviction choice the live cache should use, decided from one
shadow cache per candidate choice, all kept running on the same sample of sessions.

- Sampling (SHARDS-style): a session is in the sample when its hash falls below `sample_rate`
  (`policy/tuning/sampling.py`); the shadows see only sampled sessions, at capacity x `sample_rate`.
- One shared shadow until the first eviction: before any eviction every candidate holds exactly
  the same tree, so a single cache stands for all of them; it keeps both recency conventions
  (SGLang's LRU refreshes the whole matched path, Marconi only the node hit). Just before its
  first eviction it forks into one shadow per candidate, so a cache that never fills costs one
  shadow, not one per candidate.
- Candidates: SGLang's LRU, FLOP-aware eviction at each alpha of the grid (alpha = 0 is its own
  choice: LRU over Marconi's candidates, refreshing only the node hit), SegLen-style eviction
  at each of its weights (`eviction/seglen.py`), depth-aware eviction at each exponent and
  with the exponent learned (`eviction/depth.py`), and, over the model of SGLang's cache, SGLang
  #38000's coverage rule (`eviction/coverage.py`). Over the policy core's caches the depth
  choices read one record of finished sequences (`rules/continuation.py`) that the tuner feeds
  with every request it is given, after its caches served it; the live cache adopting one reads
  the same record (`adopt_choice`). Over the model of SGLang's cache (`served`) every cache keeps
  its own record from the first request it serves, fed with what its own last insert kept, as
  SGLang's cache feeds its own (`served_config`, `live_record_for`).
- Evidence (`Evidence`): per candidate, exponentially decayed sums of what its shadow saved on
  each sampled request (prefill FLOPs, `objective="flops"`, or hit tokens) over a long window
  (`half_life` sampled requests) and a short one (`guard_half_life`), from the fork on, beside
  the same sums of what the requests could save at most (`potential`: margins are points, as
  the targets are). A lead is judged with session-clustered standard errors (a block of 8
  requests of one session is one observation: one conversation one shadow keeps is not forty
  pieces of evidence) and must hold in both halves of the clusters (a salted hash).
- The rule (`_decide`, every `epoch` sampled requests): first the guard, then adoption.
  Guard: a current choice other than the safe one (LRU, the start) is abandoned as soon as LRU
  leads it (since the switch, over the short window or the long one; `guard_margin`,
  `guard_z`), or as soon as LRU's shadow leads the live cache's stand-in (`_LiveStandIn`: a
  cache that follows the live cache's choices, the live cache itself at rate 1; a live cache whose
  contents earlier choices shaped can trail the shadow that led it to its choice); each revert
  raises that choice's bar (margin x (1 + reverts)). Adoption: the
  leader (best long-window score; near-ties, within `tie`, to the value-first choices) replaces
  the current choice if it leads it (and LRU) by the margin and either significantly (`z`
  clustered standard errors over the long window, both halves, still ahead over the short
  one) or for long enough (its short-window lead in points summed over an unbroken run of
  sampled requests reaches `persist`); no second switch within `dwell` sampled requests.
- Decided at the first eviction, with a prior (`_Miniatures`): until the fork, miniature shadows
  at `prior_scale` x the capacity run beside the shared shadow; they fill first, so when the
  shadows fork (and no shadow hit yet tells the choices apart, while the first evictions already
  decide what the live cache will keep) their leader, if it leads LRU by the margin, is adopted
  at once. The guard takes it back if it turns out wrong.
- Evidence beyond the sample (`_Verifier`, sample rate < 1 with every request fed): sampled
  shadows only propose. A trial cache, forked from an LRU anchor, both fed a second, larger and
  independent sample (`verify_rate`, another salt: by default twice the shadows' rate, at least
  half the sessions, all of them from a rate of 0.5), must beat the anchor (after `half_life`
  requests of patience: value-first evictions started from a recency-shaped cache often gain at
  first and lose later) before the live cache adopts the proposal; the adopted trial, the live
  cache's stand-in, is guarded against the anchor. A caller that passes only sampled requests
  (the served runtime at rate < 1, and the simulator's model of it: `ServedTuning`) gets the
  sampled rule alone.

Cost: every cache the tuner runs (shared shadow, shadows, miniatures, the verifier's) is a
`ShadowCache` (`policy/tree/shadow_cache.py`): `HybridPrefixCache`'s admission and eviction step for
step, on edges that reference the requests' own tokens; a request's tokens are compared with each
earlier request once for all of them (`SharedMatch`). The guard's since-switch sums are kept for the
two arms it compares only (`GuardSums`), and not at all while the safe choice is current. The
live cache's stand-in is one cache more from the first switch on, until it holds what the current
choice's shadow holds (then it is dropped until the next switch).

The tuner never touches the live cache: `observe()` returns the new choice when it switches and
the caller adopts it (`adopt_choice` for the policy core's cache, the serving runtime for
SGLang's). Decisions depend only on the stream of (session, input, output), so the simulator
and the server make the same ones for the same stream. The served runtime's protocol is written
once here for both: what it feeds (`tuner_reads`, `ServedTuning.feed`) and at which release a
decision takes effect (`sync_point_of`, `record_adopted_at`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.continuation import ContinuationRecord
from sglang_marconi.policy.rules.eviction import (CalibratedDepthEviction, CoverageEviction, DepthEviction, EvictionPolicy,
                                                  FlopAwareEviction, LruLeafEviction, SegLenEviction)
from sglang_marconi.policy.rules.eviction.depth import check_exponent
from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha
from sglang_marconi.policy.tuning.evidence import LONG, SHORT, Evidence, GuardSums
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tree.radix_tree import as_token_array
from sglang_marconi.policy.tuning.sampling import check_rate, session_in_sample
from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools
from sglang_marconi.policy.tree.shadow_cache import FlopsTable, ShadowCache, ShadowNode
from sglang_marconi.policy.tree.shared_match import SharedMatch

LRU = "lru"  # the choice that stands for SGLang's LRU (leaves only, whole-path refresh)
COVERAGE = "coverage"  # SGLang #38000's rule (`policy/rules/eviction/coverage.py`): the served tuner's choice too
SEGLEN = "seglen"  # "seglen:W": SegLen-style eviction with weight W (`eviction/seglen.py`)
DEPTH = "depth"  # "depth:B": evict by age / (1 + depth)^B; "depth:auto": B learned (`eviction/depth.py`)
DEPTH_AUTO = f"{DEPTH}:auto"
OBJECTIVES = ("flops", "token_hit_rate")
_INT64 = np.dtype(np.int64)
Choice = float | str  # an alpha of FLOP-aware eviction, LRU, "seglen:W", "depth:B", DEPTH_AUTO or COVERAGE
# Large alphas matter: with both terms min-max normalized, alpha >> 1 ranks by FLOP efficiency
# first (recency breaks near-ties), which wins by 10-20 points on contended chat traces.
DEFAULT_ALPHA_GRID = (0.0, 1.0, 20.0, 100.0)
DEFAULT_SEGLEN_WEIGHTS = (1.0, 100.0)
DEFAULT_DEPTH_EXPONENTS = (1.0, 4.0)
# A depth choice's shadow may be pruned only after this many continuation horizons since the fork,
# or this many requests while the record has too few continuations to know its horizon.
DEPTH_PRUNE_HORIZONS = 2.0
DEPTH_PRUNE_WAIT = 1000


def parse_alpha_grid(text: str) -> tuple[float, ...]:
    """'0:2:0.1' (START:STOP:STEP, inclusive) or '0,0.5,1'; ValueError if it is neither."""
    if ":" in text:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise ValueError(f"alpha grid {text!r}: need STEP > 0 and STOP >= START")
        return tuple(round(start + i * step, 6) for i in range(int(round((stop - start) / step)) + 1))
    return tuple(float(x) for x in text.split(","))


def parse_seglen_weights(text: str) -> tuple[float, ...]:
    """'1,100' or 'none' (no SegLen candidates); ValueError if it is neither."""
    return () if text == "none" else tuple(float(x) for x in text.split(","))


def seglen_choice(weight: float) -> str:
    return f"{SEGLEN}:{check_alpha(weight):g}"


def depth_choice(exponent: float) -> str:
    return f"{DEPTH}:{check_exponent(exponent):g}"


def is_depth_choice(choice: Choice) -> bool:
    return isinstance(choice, str) and choice.partition(":")[0] == DEPTH


def choice_label(choice: Choice) -> str:
    return choice if isinstance(choice, str) else f"{float(choice):g}"


def eviction_for(choice: Choice, record: ContinuationRecord | None = None) -> EvictionPolicy:
    """The policy a choice stands for. `record`: a depth choice reads this record of finished
    sequences, fed by its owner (the tuner); without one it keeps and feeds its own."""
    if choice == LRU:
        return LruLeafEviction()
    if choice == COVERAGE:
        return CoverageEviction()
    if choice == DEPTH_AUTO:
        return CalibratedDepthEviction(record, shared_record=record is not None)
    if is_depth_choice(choice):
        return DepthEviction(float(choice.partition(":")[2]), record, shared_record=record is not None)
    if isinstance(choice, str):
        return SegLenEviction(float(choice.partition(":")[2]))
    return FlopAwareEviction(float(choice))


def adopt_choice(cache: HybridPrefixCache, choice: Choice, record: ContinuationRecord | None = None) -> None:
    """Switch a policy-core cache to `choice`; a change of weight alone keeps the policy object.
    `record`: the record a depth choice reads (the tuner's, which it feeds with the stream this
    cache serves); a depth policy already in force passes its own on."""
    current = cache.eviction
    if is_depth_choice(choice):
        if isinstance(current, DepthEviction):
            wanted = eviction_for(choice, current.record)
            wanted.feeds_record = current.feeds_record
        else:
            wanted = eviction_for(choice, record)
        cache.set_eviction(wanted)
        return
    wanted = eviction_for(choice)
    if type(current) is type(wanted) and not isinstance(wanted, LruLeafEviction):
        current.alpha = wanted.alpha  # same score columns: only the weight changes
    elif type(current) is not type(wanted):
        cache.set_eviction(wanted)


@dataclass(frozen=True)
class ShadowConfig:
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    seglen_weights: tuple[float, ...] = DEFAULT_SEGLEN_WEIGHTS  # SegLen-style candidates (may be empty)
    # Depth-aware candidates (`eviction/depth.py`): at each of these B, and the one that learns B.
    # Off unless asked for (`with_depth`; the simulator's tuned configuration asks, `sim/tuning.py`,
    # and a tuner over the model of SGLang's cache, `served_config`).
    depth_exponents: tuple[float, ...] = ()
    depth_auto: bool = False
    # SGLang #38000's rule (`eviction/coverage.py`) as a choice; None: the served tuner's choices carry
    # it (`served_config`: it keeps the shallow states fan-outs from long chains come back to), the
    # paper tree's do not (its tuner meets coverage there without it).
    coverage: bool | None = None
    lru: bool = True  # SGLang's LRU is a candidate too (and the starting choice: the safe one)
    objective: str = "flops"
    sample_rate: float = 1.0
    epoch: int = 4  # sampled requests between decisions
    half_life: float = 1000.0  # sampled requests: the long window adoptions are judged on
    margin: float = 0.005  # lead a choice needs to be adopted, as a share of what the requests could save at most
    z: float = 2.0  # and this many session-clustered standard errors
    tie: float = 0.01  # choices within this share (of the same) of the best score tie for the lead
    guard_half_life: float = 250.0  # sampled requests: the short window the guard watches
    guard_margin: float = 0.0025  # lead of the safe choice (LRU) that makes the guard revert to it
    guard_z: float = 1.0  # and this many session-clustered standard errors
    dwell: int = 100  # sampled requests after a switch before another one (the guard's reverts excepted)
    persist: float = 4000.0  # a lead held this long is adopted without z: its points x sampled requests, summed
    prior_scale: float = 0.5  # miniature shadows at this share of the capacity pick the choice adopted at the fork
    prune_after: int = 500  # sampled requests after the fork before a clearly beaten shadow may be dropped (0: never)
    prune_margin: float = 0.02  # how far behind the leader (share of potential, both windows, z errors) it must be
    revive_every: int = 4000  # sampled requests between revivals of dropped shadows (forked from the current one's)
    verify_rate: float | None = None  # sessions the verifier's caches see (salt 1); None: min(1, max(0.5, 2 x sample_rate))
    verify: bool = True  # at sample_rate < 1, adopt only what the verifier's larger sample confirms (`_Verifier`)
    live_guard: bool = True  # without a verifier, also guard the live cache's stand-in against the safe choice (`_LiveStandIn`)

    def __post_init__(self):
        if not self.alpha_grid:
            raise MarconiError("alpha_grid is empty")
        grid = tuple(sorted({check_alpha(a) for a in self.alpha_grid}))
        object.__setattr__(self, "alpha_grid", grid)
        object.__setattr__(self, "seglen_weights", tuple(sorted({check_alpha(w) for w in self.seglen_weights})))
        object.__setattr__(self, "depth_exponents", tuple(sorted({check_exponent(b) for b in self.depth_exponents})))
        if self.objective not in OBJECTIVES:
            raise MarconiError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        check_rate(self.sample_rate)
        if self.verify_rate is not None:
            check_rate(self.verify_rate)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise MarconiError(f"epoch must be an integer >= 1 (sampled requests), got {self.epoch!r}")
        for name in ("half_life", "margin", "z", "tie", "guard_half_life", "guard_margin", "guard_z", "dwell", "persist",
                     "prune_after", "prune_margin", "revive_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise MarconiError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("half_life", "guard_half_life"):
            if not getattr(self, name) > 0:
                raise MarconiError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.coverage is not None and not isinstance(self.coverage, bool):
            raise MarconiError(f"coverage must be True, False or None (None: on over the served model only), "
                               f"got {self.coverage!r}")
        if isinstance(self.prior_scale, bool) or not isinstance(self.prior_scale, (int, float)) \
                or not 0 <= self.prior_scale < 1:
            raise MarconiError(f"prior_scale must be in [0, 1) (0: no miniatures), got {self.prior_scale!r}")

    @property
    def choices(self) -> tuple[Choice, ...]:
        """LRU, the alphas, SegLen, depth, coverage (the order scores and tables use)."""
        return (((LRU,) if self.lru else ()) + self.alpha_grid + tuple(map(seglen_choice, self.seglen_weights))
                + tuple(map(depth_choice, self.depth_exponents)) + ((DEPTH_AUTO,) if self.depth_auto else ())
                + ((COVERAGE,) if self.coverage else ()))

    @property
    def has_depth(self) -> bool:
        return bool(self.depth_exponents) or self.depth_auto

    def with_depth(self, exponents: tuple[float, ...] = DEFAULT_DEPTH_EXPONENTS, auto: bool = True) -> ShadowConfig:
        """This configuration with the depth-aware choices."""
        return replace(self, depth_exponents=tuple(exponents), depth_auto=auto)

    def without_depth(self) -> ShadowConfig:
        """This configuration without the depth-aware choices."""
        return replace(self, depth_exponents=(), depth_auto=False) if self.has_depth else self

    @property
    def start(self) -> Choice:
        """The safe choice: where the live cache starts and where the guard sends it back
        (`choices[0]`, without building them: the guard asks on every sampled request)."""
        if self.lru:
            return LRU
        return self.alpha_grid[0] if self.alpha_grid else self.choices[0]


def served_config(config: ShadowConfig) -> ShadowConfig:
    """The configuration a tuner over the model of SGLang's cache runs (`ShadowTuner(served=...)`,
    `TunerSpec`): `config` with the depth-aware choices unless it names some, the choices the
    simulator's tuned configuration carries (`sim/tuning.py`), and coverage unless it says no."""
    config = config if config.has_depth else config.with_depth()
    return replace(config, coverage=True) if config.coverage is None else config


def live_record_for(choices) -> ContinuationRecord | None:
    """The record of finished sequences a served cache tuned over `choices` keeps from its first
    request (a new one), or None: a cache that may adopt a depth choice must hold the stream from
    the start, as the tuner's served shadows do, or the rule would rank by a shorter history than
    the shadow that predicted it. The served runtime (`serving/runtime.py`, every rank) and the
    simulator's model of it (`sim/baselines/served.py`) both ask here."""
    return ContinuationRecord() if any(map(is_depth_choice, choices)) else None


def served_model(profile, pools: ServedPools, choice, *, probation: bool, record: bool) -> ServedCache:
    """A model of SGLang's cache for a tuner (`record`: keeping its record of finished sequences
    from its first request; copies made from it keep feeding theirs)."""
    cache = ServedCache(profile, pools, choice, probation=probation)
    if record and cache.continuation is None:
        cache.continuation = ContinuationRecord()
    return cache


@dataclass
class TunerLog:
    decisions: list[tuple[int, Choice]] = field(default_factory=list)  # (requests seen, choice adopted)
    requests: int = 0
    sampled: int = 0
    forked_at: int | None = None  # requests seen when the shared shadow forked
    seconds: float = 0.0  # time spent in observe()
    reverts: int = 0  # times the guard sent the live cache back to the safe choice
    prior: Choice | None = None  # the miniatures' choice adopted at the fork, if any
    pruned: int = 0  # shadows dropped from the race (`ShadowConfig.prune_after`)
    revived: int = 0  # and brought back


class ShadowTuner:
    """Feed it every request (`observe`); it returns the choice to adopt whenever it switches."""

    def __init__(self, profile, capacity_bytes: int, config: ShadowConfig = ShadowConfig(), *,
                 checkpoint_grid: int = 1, page_size: int = 1, state_slots: int | None = None,
                 probation: bool = False, served: ServedPools | None = None):
        """`capacity_bytes` (and `state_slots`, for two budgets: see `HybridPrefixCache`) are the
        live cache's; the shadows get them scaled by the sample rate. `probation`: the live cache
        keeps probationary states (`HybridPrefixCache`), so the shadows do too. `served`: the live
        cache is SGLang's (its pools, strategy and chunking): every shadow is then the model of
        the served cache (`ServedCache`, `ServedShadow`) on those pools scaled by the sample rate,
        each keeping its own record of finished sequences from the first request, the choices
        are `served_config`'s, and `capacity_bytes`, `state_slots`, `checkpoint_grid` are not used."""
        if served is not None:
            config = served_config(config)
        self.profile = profile
        self.config = config
        self.choices = config.choices
        self.page_size = page_size
        self.served = served
        self.probation = probation
        self.flops = FlopsTable(profile)  # every cache of this tuner refreshes the same spans
        # The record of finished sequences every depth-aware cache of this tuner reads (and the live
        # cache, handed it by `adopt_choice`): fed here, once per request, after the caches served it.
        # Served models feed their own (`served_model`): what each keeps differs.
        self.record = ContinuationRecord() if config.has_depth and served is None else None
        rate = config.sample_rate
        self.mini: _Miniatures | None = None
        self._prior: int | None = None  # the miniatures' verdict, once they stopped
        if served is not None:
            depth = config.has_depth
            self.shared = ServedShadow(served_model(profile, served.scaled(rate), config.start, probation=probation,
                                                    record=depth), shared=True)
            self.shadows = []
            if config.prior_scale > 0:
                self.mini = _Miniatures(self, ServedShadow(served_model(
                    profile, served.scaled(rate * config.prior_scale), config.start, probation=probation,
                    record=depth), shared=True))
        else:
            if config.coverage:  # its shadows are the served model's; the paper tree's were never checked for it
                raise MarconiError("coverage=True: the coverage choice is tuned over the model of SGLang's cache "
                                   "only (ShadowTuner(served=...))")
            shadow_bytes = int(capacity_bytes * rate)
            shadow_slots = None if state_slots is None else max(2, round(state_slots * rate))
            if shadow_bytes < (2 * profile.ssm_state_bytes if state_slots is None else 1):
                raise MarconiError(
                    f"sample_rate={rate} scales capacity {capacity_bytes} below one request's two "
                    f"SSM states ({2 * profile.ssm_state_bytes} bytes); raise the sample rate"
                )
            self.shared: _SharedShadow | None = _SharedShadow(
                profile, shadow_bytes, checkpoint_grid=checkpoint_grid, page_size=page_size, state_slots=shadow_slots,
                probation=probation, flops=self.flops)
            self.shadows: list[ShadowCache | None] = []
            # Miniatures: the same shadows at `prior_scale` x the capacity, from the start until the fork.
            # They fill (and fork) first, so when the shadows fork, before any of them has a hit to
            # tell them apart, the miniatures have already seen which eviction does better under
            # contention: their leader is adopted at the fork (the guard reverts it if it loses). They
            # stop (their verdict kept for the fork) once they have run as long after their fork as
            # before it: a cache that is slow to fill does not pay for seven of them all along.
            mini_bytes = int(shadow_bytes * config.prior_scale)
            if config.prior_scale > 0 and (mini_bytes >= 2 * profile.ssm_state_bytes or state_slots is not None):
                mini_slots = None if shadow_slots is None else max(2, round(shadow_slots * config.prior_scale))
                self.mini = _Miniatures(self, _SharedShadow(profile, max(1, mini_bytes), checkpoint_grid=checkpoint_grid,
                                                            page_size=page_size, state_slots=mini_slots,
                                                            probation=probation, flops=self.flops))
        self.current = config.start
        self.evidence = Evidence(len(self.choices), (config.half_life, config.guard_half_life))
        self.since = GuardSums(0)  # since the last switch: what the guard judges
        self.strikes = np.zeros(len(self.choices))  # reverts away from each choice: each raises its bar
        self._since_decision = 0
        self._since_switch = config.dwell  # sampled requests since the last switch
        self._held = [0.0] * len(self.choices)  # each one's lead over the current one, points x sampled requests
        self.log = TunerLog(decisions=[(0, self.current)])
        self._fed = 0  # observe() calls: equal to log.requests while the caller feeds every request
        self.last_hits: list[int] | None = None  # each choice's shadow's hit on the last sampled request (0: dropped)
        # The live cache's stand-in (`_LiveStandIn`), from the first switch away from the safe choice on,
        # where no verifier keeps one.
        self.live: _LiveStandIn | None = None
        self.verifier = _Verifier(self, capacity_bytes, checkpoint_grid=checkpoint_grid, page_size=page_size,
                                  state_slots=state_slots, probation=probation) if rate < 1 and config.verify else None

    @property
    def scores(self) -> np.ndarray:
        """Each candidate's decayed score over the long window (FLOPs saved or hit tokens)."""
        return self.evidence.scores[LONG]

    @property
    def potential(self) -> float:
        """The same decayed sum of what the requests could save at most (their whole inputs)."""
        return float(self.evidence.potential[LONG])

    # -- the stream --------------------------------------------------------------------------
    def observe(self, session_key: str, input_tokens, output_tokens, *, sequence: np.ndarray | None = None
                ) -> Choice | None:
        """One served request. Returns the newly adopted choice, or None (no switch). `sequence`:
        input + output already joined by the caller (a 1-D integer array it will not change), so
        that the tuner does not join them again: the simulator's live cache joins them anyway."""
        self.log.requests += 1
        self._fed += 1
        sampled = session_in_sample(session_key, self.config.sample_rate)
        if self.verifier is not None and self._fed != self.log.requests:
            self.verifier = None  # the caller passes only sampled requests: no check beyond the sample is possible
        verified = self.verifier is not None and self.verifier.sees(session_key)
        if not sampled and not verified and self.record is None:
            return None
        started = time.perf_counter()
        try:
            if sequence is None:
                inp, out = as_token_array(input_tokens), np.asarray(output_tokens, dtype=np.int64)
                seq, input_len = (np.concatenate((inp, out)) if len(out) else inp), len(inp)
            else:
                # already the array `as_token_array` returns (the simulator's joined sequence): taken as is
                seq = sequence if (type(sequence) is np.ndarray and sequence.dtype is _INT64 and sequence.ndim == 1
                                   and len(sequence)) else as_token_array(sequence)
                input_len = len(input_tokens)
                if not 0 < input_len <= len(seq):
                    raise MarconiError(f"input of {input_len} tokens in a sequence of {len(seq)}")
            switched = None
            if sampled or verified:
                match = SharedMatch(seq, input_len, self.page_size)  # compared once for every cache below
                switched = self._serve_sampled(session_key, match) if sampled else None
                if verified:
                    switched = self.verifier.serve(session_key, match) or switched
            if self.record is not None:
                self.record.finish(seq, len(seq) - len(seq) % self.page_size)
            return switched
        finally:
            self.log.seconds += time.perf_counter() - started

    def _serve_sampled(self, key: str, match: SharedMatch) -> Choice | None:
        self.log.sampled += 1
        input_len = match.input_len
        if self.shared is not None:
            if self.mini is not None:
                self.mini.serve(key, match)
                if self.mini.done():
                    self._prior, self.mini = self.mini.leader(), None
            hit, checkpoint_at = self.shared.lookup(match)
            try:
                self.shared.admit(match, checkpoint_at, input_len)
                self.last_hits = [hit] * len(self.choices)
                return None
            except _ForkNow:
                self._fork(match, checkpoint_at)
            hits = self.last_hits = [hit] * len(self.shadows)
            mini, self.mini = self.mini, None
            prior = self._prior if mini is None else mini.leader()
            if prior is not None and self.verifier is None:
                self._score(key, hits, input_len)
                self.log.prior = self.choices[prior]
                return self._switch(prior)
        else:
            hits = []
            for shadow in self.shadows:
                if shadow is None:  # dropped: it saves nothing until it is revived
                    hits.append(0)
                    continue
                hit, checkpoint_at = shadow.lookup(match)
                shadow.admit(match, checkpoint_at, input_len)
                hits.append(hit)
        self.last_hits = hits
        self._score(key, hits, input_len)
        if self.live is not None:
            self.live.serve(key, match, hits[0])
        self._since_switch += 1
        self._since_decision += 1
        if self._since_decision >= self.config.epoch:
            self._since_decision = 0
            return self._decide()
        return None

    def _fork(self, match: SharedMatch, checkpoint_at: int | None) -> None:
        shared, self.shared = self.shared, None
        self.log.forked_at = self.log.requests
        self._sampled_at_fork = self._revived_at = self.log.sampled
        self.shadows = fork_shadows(self.profile, shared, self.choices, match, checkpoint_at, self.record)

    # -- scores and decisions ----------------------------------------------------------------
    def gains(self, hits: Sequence[int], input_len: int) -> tuple[np.ndarray, float]:
        """What each cache saved on a request (hit tokens per cache) and what it could have saved
        at most, in the objective's units."""
        if self.config.objective == "flops":
            flops = self.flops
            return np.array(flops.of_prefixes(hits)), flops(0, input_len)
        return np.asarray(hits, dtype=float), float(input_len)

    def _score(self, key: str, hits: Sequence[int], input_len: int) -> None:
        gains, whole = self.gains(hits, input_len)
        self.evidence.add(key, gains, whole)
        if self.guard_reads_since():
            self.since.add(key, gains, whole)

    def guard_reads_since(self) -> bool:
        """Whether `since` may be read before the next switch resets it: only the guard reads it,
        and only while the current choice is not the safe one. On the safe choice its sums are
        dead and are not kept (they cost as much as the evidence itself)."""
        return self.current != self.config.start

    def _decide(self) -> Choice | None:
        """The guard first: a current choice other than the safe one (LRU) that the safe one now
        leads (since the switch, over the short window or over the long one, by `guard_margin`,
        `guard_z` clustered standard errors and in both halves) is abandoned, and each such
        revert raises the bar for adopting that choice again. Then adoption of the leader (the
        best long-window score, near-ties to the value-first choices): it must lead the current
        choice (and the safe one) by the margin, and either significantly (over the long window,
        by `z` clustered standard errors and in both halves, still leading over the short one)
        or for long enough (its short-window lead in points, summed over the sampled requests of
        an unbroken run of leads, reaches `persist`). No switch but the guard's within `dwell`
        sampled requests of the last one."""
        c, ev = self.config, self.evidence
        cur, safe = self.choices.index(self.current), 0
        best = self._prune_or_revive(cur)
        if cur != safe and self.verifier is None and (any(
                e.lead(safe, cur, w, c.guard_margin, z)
                for e, w, z in ((self.since, LONG, c.z), (ev, SHORT, c.guard_z), (ev, LONG, c.guard_z)))
                or (self.live is not None and self.live.trails_safe())):
            self.strikes[cur] += 1
            self.log.reverts += 1
            return self._switch(safe)
        # each choice's short-window lead in points, held while it beats its bar (per choice, in
        # Python floats: numpy's arithmetic on seven values costs more in calls than it saves)
        bars = [c.margin * (1.0 + strikes) for strikes in self.strikes.tolist()]
        short, potential = ev.scores[SHORT].tolist(), ev.potential.item(SHORT)
        current = short[cur]
        pts = [100 * (score - current) / potential if potential else math.nan for score in short]
        self._held = [held + c.epoch * p if p > 100 * bar else 0.0 for held, p, bar in zip(self._held, pts, bars)]
        if best is None:
            best = self.leader()
        if self.verifier is not None:  # the best of those the verifier has not just turned down
            allowed = self.verifier.allowed()
            if not allowed[best]:
                scores = np.where(allowed, ev.scores[LONG], -np.inf)
                best = int(np.argmax(scores)) if np.isfinite(scores.max()) else cur
        if best == cur or self._since_switch < c.dwell or not self._held[best]:
            return None
        bar = bars[best]
        significant = ev.lead(best, cur, LONG, bar, c.z)
        if not (significant or (self._held[best] >= c.persist and ev.lead(best, cur, LONG, 0.0, 0.0, False))):
            return None
        if best != safe and cur != safe and not ev.lead(best, safe, SHORT, bar, 0.0, False):
            return None
        if self.verifier is not None:  # a sample proposes; the verifier's larger one decides
            self._held[best] = 0
            self.verifier.propose(best)
            return None
        return self._switch(best)

    def _prune_or_revive(self, cur: int) -> int | None:
        """Racing: a shadow that trails the leader by `prune_margin` over both windows, by `z`
        clustered standard errors over the long one, `prune_after` sampled requests after the fork
        or later, is dropped (never LRU's, the current choice's or the leader's; a depth choice's
        only once the tuner has seen DEPTH_PRUNE_HORIZONS continuation horizons since the fork,
        `_depth_may_leave`): the shadows' cost goes to the choices still in the race. Every
        `revive_every` sampled requests the dropped ones come back, forked from the current
        choice's shadow with its evidence so far (as if they had behaved like it until now), so
        that a shift in the workload can bring them back. Returns the leader (`leader()`) where it
        ranked them, else None."""
        c, ev = self.config, self.evidence
        since_fork = self.log.sampled - self._sampled_at_fork
        if not c.prune_after or since_fork < c.prune_after:
            return None
        dropped = [v for v, shadow in enumerate(self.shadows) if shadow is None]
        if dropped and self.log.sampled - self._revived_at >= c.revive_every:
            self._revived_at = self.log.sampled
            donor_index = cur if self.shadows[cur] is not None else 0  # the live choice may have come via the verifier
            donor = self.shadows[donor_index]
            for v in dropped:
                eviction = eviction_for(self.choices[v], self.record)
                self.shadows[v] = restore_shadow(self.profile, donor.snapshot(), eviction, flops=self.flops,
                                                 record=self._safe_record())
                ev.copy_arm(donor_index, v)
                self.since.copy_arm(donor_index, v)
            self.log.revived += len(dropped)
            return None
        lead = self.leader()
        trial = self.verifier.trial_choice() if self.verifier is not None else None
        for v, shadow in enumerate(self.shadows):
            if shadow is None or v in (0, cur, lead, trial):
                continue
            if is_depth_choice(self.choices[v]) and not self._depth_may_leave(v, since_fork):
                continue
            if ev.lead(lead, v, LONG, c.prune_margin, c.z, False) and ev.lead(lead, v, SHORT, c.prune_margin, 0.0, False):
                self.shadows[v] = None
                self.log.pruned += 1
        return lead

    def _depth_may_leave(self, v: int, since_fork: int) -> bool:
        """Whether depth choice v's shadow may be pruned: the depth rule's gain comes from
        continuations of what it kept, so trailing is evidence against it only over a stretch
        that spans them: DEPTH_PRUNE_HORIZONS x the record's continuation horizon since the fork
        (DEPTH_PRUNE_WAIT while the record has too few continuations to know it). A shadow pruned
        earlier and revived from another choice's contents would rebuild what it keeps from scratch.
        Units are the record's: requests for the tuner's own record (fed every request), sampled
        requests for a served shadow's (fed what the shadow serves)."""
        if self.record is not None:
            record, seen = self.record, self.log.requests - self.log.forked_at
        else:
            record, seen = self.shadows[v].cache.continuation, since_fork
        if record is None:
            return True
        horizon = record.horizon
        return seen >= (DEPTH_PRUNE_HORIZONS * horizon if math.isfinite(horizon) else DEPTH_PRUNE_WAIT)

    def _safe_record(self) -> ContinuationRecord | None:
        """The safe choice's shadow's own record of finished sequences (served models only)."""
        return self.shadows[0].cache.continuation if self.served is not None else None

    def leader(self) -> int:
        """Index of the choice that leads the long window: among those within `tie` x potential
        of the best score, the last listed (SegLen, then the largest alpha). Right after the fork
        the choices still behave alike, and the value-first ones are those whose gains show only
        later; the guard sends the live cache back to LRU if that bet turns out wrong."""
        return leading_arm(self.evidence, self.config.tie)

    def _switch(self, index: int) -> Choice:
        self._since_switch = 0
        self._held = [0.0] * len(self.choices)
        self.since = GuardSums(index)
        left = self.choices.index(self.current)
        self.current = self.choices[index]
        self.log.decisions.append((self.log.requests, self.current))
        if self.verifier is None and self.config.live_guard:
            if self.live is None:
                self.live = _LiveStandIn(self)
            self.live.switch(left, self.current)
        return self.current

    def score_table(self) -> dict[str, float]:
        """Each candidate's decayed score (FLOPs saved or hit tokens), by choice label."""
        return {choice_label(c): float(s) for c, s in zip(self.choices, self.scores)}


class _Verifier:
    """Evidence beyond the sample (sample rate < 1, every request fed): caches over a second,
    larger, independent sample (`rate`, salt 1; capacity scaled alike; all sessions from a
    shadow rate of 0.5) that check what the sampled shadows propose before the live cache
    adopts it.

    - An anchor: the safe choice (LRU) over the verifier's sample, from the start.
    - A trial: when the sampled shadows propose a choice, a cache forked from the anchor
      (or from the mirror, if the live cache is not on the safe choice) runs it from then on. It
      is adopted only if, after `half_life` requests at least (more for a struck choice: value-first
      evictions started from a recency-shaped cache often gain at first and lose once their
      long prefixes have piled up), it beats the cache it was forked from, and the anchor, by the
      tuner's own rule (margin and clustered significance, or a lead held long enough); it is
      dropped (and the proposal struck, raising its bar and its patience) if either leads it or it
      has not qualified within three times that.
    - A mirror: the adopted trial goes on as the live cache's stand-in; the guard compares it with
      the anchor (the exact "what if we had stayed on LRU") and reverts the live cache to the safe
      choice when the anchor leads.
    Its Evidence windows count the requests of its own sample."""

    def __init__(self, tuner: ShadowTuner, capacity_bytes: int, *, checkpoint_grid: int, page_size: int, state_slots,
                 probation: bool = False):
        self.tuner = tuner
        c = tuner.config
        self.rate = min(1.0, max(0.5, 2 * c.sample_rate)) if c.verify_rate is None else check_rate(c.verify_rate)
        capacity_bytes = int(capacity_bytes * self.rate)
        state_slots = None if state_slots is None else max(2, round(state_slots * self.rate))
        self._kw = dict(checkpoint_grid=checkpoint_grid, page_size=page_size, state_slots=state_slots,
                        probation=probation)
        self.capacity_bytes = capacity_bytes
        safe = tuner.config.start
        if tuner.served is not None:
            anchor = ServedShadow(served_model(tuner.profile, tuner.served.scaled(self.rate), safe,
                                              probation=tuner.probation, record=tuner.config.has_depth))
        else:
            anchor = ShadowCache(tuner.profile, capacity_bytes, eviction_for(safe), flops=tuner.flops, **self._kw)
        self.arms: list[tuple[int, ShadowCache | ServedShadow]] = [(0, anchor)]
        self.mirror: int | None = None  # index in arms of the live cache's stand-in
        self.trial: int | None = None
        self.evidence: Evidence | None = None  # over the arms, since the oldest of them but the anchor started
        self.trial_started = 0
        self._since_decision = 0
        self._held = 0.0
        self._blocked_until = np.zeros(len(tuner.choices))  # a turned-down proposal waits (requests)

    def _anchor_record(self) -> ContinuationRecord | None:
        anchor = self.arms[0][1]
        return anchor.cache.continuation if isinstance(anchor, ServedShadow) else None

    def trial_choice(self) -> int | None:
        return None if self.trial is None else self.arms[self.trial][0]

    def sees(self, session_key: str) -> bool:
        """Its own session sample: independent of the shadows' (another salt), and larger."""
        return self.rate >= 1.0 or session_in_sample(session_key, self.rate, salt=1)

    def allowed(self) -> np.ndarray:
        return self._blocked_until <= self.tuner.log.requests

    def propose(self, choice: int) -> None:
        if self.trial is not None or choice == self.tuner.choices.index(self.tuner.current):
            return
        parent = self.arms[self.mirror if self.mirror is not None else 0][1]
        eviction = eviction_for(self.tuner.choices[choice], self.tuner.record)
        cache = restore_shadow(self.tuner.profile, parent.snapshot(), eviction, flops=self.tuner.flops,
                               record=self._anchor_record())
        self.arms.append((choice, cache))
        self.trial = len(self.arms) - 1
        self.trial_started = self.tuner.log.requests
        self._held = 0.0
        k = len(self.arms)
        c = self.tuner.config
        if self.evidence is None:
            self.evidence = Evidence(k, (c.half_life, c.guard_half_life))
        else:  # keep the mirror's evidence, add the trial's from zero
            self._trial_base = self.evidence.scores.copy()
            self.evidence = self.evidence.extended()

    def serve(self, key: str, match: SharedMatch) -> Choice | None:
        hits = []
        input_len = match.input_len
        for _, cache in self.arms:
            hit, checkpoint_at = cache.lookup(match)
            cache.admit(match, checkpoint_at, input_len)
            hits.append(hit)
        if self.evidence is None:
            return None
        tuner = self.tuner
        self.evidence.add(key, *tuner.gains(hits, input_len))
        self._since_decision += 1
        if self._since_decision < tuner.config.epoch:
            return None
        self._since_decision = 0
        return self._decide()

    def _decide(self) -> Choice | None:
        c, ev, tuner = self.tuner.config, self.evidence, self.tuner
        live = self.mirror
        if live is not None and any(ev.lead(0, live, w, c.guard_margin, c.guard_z) for w in (SHORT, LONG)):
            choice = self.arms[live][0]
            tuner.strikes[choice] += 1
            self._blocked_until[choice] = tuner.log.requests + 2 * c.half_life * tuner.strikes[choice]
            tuner.log.reverts += 1
            self._keep([0])
            return tuner._switch(0)
        if self.trial is None:
            return None
        t, parent = self.trial, (live if live is not None else 0)
        choice = self.arms[t][0]
        age = tuner.log.requests - self.trial_started
        patience = c.half_life * (1.0 + tuner.strikes[choice])  # a fresh lead is often transient: wait it out
        if ev.lead(0, t, SHORT, c.guard_margin, c.guard_z) or ev.lead(parent, t, SHORT, c.guard_margin, c.guard_z) \
                or age > 3 * patience:
            tuner.strikes[choice] += 1
            self._blocked_until[choice] = tuner.log.requests + 2 * c.half_life * tuner.strikes[choice]
            self._keep([i for i in range(len(self.arms)) if i != t])
            return None
        if age < patience:
            return None
        bar = c.margin * (1.0 + tuner.strikes[choice])
        pts = 100 * min((ev.scores[SHORT, t] - ev.scores[SHORT, p]) / ev.potential[SHORT] for p in {0, parent})
        self._held = self._held + c.epoch * pts if pts > 100 * bar else 0.0
        leads = all(ev.lead(t, p, LONG, bar, c.z) for p in {0, parent})
        if not (leads or (self._held >= c.persist and all(ev.lead(t, p, LONG, 0.0, 0.0, False) for p in {0, parent}))):
            return None
        self._keep([0, t])
        self.mirror = 1
        return tuner._switch(choice)

    def _keep(self, arms: list[int]) -> None:
        """Keep only these arms (the anchor first); their evidence goes on."""
        self.arms = [self.arms[i] for i in arms]
        self.evidence = self.evidence.select(arms) if len(arms) > 1 else None
        self.trial = None
        self.mirror = 1 if len(arms) > 1 and self.mirror is not None and arms[1] == self.mirror else None


class _LiveStandIn:
    """The live cache as the tuner can see it where no verifier keeps a stand-in: a cache over the
    shadows' sample that switches whenever the live cache does, forked at the first switch from the
    shadow of the choice the live cache ran until then (at sample rate 1 it is then the live cache,
    hit for hit).

    A shadow predicts what its choice does from the contents its own choice shaped since the fork;
    a live cache that adopts it later holds contents shaped by earlier choices, and a value-first
    rule keeps what it finds (long prefixes it ranks high are never evicted), so the live cache can
    fall behind the very shadow that led it there. The guard (`trails_safe`) compares the stand-in
    with the safe choice's shadow, the exact "what if we had stayed", since the last switch (undecayed)
    and over a short window from it (`guard_half_life`), both by `guard_margin` and at `z` standard
    errors, not the shadows' `guard_z`: a revert costs the live cache the contents it built (a rule
    that ranks by continuation often trails LRU for a while before it pays, Mooncake).

    Merged: once the stand-in holds what the current choice's shadow holds, node for node, with
    recency stamps one offset apart (`TreeCore.same_contents`, checked every `MERGE_EVERY` sampled
    requests), the two run alike from then on, so the stand-in is dropped and the shadows' own guard
    stands for it; the next switch forks it again from that shadow. Most adoptions end so: a cost of
    one cache for a while, not for the rest of the stream."""

    MERGE_EVERY = 64

    def __init__(self, tuner: ShadowTuner):
        self.tuner = tuner
        self.cache = None  # None: not forked yet, or merged into the current choice's shadow
        self.since: GuardSums | None = None
        self.short: Evidence | None = None
        self.last_hit = 0  # its hit on the last sampled request
        self._served = 0

    def switch(self, left: int, choice: Choice) -> None:
        """The live cache leaves choice index `left` for `choice`."""
        tuner = self.tuner
        if self.cache is None:
            if tuner.shadows[left] is None:  # a choice the verifier adopted before it stepped aside, since dropped
                left = 0
            if tuner.served is not None:  # a copy keeps a record where its choice reads one (`served_copy`)
                self.cache = ServedShadow(served_copy(tuner.shadows[left].cache, choice, tuner._safe_record()))
            else:
                self.cache = restore_shadow(tuner.profile, tuner.shadows[left].snapshot(),
                                            eviction_for(tuner.choices[left], tuner.record), flops=tuner.flops)
        if isinstance(self.cache, ServedShadow):
            model, record = self.cache.cache, tuner._safe_record()
            if model.continuation is None and record is not None and is_depth_choice(choice):
                model.continuation = record.copy()  # the stream's record, not an empty one
            model.set_choice(choice)
        else:
            self.cache.set_eviction(eviction_for(choice, tuner.record))
        self.since = GuardSums(1)
        self.short = Evidence(2, (tuner.config.guard_half_life,))

    def serve(self, key: str, match: SharedMatch, safe_hit: int) -> None:
        cache, tuner = self.cache, self.tuner
        if cache is None:
            return
        hit, checkpoint_at = cache.lookup(match)
        cache.admit(match, checkpoint_at, match.input_len)
        self.last_hit = hit
        if tuner.current != tuner.config.start:  # read by the guard only off the safe choice
            gains, whole = tuner.gains((safe_hit, hit), match.input_len)
            self.since.add(key, gains, whole)
            self.short.add(key, gains, whole)
        self._served += 1
        if self._served % self.MERGE_EVERY == 0:
            shadow = tuner.shadows[tuner.choices.index(tuner.current)]
            if shadow is not None and cache.same_contents(shadow):
                self.cache = None

    def trails_safe(self) -> bool:
        if self.cache is None:  # merged: the shadows' guard judges the current choice's shadow
            return False
        c = self.tuner.config
        return self.since.lead(0, 1, LONG, c.guard_margin, c.z) or self.short.lead(0, 1, 0, c.guard_margin, c.z)


def leading_arm(evidence: Evidence, tie: float) -> int:
    """The arm leading `evidence`'s long window: the last of those within `tie` x potential of the
    best score (`ShadowTuner.leader`; read as Python floats, the same arithmetic as numpy's)."""
    scores = evidence.scores[LONG].tolist()
    floor = max(scores) - tie * evidence.potential.item(LONG)
    return max(arm for arm, score in enumerate(scores) if score >= floor)


def fork_shadows(profile, shared: _SharedShadow, choices, match: SharedMatch, checkpoint_at: int | None,
                 record: ContinuationRecord | None = None):
    """One cache per choice from the shared shadow's contents, each with its own recency, the
    request that made the shared shadow fork admitted (`record`: what the depth choices read)."""
    shadows = []
    snapshots = {}  # by recency convention: every choice of one convention starts from the same snapshot
    for choice in choices:
        eviction = eviction_for(choice, record)
        snap = snapshots.get(eviction.refresh_matched_path)
        if snap is None:
            snap = snapshots[eviction.refresh_matched_path] = shared.snapshot_as(eviction)
        shadow = restore_shadow(profile, snap, eviction, flops=getattr(shared, "flops", None))
        shadow.admit(match, checkpoint_at, match.input_len)
        shadows.append(shadow)
    return shadows


def restore_shadow(profile, snap, eviction: EvictionPolicy, *, flops: FlopsTable | None = None,
                   record: ContinuationRecord | None = None):
    """A shadow cache under `eviction` from another's `snapshot()`: a `ShadowCache`, or a copy of a
    served shadow's model (`ServedShadow`, `served_copy`; `record`: what a depth choice copied from
    a model without a record reads instead)."""
    if isinstance(snap, ServedCache):
        return ServedShadow(served_copy(snap, choice_of(eviction), record))
    return ShadowCache.from_snapshot(profile, snap, eviction, flops=flops)


def served_copy(cache: ServedCache, choice: Choice, record: ContinuationRecord | None = None) -> ServedCache:
    """A copy of a tuner's served model under `choice`. Only the caches that read their record of
    finished sequences keep one (a copy): the depth choices, and the safe choice (LRU), which is
    never dropped from the race and lends its record (`record`) to a depth choice revived from a
    shadow without one. The others feed none: a record costs about a quarter of a model's request."""
    kept, rule = cache.continuation, cache.depth_rule
    cache.continuation = cache.depth_rule = None  # the record is not deep-copied: copied below where kept
    try:
        clone = cache.copy()
    finally:
        cache.continuation, cache.depth_rule = kept, rule
    if is_depth_choice(choice) or choice == LRU:
        source = kept if kept is not None else record
        clone.continuation = source.copy() if source is not None else None
    clone.set_choice(choice)
    return clone


def choice_of(eviction: EvictionPolicy) -> Choice:
    """The tuner's choice an eviction policy stands for (`eviction_for`'s inverse)."""
    if isinstance(eviction, LruLeafEviction):
        return LRU
    if isinstance(eviction, CoverageEviction):
        return COVERAGE
    if isinstance(eviction, CalibratedDepthEviction):
        return DEPTH_AUTO
    if isinstance(eviction, DepthEviction):
        return depth_choice(eviction.exponent)
    if isinstance(eviction, SegLenEviction):
        return seglen_choice(eviction.alpha)
    return float(eviction.alpha)


class ServedShadow:
    """A `ServedCache` (the model of SGLang's cache) behind the tuner's cache interface: `lookup`
    then `admit` of a `SharedMatch`. SGLang's cache admits as the request runs, so `lookup` serves
    the whole request and `admit` has nothing left to do; a shadow made by a fork
    (`restore_shadow`) is given `admit` alone, which serves it. The shared shadow (`shared=True`)
    stands for every choice until the first request that could make a cache evict (it could
    allocate more than is free: `ServedCache.may_evict`): its `admit` then raises `_ForkNow`
    without serving, and each choice serves that request on its own copy (the served cache keeps
    the same recency whatever the choice, so the copies need no other preparation)."""

    def __init__(self, cache: ServedCache, shared: bool = False):
        self.cache = cache
        self.shared = shared
        self._served = None  # the match `lookup` served
        self._fork = None  # the match `admit` must fork for

    def lookup(self, match: SharedMatch) -> tuple[int, None]:
        seq, n_in = match.seq, match.input_len
        if self.shared and self.cache.may_evict(n_in, len(seq)):
            self._fork = match
            return self.cache.peek_hit(seq[:n_in]), None
        self._served = match
        return self.cache.serve_kept(seq, n_in).hit_tokens, None

    def admit(self, match: SharedMatch, checkpoint_at=None, probation_at=None) -> int:
        if self._fork is match:
            self._fork = None
            raise _ForkNow
        if self._served is match:
            self._served = None
            return 0
        return self.cache.serve_kept(match.seq, match.input_len).states_admitted

    @property
    def probation(self) -> bool:
        return self.cache.probation

    def snapshot(self) -> ServedCache:
        return self.cache  # `restore_shadow` copies it

    def snapshot_as(self, eviction: EvictionPolicy) -> ServedCache:
        return self.cache

    def same_contents(self, other: ServedShadow) -> bool:
        return self.cache.same_contents(other.cache)

    def check_invariants(self) -> None:
        self.cache.check_invariants()


def sync_point_of(released: int, sync_every: int) -> int | None:
    """k where the `released`-th release is sync point k (release k x `sync_every`), else None."""
    if released <= 0 or released % sync_every:
        return None
    return released // sync_every


def record_adopted_at(sync_point: int) -> int:
    """The sync record that sync point k adopts: k - 1, the tuner's choice as of the previous sync
    point (a background tuner has a whole interval to get there, so which choice is in force at
    every release is a function of the request stream alone). With `sync_point_of`, the one rule
    for when a tuned choice takes effect, in the server (`serving/runtime.py`, inline or background
    tuner) and in the simulator's model of it (`ServedTuning`, `sim/baselines/served.py`)."""
    return sync_point - 1


def tuner_reads(config, session_key: str) -> bool:
    """Whether the served runtime hands the tuner this session's requests: those of its sample
    only (the rest are counted, not sent). A tuner so fed runs the sampled rule alone
    (`ShadowTuner`: no verifier beyond the sample)."""
    return config.sample_rate >= 1 or session_in_sample(session_key, config.sample_rate)


class SyncRecorder:
    """Records the tuner's choice as of every `sync_every`-th request of the stream (sync record
    k: after exactly k x `sync_every` requests) with `record(k, choice index)`."""

    def __init__(self, tuner, sync_every: int, record):
        self.tuner, self.sync_every, self.record = tuner, sync_every, record
        self.next_k = 0  # the next sync record to write

    def advance(self, requests: int) -> None:
        """Record every sync point up to `requests` with the tuner's current choice."""
        while self.next_k * self.sync_every <= requests:
            self.record(self.next_k, self.tuner.choices.index(self.tuner.current))
            self.next_k += 1


class ServedTuning:
    """The served runtime's tuning protocol on one thread: what the tuner is fed (every release in
    order; `tuner_reads` sessions observed, the others counted) and its sync records, kept until a
    sync point takes them. The inline tuner (`serving/runtime.py`) and the simulator's served model
    run this; the background tuner splits it between the scheduler (`tuner_reads`) and its child
    (`SyncRecorder`), to the same records. For any tuner with `observe`, `choices`, `current`, `log`."""

    def __init__(self, tuner, sync_every: int):
        self.tuner, self.sync_every = tuner, sync_every
        self._records: dict[int, int] = {}
        self._recorder = SyncRecorder(tuner, sync_every, self._records.__setitem__)
        self._recorder.advance(0)

    def feed(self, session_key: str, input_tokens, output_tokens, *, sequence: np.ndarray | None = None) -> None:
        """One release: `output_tokens` what the cache keeps of its output (`sequence`: input + it,
        already joined, for a `ShadowTuner`)."""
        tuner = self.tuner
        if tuner_reads(tuner.config, session_key):
            if sequence is None:
                tuner.observe(session_key, input_tokens, output_tokens)
            else:
                tuner.observe(session_key, input_tokens, output_tokens, sequence=sequence)
        else:
            tuner.log.requests += 1  # counted where it falls in the stream, as the background child counts it
        self.advance(tuner.log.requests)

    def advance(self, requests: int) -> None:
        """Write the sync records up to `requests` fed (`feed` does; for a caller that feeds the
        tuner itself)."""
        self._recorder.advance(requests)

    def take(self, k: int) -> Choice | None:
        """Sync record k's choice (None if the tuner has not got there), dropping older ones."""
        index = self._records.pop(k, None)
        for old in [j for j in self._records if j < k]:
            del self._records[old]
        return None if index is None else self.tuner.choices[index]

    def adopted_after(self, released: int) -> Choice | None:
        """The choice a sync point adopts after the `released`-th release (None: no sync point)."""
        k = sync_point_of(released, self.sync_every)
        return None if k is None else self.take(record_adopted_at(k))


class _Miniatures:
    """The shadows at a fraction of their capacity, until the shadows fork (`ShadowTuner.mini`)."""

    def __init__(self, tuner: ShadowTuner, shared: _SharedShadow):
        self.tuner, self.shared = tuner, shared
        self.shadows: list[ShadowCache] = []
        self.served = 0
        self.served_at_fork: int | None = None
        c = tuner.config
        self.evidence = Evidence(len(tuner.choices), (c.half_life, c.guard_half_life))

    def done(self) -> bool:
        return self.served_at_fork is not None and self.served >= 2 * self.served_at_fork

    def serve(self, key: str, match: SharedMatch) -> None:
        self.served += 1
        input_len = match.input_len
        if self.shared is not None:
            hit, checkpoint_at = self.shared.lookup(match)
            try:
                self.shared.admit(match, checkpoint_at, input_len)
                return
            except _ForkNow:
                self.served_at_fork = self.served
                shared, self.shared = self.shared, None
                self.shadows = fork_shadows(self.tuner.profile, shared, self.tuner.choices, match, checkpoint_at,
                                            self.tuner.record)
            hits = [hit] * len(self.shadows)
        else:
            hits = []
            for shadow in self.shadows:
                hit, checkpoint_at = shadow.lookup(match)
                shadow.admit(match, checkpoint_at, input_len)
                hits.append(hit)
        self.evidence.add(key, *self.tuner.gains(hits, input_len))

    def leader(self) -> int | None:
        """The miniatures' leader (near-ties to the value-first choices) if it leads the safe choice
        by the margin over everything they saw since they forked; else None."""
        ev, c = self.evidence, self.tuner.config
        if not self.shadows or not ev.potential[LONG]:
            return None
        best = leading_arm(ev, c.tie)
        return best if best != 0 and ev.lead(best, 0, LONG, c.margin, 0.0, False) else None


class _ForkNow(Exception):
    """Raised by the shared shadow's eviction policy: the candidates are about to diverge."""


class _ForkBeforeEvicting(EvictionPolicy):
    name = "fork"
    # Every node any candidate could evict: if there is none, no candidate evicts either.
    evicts_single_child_nodes = True
    refresh_matched_path = False  # unused: _SharedShadow keeps both conventions

    def choose(self, candidates):
        raise _ForkNow


class _SharedShadow(ShadowCache):
    """Stands for every candidate until the first eviction. Recency is kept both ways: Marconi's
    (only the node hit is refreshed: `last_access`, `clock`) and SGLang's LRU (every node of the
    matched path: `path_access`, `path_clock`)."""

    __slots__ = ("path_access", "path_clock")  # as `ShadowCache`'s own

    def __init__(self, profile, capacity_bytes: int, *, checkpoint_grid: int, page_size: int, state_slots,
                 probation: bool = False, flops: FlopsTable | None = None):
        super().__init__(profile, capacity_bytes, _ForkBeforeEvicting(), checkpoint_grid=checkpoint_grid,
                         page_size=page_size, state_slots=state_slots, probation=probation, flops=flops)
        self.path_access: dict[int, float] = {}
        self.path_clock = 0.0

    def _touch_hit(self, path: list[ShadowNode], hit_node: ShadowNode) -> None:
        if hit_node is not self.root:
            self.clock += 1.0
            hit_node.last_access = self.clock
        for node in path:
            self.path_clock += 1.0
            self.path_access[node.id] = self.path_clock

    def _touch(self, node: ShadowNode) -> None:
        self.clock += 1.0
        node.last_access = self.clock
        self.path_clock += 1.0
        self.path_access[node.id] = self.path_clock

    def _add_leaf(self, parent: ShadowNode, match: SharedMatch, start: int, end: int) -> ShadowNode:
        leaf = super()._add_leaf(parent, match, start, end)
        self.path_access[leaf.id] = self.path_clock
        return leaf

    def _split(self, child: ShadowNode, k: int) -> ShadowNode:
        head = super()._split(child, k)
        self.path_access[head.id] = self.path_access.get(child.id, 0.0)
        return head

    def snapshot_as(self, eviction: EvictionPolicy):
        """This cache's contents with the recency `eviction` would have kept."""
        snap = self.snapshot()
        if not eviction.refresh_matched_path:
            return snap
        stamps = [self.path_access.get(node.id, 0.0) for node in self.nodes()]
        return replace(snap, last_access=stamps, clock=self.path_clock)

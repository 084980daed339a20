"""Continuous shadow tuning: which eviction choice the live cache should use, decided from one
shadow cache per candidate choice, all kept running on the same sample of sessions.

- Sampling (SHARDS-style): a session is in the sample when its hash falls below `sample_rate`
  (`policy/sampling.py`); the shadows see only sampled sessions, at capacity x `sample_rate`.
- One shared shadow until the first eviction: before any eviction every candidate holds exactly
  the same tree, so a single cache stands for all of them; it keeps both recency conventions
  (SGLang's LRU refreshes the whole matched path, Marconi only the node hit). Just before its
  first eviction it forks into one shadow per candidate, so a cache that never fills costs one
  shadow, not one per candidate.
- Candidates: SGLang's LRU, FLOP-aware eviction at each alpha of the grid (alpha = 0 is its own
  choice: LRU over Marconi's candidates, refreshing only the node hit), and SegLen-style eviction
  at each of its weights (`eviction/seglen.py`).
- Scores: per candidate, an exponentially decayed sum (half-life `half_life` sampled requests)
  of what its shadow saved on each sampled request: prefill FLOPs (`objective="flops"`) or hit
  tokens. Sums start at the fork (before it all candidates score the same). `potential` is the
  same decayed sum of what the requests could save at most (their whole inputs).
- Decisions: every `epoch` sampled requests after the fork, the leader (the last listed among the
  choices within `tie` x potential of the best) replaces the current choice only if it leads it by
  more than `margin` x potential (points, as the targets are) *and* by more than `z` standard
  errors of the decayed per-request differences (a paired test, so a few lucky hits early on do
  not make the live cache flap).

The tuner never touches the live cache: `observe()` returns the new choice when it switches and
the caller adopts it (`adopt_choice` for the policy core's cache, the serving runtime for
SGLang's). Decisions depend only on the stream of (session, input, output), so the simulator
and the server make the same ones for the same stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction, SegLenEviction
from sglang_marconi.policy.eviction.flop_aware import check_alpha
from sglang_marconi.policy.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.radix_tree import Node, Walk, as_token_array
from sglang_marconi.policy.sampling import check_rate, session_in_sample

LRU = "lru"  # the choice that stands for SGLang's LRU (leaves only, whole-path refresh)
SEGLEN = "seglen"  # "seglen:W": SegLen-style eviction with weight W (`eviction/seglen.py`)
OBJECTIVES = ("flops", "token_hit_rate")
Choice = float | str  # an alpha of FLOP-aware eviction, LRU, or "seglen:W"
# Large alphas matter: with both terms min-max normalized, alpha >> 1 ranks by FLOP efficiency
# first (recency breaks near-ties), which wins by 10-20 points on contended chat traces.
DEFAULT_ALPHA_GRID = (0.0, 1.0, 20.0, 100.0)
DEFAULT_SEGLEN_WEIGHTS = (1.0, 100.0)


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


def choice_label(choice: Choice) -> str:
    return choice if isinstance(choice, str) else f"{float(choice):g}"


def eviction_for(choice: Choice) -> EvictionPolicy:
    if choice == LRU:
        return LruLeafEviction()
    if isinstance(choice, str):
        return SegLenEviction(float(choice.partition(":")[2]))
    return FlopAwareEviction(float(choice))


def adopt_choice(cache: HybridPrefixCache, choice: Choice) -> None:
    """Switch a policy-core cache to `choice`; a change of weight alone keeps the policy object."""
    wanted = eviction_for(choice)
    if type(cache.eviction) is type(wanted) and not isinstance(wanted, LruLeafEviction):
        cache.eviction.alpha = wanted.alpha  # same score columns: only the weight changes
    elif type(cache.eviction) is not type(wanted):
        cache.set_eviction(wanted)


@dataclass(frozen=True)
class ShadowConfig:
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    seglen_weights: tuple[float, ...] = DEFAULT_SEGLEN_WEIGHTS  # SegLen-style candidates (may be empty)
    lru: bool = True  # SGLang's LRU is a candidate too (and the starting choice)
    objective: str = "flops"
    sample_rate: float = 1.0
    epoch: int = 4  # sampled requests between decisions
    half_life: float = 1000.0  # sampled requests
    margin: float = 0.005  # lead the leader needs, as a share of what the requests could save at most
    z: float = 1.0  # and this many standard errors of the paired differences
    tie: float = 0.01  # choices within this share (of the same) of the best score tie for the lead

    def __post_init__(self):
        if not self.alpha_grid:
            raise MarconiError("alpha_grid is empty")
        grid = tuple(sorted({check_alpha(a) for a in self.alpha_grid}))
        object.__setattr__(self, "alpha_grid", grid)
        object.__setattr__(self, "seglen_weights", tuple(sorted({check_alpha(w) for w in self.seglen_weights})))
        if self.objective not in OBJECTIVES:
            raise MarconiError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        check_rate(self.sample_rate)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise MarconiError(f"epoch must be an integer >= 1 (sampled requests), got {self.epoch!r}")
        for name in ("half_life", "margin", "z", "tie"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise MarconiError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.half_life > 0:
            raise MarconiError(f"half_life must be > 0, got {self.half_life!r}")

    @property
    def choices(self) -> tuple[Choice, ...]:
        """In the order ties are broken (the last of near-equals leads): LRU, the alphas, SegLen."""
        return ((LRU,) if self.lru else ()) + self.alpha_grid + tuple(map(seglen_choice, self.seglen_weights))

    @property
    def start(self) -> Choice:
        return self.choices[0]


@dataclass
class TunerLog:
    decisions: list[tuple[int, Choice]] = field(default_factory=list)  # (requests seen, choice adopted)
    requests: int = 0
    sampled: int = 0
    forked_at: int | None = None  # requests seen when the shared shadow forked
    seconds: float = 0.0  # time spent in observe()


class ShadowTuner:
    """Feed it every request (`observe`); it returns the choice to adopt whenever it switches."""

    def __init__(self, profile, capacity_bytes: int, config: ShadowConfig = ShadowConfig(), *,
                 checkpoint_grid: int = 1, page_size: int = 1, state_slots: int | None = None):
        """`capacity_bytes` (and `state_slots`, for two budgets: see `HybridPrefixCache`) are the
        live cache's; the shadows get them scaled by the sample rate."""
        self.profile = profile
        self.config = config
        self.choices = config.choices
        rate = config.sample_rate
        shadow_bytes = int(capacity_bytes * rate)
        shadow_slots = None if state_slots is None else max(2, round(state_slots * rate))
        if shadow_bytes < (2 * profile.ssm_state_bytes if state_slots is None else 1):
            raise MarconiError(
                f"sample_rate={rate} scales capacity {capacity_bytes} below one request's two "
                f"SSM states ({2 * profile.ssm_state_bytes} bytes); raise the sample rate"
            )
        self.shared: _SharedShadow | None = _SharedShadow(
            profile, shadow_bytes, checkpoint_grid=checkpoint_grid, page_size=page_size, state_slots=shadow_slots)
        self.shadows: list[HybridPrefixCache] = []
        self.current = config.start
        k = len(self.choices)
        self.scores = np.zeros(k)
        self.potential = 0.0  # decayed sum of what the sampled requests could save at most (whole inputs)
        self._sq = np.zeros((k, k))  # decayed squared paired differences (variance of score gaps)
        self._decay = 0.5 ** (1.0 / config.half_life)
        self._since_decision = 0
        self.log = TunerLog(decisions=[(0, self.current)])

    # -- the stream --------------------------------------------------------------------------
    def observe(self, session_key: str, input_tokens, output_tokens) -> Choice | None:
        """One served request. Returns the newly adopted choice, or None (no switch)."""
        self.log.requests += 1
        if not session_in_sample(session_key, self.config.sample_rate):
            return None
        started = time.perf_counter()
        try:
            return self._serve_sampled(as_token_array(input_tokens), np.asarray(output_tokens, dtype=np.int64))
        finally:
            self.log.seconds += time.perf_counter() - started

    def _serve_sampled(self, inp: np.ndarray, out: np.ndarray) -> Choice | None:
        self.log.sampled += 1
        seq = np.concatenate((inp, out)) if len(out) else inp
        if self.shared is not None:
            lookup = self.shared.lookup(inp)
            try:
                self.shared.admit(seq, lookup.checkpoint_at)
                return None
            except _ForkNow:
                self._fork(seq, lookup.checkpoint_at)
            hits = [lookup.hit_tokens] * len(self.shadows)
        else:
            hits = []
            for shadow in self.shadows:
                lookup = shadow.lookup(inp)
                shadow.admit(seq, lookup.checkpoint_at)
                hits.append(lookup.hit_tokens)
        self._score(hits, len(inp))
        self._since_decision += 1
        if self._since_decision >= self.config.epoch:
            self._since_decision = 0
            return self._decide()
        return None

    def _fork(self, seq: np.ndarray, checkpoint_at: int | None) -> None:
        shared, self.shared = self.shared, None
        self.log.forked_at = self.log.requests
        for choice in self.choices:
            eviction = eviction_for(choice)
            shadow = HybridPrefixCache.from_snapshot(self.profile, shared.snapshot_as(eviction), eviction)
            shadow.admit(seq, checkpoint_at)
            self.shadows.append(shadow)

    # -- scores and decisions ----------------------------------------------------------------
    def _score(self, hits: Sequence[int], input_len: int) -> None:
        if self.config.objective == "flops":
            memo: dict[int, float] = {0: 0.0}
            gains = np.array([memo[h] if h in memo else memo.setdefault(h, self.profile.prefill_flops(0, h))
                              for h in hits])
            whole = self.profile.prefill_flops(0, input_len)
        else:
            gains, whole = np.asarray(hits, dtype=float), float(input_len)
        d = self._decay
        self.scores *= d
        self.scores += gains
        self.potential = self.potential * d + whole
        self._sq *= d * d
        if gains.max() != gains.min():
            diff = gains[:, None] - gains[None, :]
            self._sq += diff * diff

    def leader(self) -> int:
        """Index of the choice to lead: among those within `tie` of the best score, the last listed
        (SegLen, then the largest alpha). Right after the fork the choices still behave alike, and
        the value-first ones are those whose gains show only later."""
        top = self.scores.max()
        return int(np.flatnonzero(self.scores >= top - self.config.tie * self.potential)[-1])

    def _decide(self) -> Choice | None:
        cur = self.choices.index(self.current)
        best = self.leader()
        if best == cur:
            return None
        gap = self.scores[best] - self.scores[cur]
        c = self.config
        if gap <= c.margin * self.potential or gap <= c.z * math.sqrt(self._sq[best, cur]):
            return None
        self.current = self.choices[best]
        self.log.decisions.append((self.log.requests, self.current))
        return self.current

    def score_table(self) -> dict[str, float]:
        """Each candidate's decayed score (FLOPs saved or hit tokens), by choice label."""
        return {choice_label(c): float(s) for c, s in zip(self.choices, self.scores)}


class _ForkNow(Exception):
    """Raised by the shared shadow's eviction policy: the candidates are about to diverge."""


class _ForkBeforeEvicting(EvictionPolicy):
    name = "fork"
    # Every node any candidate could evict: if there is none, no candidate evicts either.
    evicts_single_child_nodes = True
    refresh_matched_path = False  # unused: _SharedShadow keeps both conventions

    def choose(self, candidates):
        raise _ForkNow


class _SharedShadow(HybridPrefixCache):
    """Stands for every candidate until the first eviction. Recency is kept both ways: Marconi's
    (only the node hit is refreshed: `last_access`, `clock`) and SGLang's LRU (every node of the
    matched path: `path_access`, `path_clock`)."""

    def __init__(self, profile, capacity_bytes: int, *, checkpoint_grid: int, page_size: int, state_slots):
        super().__init__(profile, capacity_bytes, _ForkBeforeEvicting(),
                         checkpoint_grid=checkpoint_grid, page_size=page_size, state_slots=state_slots)
        self.path_access: dict[int, float] = {}
        self.path_clock = 0.0

    def _touch_hit(self, walk: Walk, hit_node: Node) -> None:
        if hit_node is not self.tree.root:
            self.clock += 1.0
            hit_node.last_access = self.clock
        for node in walk.path:
            self.path_clock += 1.0
            self.path_access[node.id] = self.path_clock

    def _touch(self, node: Node) -> None:
        self.clock += 1.0
        node.last_access = self.clock
        self.path_clock += 1.0
        self.path_access[node.id] = self.path_clock

    def _add_leaf(self, parent: Node, tokens: np.ndarray) -> Node:
        leaf = super()._add_leaf(parent, tokens)
        self.path_access[leaf.id] = self.path_clock
        return leaf

    def _split(self, child: Node, k: int) -> Node:
        head = super()._split(child, k)
        self.path_access[head.id] = self.path_access.get(child.id, 0.0)
        return head

    def snapshot_as(self, eviction: EvictionPolicy):
        """This cache's contents with the recency `eviction` would have kept."""
        snap = self.snapshot()
        if not eviction.refresh_matched_path:
            return snap
        stamps = [self.path_access.get(node.id, 0.0) for node in self.tree.nodes()]
        return replace(snap, last_access=stamps, clock=self.path_clock)

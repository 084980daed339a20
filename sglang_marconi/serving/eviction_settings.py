"""What the served cache evicts by: the eviction choice in force (one of the shadow tuner's
choices, `policy/tuning/shadow_tuner.py`), the model's FLOP/byte profile, the counters of what it did,
and the cache's fault protocol (`faults.py`). Engine-free.

The choice decides the rule:
- `"lru"`: SGLang's own LRU (upstream's walks; under KV pressure the index's recency-only pick,
  which is the same leaf);
- an alpha `A` (float): Marconi's FLOP-aware rule, `norm(recency) + A * norm(FLOPs saved per byte)`
  over the <= 1-child candidates (A = 0: LRU over those candidates, refreshing only the node hit);
- `"seglen:W"`: SegLen-style, `norm(recency) + W * norm(replay length back to the nearest state)`;
- `"coverage"` (`--marconi-eviction coverage`, fixed): SGLang #38000's rule under Mamba pressure
  (the state covering the fewest positions first, ties to the least recent;
  `policy/rules/eviction/coverage.py`), recency alone over the leaves under KV pressure;
- `"depth:B"` / `"depth:auto"` (`--marconi-eviction depth:B|depth:auto`, fixed): under either
  pressure the candidate with the largest age / (1 + depth)^B (`policy/rules/eviction/depth.py`),
  a node's depth read from the record of finished sequences (`continuation`), which the admission
  feeds once per finished request with what its last insert kept (`finished`), as the simulator's
  model of this cache does (`ServedCache.serve_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_marconi.policy.rules.continuation import ContinuationRecord
from sglang_marconi.policy.rules.eviction import SegLenEviction
from sglang_marconi.policy.rules.eviction.depth import depth_rule_of
from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha
from sglang_marconi.policy.tuning.shadow_tuner import COVERAGE, LRU, Choice, choice_label, eviction_for
from sglang_marconi.serving.faults import MarconiFaults
from sglang_marconi.serving.tree_index import node_end_token

KV_PRESSURE = "kv"
MAMBA_PRESSURE = "mamba"
BYTE_PRESSURE = "bytes"  # one byte budget short of Mamba bytes: victims of either kind


@dataclass
class EvictionCounters:
    evictions_leaf: int = 0  # leaves deleted whole (KV and state), under either pressure
    evictions_single_child: int = 0  # states tombstoned on single-child nodes (KV kept)
    evictions_fallback: int = 0  # Mamba pressure without Marconi candidates: upstream's LRU state
    evictions_probationary: int = 0  # probationary states, evicted first under Mamba pressure
    stale_repairs: int = 0  # chosen victims whose index entry was out of date (expected 0)
    # host tier (HiCache write_back, `host_tier.py`)
    states_demoted: int = 0  # SSM states copied to (or kept on) the host as they left the device
    states_dropped: int = 0  # SSM states that left the device with no host copy
    kv_tokens_demoted: int = 0  # KV tokens copied to the host as they left the device
    host_drops: int = 0  # device leaves dropped on both tiers (no state, or ranked below the host's)
    host_evictions: int = 0  # host candidates evicted to make room on the host
    states_evicted_host: int = 0  # SSM states among them
    states_loaded_back: int = 0  # SSM states loaded back from the host on a hit
    kv_tokens_loaded_back: int = 0  # KV tokens loaded back from the host on a hit
    device_hit_tokens: int = 0  # hit tokens found on the device
    host_hit_tokens: int = 0  # hit tokens loaded back from the host


@dataclass(frozen=True)
class MarconiVictim:
    """One eviction decision, reported to `MarconiEvictionSettings.observer` before it is made."""

    pressure: str  # KV_PRESSURE, MAMBA_PRESSURE or BYTE_PRESSURE
    kind: str  # "leaf", "single_child", "probationary" or "fallback"
    node: Any  # SGLang's UnifiedTreeNode, still untouched
    weight: float  # the rule's weight (alpha, or the SegLen weight; 0 for LRU)


class MarconiEvictionSettings:
    """The eviction choice in force and what the components need to apply it.

    `choice` may be changed at any time (the runtime does, at sync points); the next eviction
    uses it. `observer`, if set, is called with a `MarconiVictim` for every decision, before it
    is applied. `faults` is the cache's fault protocol; `faulted` says why this cache serves
    upstream's rules (a rank alone after an unrecoverable fault), None while it serves Marconi's.
    """

    def __init__(self, profile, choice: Choice = 0.0, observer: Optional[Callable[[MarconiVictim], None]] = None,
                 faults: Optional[MarconiFaults] = None):
        if isinstance(profile, str):
            from sglang_marconi.policy.cost.model_profile import load_profile

            profile = load_profile(profile)
        for attr in ("kv_bytes_per_token", "ssm_state_bytes", "prefill_flops"):
            if not hasattr(profile, attr):
                raise TypeError(f"profile {profile!r} has no {attr}")
        self.profile = profile
        self.counters = EvictionCounters()
        self.observer = observer
        self.probation = False  # probationary states at the end of each input (`admission.py`)
        self.faults = faults if faults is not None else MarconiFaults()
        self.continuation: ContinuationRecord | None = None  # kept from the first depth choice on
        self.choice = choice

    # -- the choice in force -------------------------------------------------------------------
    @property
    def choice(self) -> Choice:
        return self._choice

    @choice.setter
    def choice(self, choice: Choice) -> None:
        self.depth_rule = depth_rule_of(choice, self.continuation, node_end_token)
        if self.depth_rule is not None:
            self.continuation = self.depth_rule.record  # the stream's: it outlives a switch of rule
            self.kind, self.weight = "depth", 0.0
        elif choice == LRU:
            self.kind, self.weight = "lru", 0.0
        elif choice == COVERAGE:  # fewest positions covered first, ties by recency: no weight
            self.kind, self.weight = "coverage", 0.0
        else:
            eviction = eviction_for(choice)
            self.kind = "seglen" if isinstance(eviction, SegLenEviction) else "flops"
            self.weight = check_alpha(eviction.alpha)
        self._choice = choice

    def finished(self, tokens, kept: int) -> None:
        """A request finished, its last insert keeping tokens[:kept] (0: none): recorded, once a
        depth choice was ever in force."""
        if self.continuation is not None:
            self.continuation.finish(tokens, kept)

    @property
    def use_upstream_lru(self) -> bool:
        return self.kind == "lru"

    @property
    def value_kind(self) -> str:
        """The index's second column: "flops" (FLOPs saved per byte), "seglen" (replay length) or
        "coverage" (positions a state covers); the depth rule reads none (the cheapest is kept)."""
        if self.kind == "depth":
            return "seglen"
        return self.kind if self.kind in ("seglen", "coverage") else "flops"

    @property
    def alpha(self) -> float:
        """The FLOP-efficiency weight in force; 0 under LRU or SegLen (which have none)."""
        return self.weight if self.kind == "flops" else 0.0

    @property
    def label(self) -> str:
        return choice_label(self._choice)

    # -- faults ---------------------------------------------------------------------------------
    @property
    def faulted(self) -> Optional[str]:
        return self.faults.fallen_back

    def __repr__(self) -> str:
        return f"MarconiEvictionSettings(profile={getattr(self.profile, 'name', self.profile)!r}, choice={self.label})"

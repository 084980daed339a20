"""Marconi's serving flags: parsed by the launcher, carried to every scheduler process.

SGLang starts schedulers with `spawn`, so the settings travel in one environment variable
(JSON) that the plugin reads inside each scheduler. Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.backtrack_states import DEFAULT_PER_REQUEST, parse_backtrack_states
from sglang_marconi.policy.rules.cache_hints import DEFAULT_HINTED_SHARE
from sglang_marconi.policy.rules.eviction.depth import MAX_EXPONENT, depth_rule_of
from sglang_marconi.policy.rules.tier_rules import parse_host_depth
from sglang_marconi.policy.tuning.shadow_tuner import (
    DEFAULT_ALPHA_GRID, DEFAULT_SEGLEN_WEIGHTS, OBJECTIVES, ShadowConfig, parse_alpha_grid,
    parse_seglen_weights,
)

ENV_VAR = "SGLANG_MARCONI_CONFIG"
EVICTIONS = ("marconi", "coverage")


@dataclass(frozen=True)
class MarconiServingConfig:
    alpha: float | None = None  # None: tuned online ("auto")
    eviction: str = "marconi"  # "coverage": SGLang #38000's rule instead, fixed (a comparison configuration)
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    seglen_weights: tuple[float, ...] = DEFAULT_SEGLEN_WEIGHTS
    retune: bool = True  # off: adopt the tuner's first decision and stop tuning (the paper tunes once)
    objective: str = "flops"
    admission: bool = True  # Marconi's admission (<= 2 SSM states per request); off: upstream's
    probation: bool = True  # with admission: a probationary state at the end of each input (evicted first)
    tune_workers: int = 1  # 0: shadows on the scheduler thread (tests, debugging); >= 1: one background process
    tune_sample_rate: float = 1.0
    tune_epoch: int = ShadowConfig.epoch
    tune_margin: float = ShadowConfig.margin
    tune_timeout_s: float = 60.0  # a tuner that leaves a request it was handed unread this long is given up
    tune_sync_every: int = 32  # releases between sync points (where the leader's tuner decides)
    tune_sync_wait_s: float = 0.05  # the most a scheduler waits for the tuner at a sync point
    bootstrap_multiplier: float = 5.0  # checked, no effect: tuning has no bootstrap windows (the flag still parses)
    hinted_share: float = DEFAULT_HINTED_SHARE  # of each pool, at most, for client-hinted entries; 0: hints unused
    hint_horizon: int | None = None  # releases a hint's credit lasts; None: learned from the stream
    # "backtrack_states": --marconi-backtrack-states B, absent for auto; "host_depth": --marconi-host-depth, absent for off
    extra: dict = field(default_factory=dict)

    @property
    def backtrack_states(self) -> int | None:
        """Backtrack states per request (`policy/rules/backtrack_states.py`; 0: off); None: the
        rule's default for the Mamba strategy."""
        return (self.extra or {}).get("backtrack_states")

    @property
    def host_depth(self) -> float | str | None:
        """The host tier's continuation signal, `MarconiTiering(depth=...)` (--marconi-host-depth:
        a number B or "auto"); None: off."""
        return (self.extra or {}).get("host_depth")

    @property
    def fixed_choice(self):
        """The eviction choice to serve, or None when it is tuned online."""
        if self.eviction != "marconi":  # COVERAGE, or a depth choice ("depth:B", "depth:auto")
            return self.eviction
        return self.alpha

    def tuning(self) -> ShadowConfig:
        return ShadowConfig(alpha_grid=self.alpha_grid, seglen_weights=self.seglen_weights, objective=self.objective,
                            sample_rate=self.tune_sample_rate,
                            epoch=self.tune_epoch, margin=self.tune_margin)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ=os.environ) -> MarconiServingConfig:
        raw = environ.get(ENV_VAR)
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
            data["alpha_grid"] = tuple(data.get("alpha_grid", DEFAULT_ALPHA_GRID))
            data["seglen_weights"] = tuple(data.get("seglen_weights", DEFAULT_SEGLEN_WEIGHTS))
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise MarconiError(f"{ENV_VAR} holds no valid Marconi settings ({exc}): {raw[:200]!r}") from None


def _flag_error(flag: str, value, why: str) -> MarconiError:
    return MarconiError(f"{flag} {value!r}: {why}")


def _alpha(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise _flag_error("--marconi-alpha", text, "expected 'auto' or a number >= 0") from None
    if not value >= 0:
        raise _flag_error("--marconi-alpha", text, "must be >= 0")
    return value


def _grid(text: str) -> tuple[float, ...]:
    try:
        return parse_alpha_grid(text)
    except ValueError:
        raise _flag_error("--marconi-alpha-grid", text, "expected START:STOP:STEP or a comma list of alphas") from None


def _weights(text: str) -> tuple[float, ...]:
    try:
        weights = parse_seglen_weights(text)
    except ValueError:
        raise _flag_error("--marconi-seglen-weights", text, "expected a comma list of weights or 'none'") from None
    if not all(w >= 0 for w in weights):
        raise _flag_error("--marconi-seglen-weights", text, "weights must be >= 0")
    return weights


def _number(flag: str, text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise _flag_error(flag, text, f"expected {'an integer' if kind is int else 'a number'}") from None


def _eviction(text: str) -> str:
    if text in EVICTIONS:
        return text
    try:
        if depth_rule_of(text, None) is not None:
            return text
    except MarconiError:
        pass
    # argparse prints it in one line, after the flag's name
    raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(EVICTIONS)}, depth:B (0 <= B <= "
                                     f"{MAX_EXPONENT:g}) or depth:auto")


def add_marconi_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Marconi prefix caching")
    g.add_argument("--marconi-alpha", default="auto", help="FLOP-aware eviction weight, or 'auto' to tune online")
    g.add_argument("--marconi-eviction", default="marconi", type=_eviction,
                   help="marconi: FLOP-aware eviction (--marconi-alpha); coverage: SGLang PR #38000's rule (the "
                        "state covering the fewest positions first), fixed, with Marconi's admission; depth:B or "
                        "depth:auto: the oldest candidate relative to its conversation depth, age / (1 + depth)^B "
                        "(B learned with auto), fixed, with Marconi's admission")
    g.add_argument("--marconi-alpha-grid", default=",".join(f"{a:g}" for a in DEFAULT_ALPHA_GRID),
                   help="alphas the tuner's shadow caches run beside SGLang's LRU (START:STOP:STEP or list)")
    g.add_argument("--marconi-seglen-weights", default=",".join(f"{w:g}" for w in DEFAULT_SEGLEN_WEIGHTS),
                   help="weights of the SegLen-style candidates (recency + replay length), or 'none'")
    g.add_argument("--marconi-retune", default="on", help="on: follow the tuner; off: adopt its first decision only")
    g.add_argument("--marconi-objective", default="flops", help=f"tuning objective: {', '.join(OBJECTIVES)}")
    g.add_argument("--marconi-admission", default="on", help="on: at most two SSM states per request; off: upstream's")
    g.add_argument("--marconi-probation", default="on",
                   help="on: also keep the state at the end of each input on probation (evicted first, a reuse "
                        "confirms it), so a prefix used twice in a row hits at its second use; off: Marconi's two only")
    g.add_argument("--marconi-backtrack-states", default="auto",
                   help="B: up to B extra SSM states per request at the chunk ends of a long replay, on probation, "
                        "so an agent that comes back to an earlier point of its trajectory lands near it (0: off); "
                        f"auto: B={DEFAULT_PER_REQUEST} in extra_buffer, off in no_buffer")
    g.add_argument("--marconi-host-depth", default="off",
                   help="with --enable-hierarchical-cache --hicache-write-policy write_back: rank the host tier "
                        "by conversation depth, age / (1 + depth)^B (B, or 'auto' to fit B from the stream); "
                        "ahead where the host is contended, slightly behind where it is ample; off: by recency "
                        "and FLOPs saved per byte")
    g.add_argument("--marconi-tune-workers", default="1",
                   help="1: shadow caches in a background process; 0: on the scheduler thread (debugging)")
    g.add_argument("--marconi-tune-sample-rate", default="1", help="share of sessions the shadow caches see")
    g.add_argument("--marconi-tune-epoch", default=str(ShadowConfig.epoch), help="sampled requests between decisions")
    g.add_argument("--marconi-tune-margin", default=str(ShadowConfig.margin),
                   help="lead a choice needs over the current one, as a share of the most the requests could save")
    g.add_argument("--marconi-tune-sync-every", default=str(MarconiServingConfig.tune_sync_every),
                   help="releases between sync points: where the tuner's choice takes effect and TP/PP ranks agree")
    g.add_argument("--marconi-tune-sync-wait-ms", default=f"{MarconiServingConfig.tune_sync_wait_s * 1000:g}",
                   help="the most a scheduler waits for the tuner's verdict at a sync point (a late verdict is "
                        "taken at a later sync point)")
    g.add_argument("--marconi-tune-stall-timeout", default=f"{MarconiServingConfig.tune_timeout_s:g}",
                   help="seconds the tuner may leave a request unread before tuning stops (idle time never counts)")
    g.add_argument("--marconi-bootstrap-multiplier", default="5",
                   help="checked, no effect (tuning has no bootstrap windows)")
    g.add_argument("--marconi-hinted-share", default=f"{DEFAULT_HINTED_SHARE:g}",
                   help="share of each pool that entries kept for requests with a prompt_cache_key may hold "
                        "(0 to 1; 0: the hints are accepted and not used)")
    g.add_argument("--marconi-hint-horizon", default="auto",
                   help="requests a prompt_cache_key's credit lasts (x4 with prompt_cache_retention 24h), or "
                        "'auto': twice the median gap between a key's requests")


def _on_off(flag: str, text: str) -> bool:
    if text not in ("on", "off"):
        raise _flag_error(flag, text, "expected 'on' or 'off'")
    return text == "on"


def config_from_args(ns: argparse.Namespace) -> MarconiServingConfig:
    """Validate the flags; every error names the flag and the bad value."""
    multiplier = _number("--marconi-bootstrap-multiplier", ns.marconi_bootstrap_multiplier)
    if not multiplier > 0:
        raise _flag_error("--marconi-bootstrap-multiplier", ns.marconi_bootstrap_multiplier, "must be > 0")
    workers = _number("--marconi-tune-workers", ns.marconi_tune_workers, int)
    if workers < 0:
        raise _flag_error("--marconi-tune-workers", ns.marconi_tune_workers, "must be >= 0")
    sync_every = _number("--marconi-tune-sync-every", ns.marconi_tune_sync_every, int)
    if sync_every < 1:
        raise _flag_error("--marconi-tune-sync-every", ns.marconi_tune_sync_every, "must be >= 1")
    sync_wait_ms = _number("--marconi-tune-sync-wait-ms", ns.marconi_tune_sync_wait_ms)
    if not sync_wait_ms >= 0:
        raise _flag_error("--marconi-tune-sync-wait-ms", ns.marconi_tune_sync_wait_ms, "must be >= 0")
    share = _number("--marconi-hinted-share", ns.marconi_hinted_share)
    if not 0 <= share <= 1:
        raise _flag_error("--marconi-hinted-share", ns.marconi_hinted_share, "must be between 0 and 1")
    horizon = None if ns.marconi_hint_horizon == "auto" else _number("--marconi-hint-horizon",
                                                                     ns.marconi_hint_horizon, int)
    if horizon is not None and horizon < 1:
        raise _flag_error("--marconi-hint-horizon", ns.marconi_hint_horizon, "must be 'auto' or >= 1")
    if ns.marconi_eviction.startswith("depth:") and not _on_off("--marconi-admission", ns.marconi_admission):
        # the depth rule's record is fed by Marconi's admission as each request finishes
        raise _flag_error("--marconi-eviction", ns.marconi_eviction, "needs --marconi-admission on")
    backtrack = parse_backtrack_states(ns.marconi_backtrack_states)
    if backtrack and not (_on_off("--marconi-admission", ns.marconi_admission)
                          and _on_off("--marconi-probation", ns.marconi_probation)):
        # backtrack states are probationary states of Marconi's admission
        raise _flag_error("--marconi-backtrack-states", ns.marconi_backtrack_states,
                          "needs --marconi-admission on and --marconi-probation on")
    host_depth = parse_host_depth(getattr(ns, "marconi_host_depth", "off"))
    if host_depth is not None and not _on_off("--marconi-admission", ns.marconi_admission):
        # the host's depth order reads the record Marconi's admission feeds
        raise _flag_error("--marconi-host-depth", ns.marconi_host_depth, "needs --marconi-admission on")
    stall = _number("--marconi-tune-stall-timeout", ns.marconi_tune_stall_timeout)
    if not stall > 0:
        raise _flag_error("--marconi-tune-stall-timeout", ns.marconi_tune_stall_timeout, "must be > 0")
    config = MarconiServingConfig(
        alpha=_alpha(ns.marconi_alpha),
        eviction=ns.marconi_eviction,
        alpha_grid=_grid(ns.marconi_alpha_grid),
        seglen_weights=_weights(ns.marconi_seglen_weights),
        retune=_on_off("--marconi-retune", ns.marconi_retune),
        objective=ns.marconi_objective,
        admission=_on_off("--marconi-admission", ns.marconi_admission),
        probation=_on_off("--marconi-probation", ns.marconi_probation),
        tune_workers=workers,
        tune_sample_rate=_number("--marconi-tune-sample-rate", ns.marconi_tune_sample_rate),
        tune_epoch=_number("--marconi-tune-epoch", ns.marconi_tune_epoch, int),
        tune_margin=_number("--marconi-tune-margin", ns.marconi_tune_margin),
        tune_sync_every=sync_every,
        tune_sync_wait_s=sync_wait_ms / 1000,
        tune_timeout_s=stall,
        bootstrap_multiplier=multiplier,
        hinted_share=share,
        hint_horizon=horizon,
        extra={**({} if backtrack is None else {"backtrack_states": backtrack}),
               **({} if host_depth is None else {"host_depth": host_depth})},
    )
    try:
        config.tuning()  # the tuner's own checks, reported against the flags
    except MarconiError as exc:
        flag = {"objective": "--marconi-objective", "alpha": "--marconi-alpha-grid", "sampling rate":
                "--marconi-tune-sample-rate", "epoch": "--marconi-tune-epoch", "margin": "--marconi-tune-margin"}
        name = next((f for k, f in flag.items() if k in str(exc)), "--marconi-*")
        raise MarconiError(f"{name}: {exc}") from None
    return config

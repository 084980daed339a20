"""Marconi's serving flags: parsed by the launcher, carried to every scheduler process.

SGLang starts schedulers with `spawn`, so the settings travel in one environment variable
(JSON) that the plugin reads inside each scheduler. Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

from sglang_marconi.policy.alpha_tuner import DEFAULT_ALPHA_GRID, OBJECTIVES, TuningConfig, parse_alpha_grid
from sglang_marconi.policy.errors import MarconiError

ENV_VAR = "SGLANG_MARCONI_CONFIG"


@dataclass(frozen=True)
class MarconiServingConfig:
    alpha: float | None = None  # None: tuned online ("auto")
    bootstrap_multiplier: float = 5.0
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    retune: bool = True
    objective: str = "flops"
    admission: bool = True  # Marconi's admission (<= 2 SSM states per request); off: upstream's
    tune_workers: int = 2
    tune_sample_rate: float = 1.0
    tune_timeout_s: float = 600.0
    extra: dict = field(default_factory=dict)

    def tuning(self) -> TuningConfig:
        return TuningConfig(
            bootstrap_multiplier=self.bootstrap_multiplier, alpha_grid=self.alpha_grid, objective=self.objective,
            retune=self.retune, workers=self.tune_workers, sample_rate=self.tune_sample_rate,
            timeout_s=self.tune_timeout_s,
        )

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


def add_marconi_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Marconi prefix caching")
    g.add_argument("--marconi-alpha", default="auto", help="FLOP-aware eviction weight, or 'auto' to tune online")
    g.add_argument("--marconi-bootstrap-multiplier", default="5", help="tuning window = this x requests before the first eviction")
    g.add_argument("--marconi-alpha-grid", default="0:2:0.1", help="alphas the tuner replays (START:STOP:STEP or list)")
    g.add_argument("--marconi-retune", default="on", help="on: re-tune every window; off: tune once (the paper)")
    g.add_argument("--marconi-objective", default="flops", help=f"tuning objective: {', '.join(OBJECTIVES)}")
    g.add_argument("--marconi-admission", default="on", help="on: at most two SSM states per request; off: upstream's")
    g.add_argument("--marconi-tune-workers", default="2", help="worker processes for tuning replays")


def _on_off(flag: str, text: str) -> bool:
    if text not in ("on", "off"):
        raise _flag_error(flag, text, "expected 'on' or 'off'")
    return text == "on"


def config_from_args(ns: argparse.Namespace) -> MarconiServingConfig:
    """Validate the flags; every error names the flag and the bad value."""
    try:
        multiplier = float(ns.marconi_bootstrap_multiplier)
    except ValueError:
        raise _flag_error("--marconi-bootstrap-multiplier", ns.marconi_bootstrap_multiplier, "expected a number") from None
    try:
        workers = int(ns.marconi_tune_workers)
    except ValueError:
        raise _flag_error("--marconi-tune-workers", ns.marconi_tune_workers, "expected an integer") from None
    config = MarconiServingConfig(
        alpha=_alpha(ns.marconi_alpha),
        bootstrap_multiplier=multiplier,
        alpha_grid=_grid(ns.marconi_alpha_grid),
        retune=_on_off("--marconi-retune", ns.marconi_retune),
        objective=ns.marconi_objective,
        admission=_on_off("--marconi-admission", ns.marconi_admission),
        tune_workers=workers,
    )
    try:
        config.tuning()  # the tuner's own checks, reported against the flags
    except MarconiError as exc:
        flag = {"objective": "--marconi-objective", "bootstrap_multiplier": "--marconi-bootstrap-multiplier",
                "alpha": "--marconi-alpha-grid", "workers": "--marconi-tune-workers"}
        name = next((f for k, f in flag.items() if k in str(exc)), "--marconi-*")
        raise MarconiError(f"{name}: {exc}") from None
    return config

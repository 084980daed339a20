"""What online tuner a cache runs, as a small picklable value: the served runtime builds it on the
scheduler thread or sends it to the tuner's background process, which builds it there.

- `kind="hybrid"`: the shadow tuner over hybrid (SSM) caches (`shadow_tuner.ShadowTuner`: LRU,
  FLOP-aware eviction at each alpha, SegLen, depth-aware eviction), modelling the served pools
  (`state_slots`), grid, pages and probation; over the model of SGLang's cache (`served` in the
  options) with the choices `shadow_tuner.served_config` gives, the depth-aware ones and coverage
  included, as the `ShadowTuner` it builds runs them;
- `kind="window"`: alpha tuning of the sliding-window cache (`window_tuner.WindowTuner`).

Both expose the same interface: `observe(session_key, input, output)`, `current` (the choice in
force), `choices`, `log` (a `TunerLog`), `scores`, `score_table()`. Engine-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_marconi.policy.errors import MarconiError


@dataclass(frozen=True)
class TunerSpec:
    kind: str  # "hybrid" or "window"
    profile: object
    capacity_bytes: int
    config: object  # ShadowConfig
    options: dict = field(default_factory=dict)  # the tuner's keyword arguments

    def __post_init__(self):
        if self.kind == "hybrid" and self.options.get("served") is not None:
            from sglang_marconi.policy.tuning.shadow_tuner import served_config

            object.__setattr__(self, "config", served_config(self.config))  # the choices the tuner will run

    @property
    def choices(self) -> tuple:
        if self.kind == "window":
            return tuple(self.config.alpha_grid)
        return tuple(self.config.choices)

    @property
    def start(self):
        """The choice in force before the tuner's first decision."""
        return self.choices[0] if self.kind == "window" else self.config.start

    def build(self):
        if self.kind == "hybrid":
            from sglang_marconi.policy.tuning.shadow_tuner import ShadowTuner

            return ShadowTuner(self.profile, self.capacity_bytes, self.config, **self.options)
        if self.kind == "window":
            from sglang_marconi.policy.tree.window_cache import MARCONI
            from sglang_marconi.policy.tuning.window_tuner import WindowTuner

            return WindowTuner(self.profile, self.capacity_bytes, self.options.get("rules", MARCONI), self.config,
                               self.options.get("swa_share"), pools=self.options.get("pools"))
        raise MarconiError(f"unknown tuner kind {self.kind!r}: expected 'hybrid' or 'window'")

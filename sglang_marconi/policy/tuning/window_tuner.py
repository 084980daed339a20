"""Online alpha tuning for the sliding-window cache, with the shadow tuner's evidence.

One shadow per alpha of the grid (alpha 0: recency alone over Marconi's candidates, the safe
start) sees the sampled sessions at the pools x sample rate. With `pools` (SGLang's full-KV and
SWA token pools: the served runtime and the simulator's served policy) each shadow is the model
of the served cache, `served_window_cache.ServedWindowCache`, evicting by the rule the server
runs (`rules/window_plan.py`) and fed what the served cache keeps of a request (input +
output[:-1]); without, it is the one-budget `window_cache.WindowPrefixCache` under `rules` (the
simulator's paper-style policies), fed input + output. What each saved
on each request goes into the shadow tuner's `Evidence` (decayed long and short windows,
session-clustered errors, two halves of the clusters). Every `epoch` sampled requests:
- guard: a live alpha other than the start goes back to it as soon as the start leads it over the
  short window (`guard_margin`, `guard_z`);
- adoption: the long-window leader (near-ties, within `tie`, to the larger alpha) replaces the live
  alpha if it leads it by `margin` and `z` clustered errors in both halves, and no switch happened
  within `dwell` sampled requests.
Decisions depend only on the request stream. The caller adopts a returned alpha. The interface is
the shadow tuner's (`current`, `choices`, `log`, `scores`, `score_table()`), so the served runtime
runs either (`tuner_spec.TunerSpec`).
"""

from __future__ import annotations

import math

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tuning.sampling import session_in_sample
from sglang_marconi.policy.tuning.shadow_tuner import LONG, SHORT, Evidence, ShadowConfig, TunerLog, choice_label
from sglang_marconi.policy.tree.served_window_cache import ServedWindowCache
from sglang_marconi.policy.tree.window_cache import WindowPrefixCache, WindowRules


class WindowTuner:
    def __init__(self, profile, capacity_bytes: int, rules: WindowRules | None, config: ShadowConfig = ShadowConfig(),
                 swa_share: float | None = None, *, pools: tuple[int, int] | None = None,
                 chunk_size: int | None = None):
        self.profile, self.config = profile, config
        self.choices = tuple(config.alpha_grid)
        rate = config.sample_rate
        self.served = pools is not None
        self.scaled = self.served and rate < 1
        if self.served:
            kv_tokens, swa_tokens = pools
            if self.scaled:  # a shadow must hold a few windows whatever the sample rate
                floor = 4 * profile.sliding_window
                kv_tokens, swa_tokens = max(int(kv_tokens * rate), floor), max(int(swa_tokens * rate), floor)
            self.shadows = [ServedWindowCache(profile, kv_tokens, swa_tokens, alpha=a, chunk_size=chunk_size)
                            for a in self.choices]
        else:
            if rules is None:
                raise MarconiError("a one-budget window tuner needs its rules (or give pools: the served cache)")
            floor = math.ceil(4 * profile.sliding_window * profile.swa_kv_bytes_per_token / (swa_share or 1.0))
            capacity = max(int(capacity_bytes * rate), floor)
            self.shadows = [WindowPrefixCache(profile, capacity, rules, alpha=a, swa_share=swa_share)
                            for a in self.choices]
        self.evidence = Evidence(len(self.choices), (config.half_life, config.guard_half_life))
        self.index = 0  # of the alpha in force
        self.log = TunerLog()
        self._since_switch = 0
        self.last_hits: list[int] | None = None  # each alpha's shadow's hit on the last sampled request

    @property
    def alpha(self) -> float:
        return self.choices[self.index]

    current = alpha  # the choice in force, as the shadow tuner names it

    @property
    def decisions(self) -> list[tuple[int, float]]:
        return self.log.decisions

    @property
    def requests(self) -> int:
        return self.log.requests

    @property
    def sampled(self) -> int:
        return self.log.sampled

    @property
    def scores(self) -> np.ndarray:
        return self.evidence.scores[LONG]

    def score_table(self) -> dict[str, float]:
        return {choice_label(c): float(s) for c, s in zip(self.choices, self.scores)}

    def observe(self, session_key: str, input_tokens, output_tokens) -> float | None:
        self.log.requests += 1
        if not session_in_sample(str(session_key), self.config.sample_rate):
            return None
        self.log.sampled += 1
        self._since_switch += 1
        inp = np.asarray(input_tokens, dtype=np.int64)
        if self.served:  # output_tokens: what the served cache keeps of the output
            seq = np.concatenate((inp, np.asarray(output_tokens, dtype=np.int64)))
            hits = [self._served_hit(shadow, seq, len(inp)) for shadow in self.shadows]
        else:
            hits = [shadow.serve(inp, output_tokens)[0].hit_tokens for shadow in self.shadows]
        self.last_hits = hits
        if self.config.objective == "flops":
            whole = self.profile.prefill_flops(0, len(inp))
            gains = np.array([whole - self.profile.prefill_flops(h, len(inp)) for h in hits])
        else:
            whole, gains = float(len(inp)), np.asarray(hits, dtype=float)
        self.evidence.add(str(session_key), gains, whole)
        if self.log.sampled % self.config.epoch:
            return None
        return self._decide()

    def _served_hit(self, shadow: ServedWindowCache, seq: np.ndarray, n_in: int) -> int:
        """The shadow's hit. A shadow scaled below the served pools may not hold a request the
        server holds: that request counts as a miss there (the shadow stays consistent)."""
        try:
            return shadow.serve_kept(seq, n_in).hit_tokens
        except MarconiError:
            if not self.scaled:
                raise
            return 0

    def _decide(self) -> float | None:
        c, ev, cur = self.config, self.evidence, self.index
        if cur and ev.lead(0, cur, SHORT, c.guard_margin, c.guard_z):
            return self._switch(0)
        scores = ev.scores[LONG]
        leader = int(np.flatnonzero(scores >= scores.max() - c.tie * ev.potential[LONG])[-1])
        if leader == cur or self._since_switch < c.dwell:
            return None
        if ev.lead(leader, cur, LONG, c.margin, c.z) and (cur == 0 or ev.lead(leader, 0, LONG, c.margin, 0.0, False)):
            return self._switch(leader)
        return None

    def _switch(self, index: int) -> float:
        self.index = index
        self._since_switch = 0
        self.log.decisions.append((self.log.requests, self.alpha))
        return self.alpha

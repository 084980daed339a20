"""Policy names the CLI and benchmarks accept, and how each is built."""

from __future__ import annotations

from sglang_marconi.policy.alpha_tuner import TuningConfig
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.eviction.flop_aware import check_alpha
from sglang_marconi.sim.baselines.hybrid_radix import marconi, sglang_plus
from sglang_marconi.sim.baselines.infinite import InfiniteCache
from sglang_marconi.sim.baselines.no_cache import NoCache
from sglang_marconi.sim.baselines.vllm_plus import VllmPlusCache

POLICY_NAMES = ("none", "vllm+", "sglang+", "marconi", "infinite")
# Policies whose result does not depend on the cache capacity: run once, not per capacity.
CAPACITY_FREE = ("none", "infinite")


def check_policy_name(name: str) -> str:
    base, sep, alpha = name.partition(":")
    if base not in POLICY_NAMES or (sep and base != "marconi"):
        raise MarconiError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)} or marconi:ALPHA")
    if sep:
        try:
            check_alpha(float(alpha))
        except ValueError:
            raise MarconiError(f"policy {name!r}: alpha {alpha!r} is not a number") from None
    return name


def build_policy(name: str, profile, capacity_bytes: int, *, alpha: float | None = None, block_size: int = 32,
                 checkpoint_grid: int = 1, tuning: TuningConfig | None = None):
    """`marconi` tunes alpha unless `alpha` is given; `marconi:A` always fixes alpha = A."""
    base, _, fixed = check_policy_name(name).partition(":")
    if base == "none":
        return NoCache()
    if base == "infinite":
        return InfiniteCache()
    if base == "vllm+":
        return VllmPlusCache(profile, capacity_bytes, block_size=block_size)
    if base == "sglang+":
        return sglang_plus(profile, capacity_bytes, checkpoint_grid=checkpoint_grid)
    return marconi(profile, capacity_bytes, alpha=float(fixed) if fixed else alpha,
                   checkpoint_grid=checkpoint_grid, tuning=tuning)

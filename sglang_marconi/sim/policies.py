"""Policy names the CLI and benchmarks accept, and how each is built.

Hybrid policies (`POLICY_NAMES`) serve token requests (`build_policy` + `replay.replay`); KV-only
block caches (`kv-*`, `kv_blocks.registry`) replay a trace's hash ids (`kv_blocks.replay`).
"""

from __future__ import annotations

import re

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction.depth import check_exponent
from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha
from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy, coverage, marconi, sglang_plus
from sglang_marconi.sim.baselines.infinite import InfiniteCache
from sglang_marconi.sim.baselines.no_cache import NoCache
from sglang_marconi.sim.baselines.vllm_plus import VllmPlusCache
from sglang_marconi.sim.kv_blocks.registry import KV_POLICIES, is_kv_policy, parse_kv_spec

POLICY_NAMES = ("none", "vllm+", "sglang+", "coverage", "marconi", "marconi-best", "belady", "infinite", "furiosa",
                "depth")
# Policies a sliding-window (SWA) hybrid runs (`sim/baselines/swa_radix.py`); furiosa runs only there.
SWA_POLICY_NAMES = ("none", "furiosa", "sglang+", "marconi", "infinite")
# Policies whose result does not depend on the cache capacity: run once, not per capacity.
CAPACITY_FREE = ("none", "infinite")
# Policies with a host tier under `--host-capacity` (`sim/baselines/tiered_radix.py`).
HOST_TIER_POLICIES = ("sglang+", "marconi")


# a comma that starts the next policy, not the next `key=value` of a parameterized one
_POLICY_SEPARATOR = re.compile(r",(?!\s*[A-Za-z_][A-Za-z0-9_]*\s*=)")


def split_policies(text: str) -> list[str]:
    """`kv-lru,kv-s3fifo:small_ratio=0.2,max_freq=3,marconi:0.5` -> three policies: a comma
    followed by `key=` continues the parameters of the policy before it."""
    return [p.strip() for p in _POLICY_SEPARATOR.split(text) if p.strip()]


def check_policy_name(name: str) -> str:
    if is_kv_policy(name):
        parse_kv_spec(name)
        return name
    base, sep, alpha = name.partition(":")
    if base not in POLICY_NAMES or (sep and base not in ("marconi", "depth")) or (base == "depth" and not sep):
        raise MarconiError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}, marconi:ALPHA, "
                           f"depth:B, depth:auto or {', '.join(KV_POLICIES)}")
    if base == "depth":
        if alpha != "auto":
            try:
                check_exponent(float(alpha))
            except ValueError:
                raise MarconiError(f"policy {name!r}: exponent {alpha!r} is not a number or 'auto'") from None
        return name
    if sep:
        try:
            check_alpha(float(alpha))
        except ValueError:
            raise MarconiError(f"policy {name!r}: alpha {alpha!r} is not a number") from None
    return name


def has_host_tier(name: str) -> bool:
    return name.partition(":")[0] in HOST_TIER_POLICIES


# Policies the model of the served cache runs (`--kv-tokens` / `--mamba-slots`): SGLang's cache with
# the marconi backend under the choice `lru` (sglang+), a fixed alpha, or tuned; and the two bounds.
SERVED_POLICY_NAMES = ("none", "sglang+", "marconi", "coverage", "infinite")


def build_policy(name: str, profile, capacity_bytes: int, *, alpha: float | None = None, block_size: int = 32,
                 checkpoint_grid: int = 1, tuning: ShadowConfig | None = None, probation: bool = False,
                 swa_share: float | None = None, host_capacity: int | None = None, host_alpha: float | None = 1.0,
                 host_depth: float | str | None = None, served=None, sync_every: int = 32):
    """`marconi` tunes alpha unless `alpha` is given; `marconi:A` always fixes alpha = A.
    `probation`: SGLang+ and Marconi keep probationary states (`HybridPrefixCache`).
    A model with sliding-window layers runs the SWA policies (`swa_share`: a static split of the
    bytes between global and SWA KV; furiosa's default is proportional, the others' one budget).
    `host_capacity` (bytes, > 0) gives SGLang+ and Marconi a host tier (`host_alpha`: Marconi's
    host ranking weight, None to follow the device's alpha; `host_depth`, a number B or "auto":
    Marconi's host ranked by conversation depth instead, `tier_rules.MarconiTiering(depth=...)`).
    `served` (`ServedPools`): the policy is the model of SGLang's cache on those pools
    (`sim/baselines/served.py`; `capacity_bytes` unused), tuned choices adopted every `sync_every`
    requests as the server adopts them."""
    base, _, fixed = check_policy_name(name).partition(":")
    if served is not None and base not in ("none", "infinite"):
        return _build_served_policy(name, base, fixed, profile, served, alpha, tuning, probation, sync_every)
    if host_capacity:
        return _build_host_tier_policy(name, base, fixed, profile, capacity_bytes, host_capacity, alpha, host_alpha,
                                       checkpoint_grid, tuning, probation, host_depth)
    if getattr(profile, "has_sliding_window", False) and base not in ("none", "infinite"):
        return _build_swa_policy(name, base, fixed, profile, capacity_bytes, alpha, tuning, swa_share)
    if base == "furiosa":
        raise MarconiError(f"policy furiosa models sliding-window hybrids; {profile.name} has no sliding-window layers")
    if base == "marconi-best":
        raise MarconiError("marconi-best replays every candidate: use sim.hindsight.replay_best")
    if base == "belady":
        raise MarconiError("belady is an offline bound over the whole trace: use sim.baselines.belady.BeladyBound")
    if base == "none":
        return NoCache()
    if base == "infinite":
        return InfiniteCache()
    if base == "vllm+":
        return VllmPlusCache(profile, capacity_bytes, block_size=block_size)
    if base == "sglang+":
        return sglang_plus(profile, capacity_bytes, checkpoint_grid=checkpoint_grid, probation=probation)
    if base == "coverage":
        return coverage(profile, capacity_bytes, checkpoint_grid=checkpoint_grid, probation=probation)
    if base == "depth":  # a fixed depth-aware eviction (`eviction/depth.py`), its own record of finished sequences
        from sglang_marconi.policy.tuning.shadow_tuner import eviction_for

        return HybridRadixPolicy(name, profile, capacity_bytes, eviction_for(name), checkpoint_grid=checkpoint_grid,
                                 probation=probation)
    return marconi(profile, capacity_bytes, alpha=float(fixed) if fixed else alpha,
                   checkpoint_grid=checkpoint_grid, tuning=tuning, probation=probation)


def _build_host_tier_policy(name, base, fixed, profile, capacity_bytes, host_capacity, alpha, host_alpha,
                            checkpoint_grid, tuning, probation, host_depth=None):
    from sglang_marconi.sim.baselines.tiered_radix import marconi_host, sglang_plus_host

    if base not in HOST_TIER_POLICIES:
        raise MarconiError(f"policy {name!r} has no host-tier model; with a host capacity choose from "
                           f"{', '.join(HOST_TIER_POLICIES)} or marconi:ALPHA")
    if getattr(profile, "has_sliding_window", False):
        raise MarconiError(f"the host-tier model does not cover sliding-window layers ({profile.name})")
    if probation:
        raise MarconiError("the host-tier model does not keep probationary states (--probation)")
    if base == "sglang+":
        return sglang_plus_host(profile, capacity_bytes, host_capacity, checkpoint_grid=checkpoint_grid)
    return marconi_host(profile, capacity_bytes, host_capacity, alpha=float(fixed) if fixed else alpha,
                        host_alpha=host_alpha, host_depth=host_depth, checkpoint_grid=checkpoint_grid, tuning=tuning)


def _build_swa_policy(name, base, fixed, profile, capacity_bytes, alpha, tuning, swa_share):
    from sglang_marconi.sim.baselines.swa_radix import furiosa, marconi_swa, sglang_plus_swa

    if base not in SWA_POLICY_NAMES:
        raise MarconiError(f"policy {name!r} does not model sliding-window layers ({profile.name}); "
                           f"choose from {', '.join(SWA_POLICY_NAMES)} or marconi:ALPHA")
    if base == "furiosa":
        return furiosa(profile, capacity_bytes, swa_share=swa_share)
    if base == "sglang+":
        return sglang_plus_swa(profile, capacity_bytes, swa_share=swa_share)
    return marconi_swa(profile, capacity_bytes, alpha=float(fixed) if fixed else alpha, swa_share=swa_share,
                       tuning=tuning)


def _build_served_policy(name, base, fixed, profile, pools, alpha, tuning, probation, sync_every):
    from sglang_marconi.policy.tuning.shadow_tuner import COVERAGE, LRU
    from sglang_marconi.sim.baselines.served import ServedPolicy

    if getattr(profile, "has_sliding_window", False):
        raise MarconiError(f"the served-cache model covers SSM hybrids; {profile.name} has sliding-window layers")
    if base not in SERVED_POLICY_NAMES:
        raise MarconiError(f"policy {name!r} is not a configuration of the served cache; with --kv-tokens choose "
                           f"from {', '.join(SERVED_POLICY_NAMES)} or marconi:ALPHA")
    if base == "sglang+":
        return ServedPolicy("sglang+", profile, pools, LRU, probation=probation)
    if base == "coverage":  # `--marconi-eviction coverage`: SGLang #38000's rule with Marconi's admission
        return ServedPolicy("coverage", profile, pools, COVERAGE, probation=probation)
    a = float(fixed) if fixed else alpha
    if a is None:
        return ServedPolicy("marconi", profile, pools, tuning=tuning or ShadowConfig(), probation=probation,
                            sync_every=sync_every)
    return ServedPolicy(f"marconi(alpha={a:g})", profile, pools, a, probation=probation)

"""SGLang plugin entry point (group `sglang.srt.plugins`): registers the `marconi` radix-cache
backend in every process that loads plugins, the spawned schedulers included.

The factory builds SGLang's own `UnifiedRadixCache` with Marconi's components. Global +
sliding-window attention models without SSM layers get SGLang's SWA component with Marconi's
window eviction (`serving/swa_component.py`); other models without SSM layers get upstream's
default cache, and a hybrid model whose config we cannot interpret falls back to upstream's LRU
with one warning: never a crash.

Configurations in which Marconi cannot act fall back the same way: the factory builds exactly
what SGLang's default selection chain builds (`default_radix_cache_factory`), with no Marconi
runtime and no tuner process, logs one warning naming the flag, and `/server_info` shows
`marconi: {"marconi_eviction_policy": "upstream", "marconi_fallback": why}` (no gauges):
- `--enable-hierarchical-cache` other than `--hicache-write-policy write_back` with host pools in
  the tree: write_through / write_through_selective copy every node to the host as it is
  inserted, so a device eviction decides nothing (and `--hicache-host-memory-mode buffer_only`
  keeps no host values in the tree); an L3 `--hicache-storage-backend` prefetches and writes
  pages outside the tree's walks. With write_back (SGLang's default policy for hybrid models is
  write_through_selective; write_back must be asked for) Marconi decides the tiers:
  `host_tier.py` (what stays on the device, what is demoted to host memory, what is dropped);
- `--enable-session-radix-cache`: session-held nodes are fenced off in upstream's walks
  (`UnifiedTreeCore._session_lru_predicate`), not in Marconi's candidates;
- `--enable-lmcache`, `--enable-flexkv`: SGLang builds another cache class for these
  (`LMCacheUnifiedRadixCache`, `FlexKVRadixCache`, in `default_radix_cache_factory`); a
  registered backend would silently drop them;
- `--enable-unified-cache-external-linker`: offload on eviction (SGLang already refuses it with
  any `--radix-cache-backend`; kept here in case that check moves);
- `--radix-eviction-policy` other than `lru`: an explicit choice of upstream's victim order,
  which Marconi's own eviction would override;
- `--speculative-algorithm` EAGLE / NEXTN (`params.is_eagle`) on a model without SSM layers: SGLang
  keys that tree by bigrams, on which Marconi's window rules are not verified. With SSM layers
  speculative decoding is served: SGLang keys the tree by tokens there (`UnifiedTreeCore.is_eagle`
  is off with a Mamba component) and commits only the accepted draft step's state into the
  request's slot, so admission and eviction apply unchanged; a finished request whose last verify
  accepted tokens past its stop is kept out of the tree by SGLang and counted by the runtime
  (`runtime.speculative_skip`).
`--enable-unified-memory` is served: full KV and Mamba states share one byte buffer, the shadow
tuner models that one budget (`runtime.shadow_budget`), and a shortfall of Mamba bytes picks its
victim across both kinds, KV leaves and SSM states, by FLOPs saved per byte (`unified_memory.py`;
a KV shortfall evicts KV leaves, whose score already counts their state's bytes).
Each is read where SGLang's factory reads it (`ctx.enable_hierarchical_cache`,
`ctx.params.enable_session_radix_cache`, `ctx.params.eviction_policy`, `get_memory()`).
"""

from __future__ import annotations

import logging

from sglang_marconi.policy.errors import MarconiError

log = logging.getLogger("sglang_marconi")
BACKEND_NAME = "marconi"


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, marconi_radix_cache_factory)
    from sglang_marconi.serving.cache_hints import register_intake
    from sglang_marconi.serving.group_channel import register_hooks as register_group_channel
    from sglang_marconi.serving.metrics import register_hooks
    from sglang_marconi.serving.two_pass_prefill import install_two_pass_prefill_hook

    register_hooks()  # /server_info readback; the idle path (tuner's partial batch, gauges)
    register_group_channel()  # the leader's directives ride each iteration's requests
    install_two_pass_prefill_hook()  # end a prefill chunk at the branch (no_buffer mode)
    register_intake()  # prompt_cache_key / prompt_cache_retention from the HTTP routes (HTTP server process)


def served_model_profile(hf_config):
    """The cache model of the served model, or None (with a warning) if we cannot build one."""
    profile, why = _profile_or_reason(hf_config)
    if profile is None:
        log.warning("Marconi: %s; using upstream LRU eviction", why)
    return profile


def _profile_or_reason(hf_config):
    from sglang_marconi.policy.cost.model_profile import profile_from_config

    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    try:
        return profile_from_config(config, name=config.get("_name_or_path") or None), None
    except (MarconiError, KeyError, TypeError, ValueError) as exc:
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        return None, f"cannot model {arch} ({exc})"


# (flag, where SGLang's factory reads it): Marconi steps aside for upstream's cache when set.
_MEMORY_FLAGS = (
    ("--enable-lmcache", "enable_lmcache"),
    ("--enable-flexkv", "enable_flexkv"),
    ("--enable-unified-cache-external-linker", "enable_unified_cache_external_linker"),
)


def _memory_flag(ctx, name: str):
    try:
        from sglang.srt.runtime_context import get_memory

        return getattr(get_memory(), name)
    except (AttributeError, RuntimeError, ValueError):  # not published (a bare test context)
        return getattr(ctx.server_args, name, None)


def upstream_only_flags(ctx) -> list[str]:
    """The flags of this server with which Marconi cannot act (see the module docstring)."""
    flags = []
    if ctx.enable_hierarchical_cache:
        policy = _memory_flag(ctx, "hicache_write_policy")
        if policy != "write_back":
            flags.append(f"--enable-hierarchical-cache with --hicache-write-policy {policy}")
        if _memory_flag(ctx, "hicache_host_memory_mode") == "buffer_only":
            flags.append("--hicache-host-memory-mode buffer_only")
        if _memory_flag(ctx, "hicache_storage_backend"):
            flags.append("--hicache-storage-backend")
    if getattr(ctx.params, "enable_session_radix_cache", False):
        flags.append("--enable-session-radix-cache")
    flags += [flag for flag, name in _MEMORY_FLAGS if _memory_flag(ctx, name)]
    if getattr(ctx.params, "is_eagle", False) and not ctx.is_hybrid_ssm:
        # EAGLE / NEXTN key a tree without a Mamba component by bigrams (`UnifiedTreeCore.is_eagle`):
        # Marconi's SWA window rules are not verified on bigram keys. With SSM layers SGLang keys
        # the tree by tokens and commits the accepted draft step's state: served.
        flags.append("--speculative-algorithm EAGLE/NEXTN (no SSM layers: bigram tree keys)")
    policy = (getattr(ctx.params, "eviction_policy", None) or "lru").lower()
    if policy != "lru":
        flags.append(f"--radix-eviction-policy {policy}")
    return flags


def upstream_cache(ctx, why: str):
    """SGLang's default cache for `ctx`, marked with why Marconi stepped aside (one warning)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if ctx.tp_rank == 0 and getattr(ctx.params, "pp_rank", 0) == 0:  # once per server, not per rank
        log.warning("Marconi: %s; serving with SGLang's own cache and eviction (marconi_eviction_policy: upstream)",
                    why)
    cache = default_radix_cache_factory(ctx)
    try:
        cache.marconi_fallback = why
    except AttributeError:  # a cache class with __slots__: /server_info just shows no marconi entry
        pass
    return cache


def agree_on_settings(group, ctx) -> None:
    """Start-up: every rank of the group runs the same `sglang_marconi` source (a digest of the
    installed files: the version string does not change between commits) and was given the same
    Marconi settings (the raw SGLANG_MARCONI_CONFIG, before any rank parses it), or all refuse to
    start. Two agreements, so the error names which of the two differs."""
    import os

    from sglang_marconi.serving.config import ENV_VAR
    from sglang_marconi.serving.lockstep import settings_digest
    from sglang_marconi.serving.source_digest import package_source_digest

    group.agree_on_settings(settings_digest(package_source_digest()), "sglang_marconi source",
                            "install the same sglang_marconi files on every rank")
    group.agree_on_settings(settings_digest(os.environ.get(ENV_VAR, ""), getattr(ctx.params, "page_size", None)))


def marconi_radix_cache_factory(ctx):
    from sglang.srt.mem_cache.registry import create_unified_radix_cache, default_radix_cache_factory

    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.serving.lockstep import RankGroup

    swa_only = getattr(ctx, "is_hybrid_swa", False) and not ctx.is_hybrid_ssm and ctx.full_tokens_per_layer != 0
    if not (ctx.is_hybrid_ssm or swa_only) or ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    blockers = upstream_only_flags(ctx)
    if blockers:
        return upstream_cache(ctx, f"Marconi cannot act with {', '.join(blockers)}")
    # Every rank of a group reaches this line (what decided so far is the same on every rank);
    # what may differ from rank to rank (its environment) is agreed on before anything reads it.
    group = RankGroup.from_cache_params(ctx.params)
    agree_on_settings(group, ctx)
    if swa_only:  # global + sliding-window attention, no SSM layers (serving/swa_component.py)
        from sglang_marconi.serving.swa_component import marconi_swa_radix_cache_factory

        return marconi_swa_radix_cache_factory(ctx, MarconiServingConfig.from_env(), upstream_cache, group)
    profile, why = _profile_or_reason(ctx.model_config.hf_config)
    if profile is None:
        return upstream_cache(ctx, why)
    config = MarconiServingConfig.from_env()
    from sglang_marconi.serving.admission import admission_mixin
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.components import marconi_component_overrides
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings
    from sglang_marconi.serving.faults import MarconiFaults

    settings = MarconiEvictionSettings(profile=profile, choice=config.fixed_choice or 0.0,
                                       faults=MarconiFaults(group.size, group.rank))
    mixins = (admission_mixin(),) if config.admission else ()
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        **marconi_component_overrides(settings, mamba_mixins=mixins),
    }
    cache_class = marconi_cache_class()
    if _memory_flag(ctx, "enable_unified_memory"):  # one byte buffer for KV and Mamba states
        from sglang_marconi.serving.unified_memory import one_budget_cache_class

        cache_class = one_budget_cache_class()
    cache = create_unified_radix_cache(ctx, cache_class=cache_class)
    if getattr(cache, "cache_controller", None) is not None:  # HiCache write_back: Marconi's tiers
        from sglang_marconi.policy.rules.tier_rules import MarconiTiering
        from sglang_marconi.serving.host_tier import attach_host_tier

        attach_host_tier(cache, profile, MarconiTiering(depth=config.host_depth))  # --marconi-host-depth
    runtime = attach_runtime(cache, config, group=group)
    from sglang_marconi.serving.cache_hints import attach_hints

    attach_hints(cache, config)  # client cache hints (prompt_cache_key), within --marconi-hinted-share
    from sglang_marconi.serving.metrics import publishes_scheduler_metrics

    if publishes_scheduler_metrics():  # where SGLang publishes its own scheduler gauges
        from sglang_marconi.serving.metrics import PrometheusGauges, scheduler_metric_labels

        name = getattr(ctx.server_args, "served_model_name", None) or ctx.server_args.model_path
        runtime.exporter = PrometheusGauges(scheduler_metric_labels(served_model_name=str(name)))
    log.info("Marconi cache for %s: eviction=%s, admission=%s", profile.name,
             "auto" if config.fixed_choice is None else config.fixed_choice, "on" if config.admission else "off")
    return cache


def attach_runtime(cache, config, group=None):
    """Give a Marconi-built cache (its components made `cache.marconi`) its runtime: figures,
    tuning, lockstep. Returns the runtime."""
    from sglang_marconi.serving.runtime import MarconiRuntime

    state = cache.marconi
    grid = cache.components[_mamba()].mamba_checkpoint_grid
    state.config = config
    state.settings.probation = bool(config.admission and config.probation)
    state.eager_index_upkeep = bool(config.admission)
    state.runtime = MarconiRuntime(cache, state.settings, config, checkpoint_grid=grid, group=group)
    return state.runtime


def _mamba():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA

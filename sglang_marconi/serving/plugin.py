"""SGLang plugin entry point (group `sglang.srt.plugins`): registers the `marconi` radix-cache
backend in every process that loads plugins, the spawned schedulers included.

The factory builds SGLang's own `UnifiedRadixCache` with Marconi's components. Models without
SSM layers get upstream's default cache, and a hybrid model whose config we cannot interpret
falls back to upstream's LRU with one warning: never a crash.
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
    from sglang_marconi.serving.metrics import register_hooks
    from sglang_marconi.serving.two_pass_prefill import install_two_pass_prefill_hook

    register_hooks()
    from sglang_marconi.serving.idle_hook import register_idle_hook

    register_idle_hook()  # hand the tuner its partial batch and publish gauges while idle
    install_two_pass_prefill_hook()  # end a prefill chunk at the branch (no_buffer mode)


def served_model_profile(hf_config):
    """The cache model of the served model, or None (with a warning) if we cannot build one."""
    from sglang_marconi.policy.model_profile import profile_from_config

    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    try:
        return profile_from_config(config, name=config.get("_name_or_path") or None)
    except (MarconiError, KeyError, TypeError, ValueError) as exc:
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        log.warning("Marconi: cannot model %s (%s); using upstream LRU eviction", arch, exc)
        return None


def marconi_radix_cache_factory(ctx):
    from sglang.srt.mem_cache.registry import create_unified_radix_cache, default_radix_cache_factory

    from sglang_marconi.serving.config import MarconiServingConfig

    if not ctx.is_hybrid_ssm or ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    profile = served_model_profile(ctx.model_config.hf_config)
    if profile is None:
        return default_radix_cache_factory(ctx)
    config = MarconiServingConfig.from_env()
    from sglang_marconi.serving.admission import admission_mixin
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.eviction_components import MarconiEvictionSettings, marconi_component_overrides

    settings = MarconiEvictionSettings(profile=profile, alpha=config.alpha or 0.0)
    mixins = (admission_mixin(),) if config.admission else ()
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        **marconi_component_overrides(settings, mamba_mixins=mixins),
    }
    cache = create_unified_radix_cache(ctx, cache_class=marconi_cache_class())
    from sglang_marconi.serving.lockstep import RankGroup

    runtime = attach_runtime(cache, settings, config, group=RankGroup.from_cache_params(ctx.params))
    if getattr(ctx.server_args, "enable_metrics", False):
        from sglang_marconi.serving.metrics import PrometheusGauges

        name = getattr(ctx.server_args, "served_model_name", None) or ctx.server_args.model_path
        runtime.exporter = PrometheusGauges({"model_name": str(name)})
    log.info("Marconi cache for %s: alpha=%s, admission=%s", profile.name,
             "auto" if config.alpha is None else config.alpha, "on" if config.admission else "off")
    return cache


def attach_runtime(cache, settings, config, group=None):
    """Give a Marconi-built cache its runtime (figures, tuning); returns the runtime."""
    from sglang_marconi.serving.runtime import MarconiRuntime

    grid = cache.components[_mamba()].mamba_checkpoint_grid
    cache.marconi_settings = settings
    cache.marconi_config = config
    cache.marconi_eager_index_upkeep = bool(config.admission)
    cache.marconi_runtime = MarconiRuntime(cache, settings, config, checkpoint_grid=grid, group=group)
    return cache.marconi_runtime


def _mamba():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA

"""Fixtures building SGLang's real cache on CPU.

Test modules here start with `pytest.importorskip("sglang")`; this file imports SGLang only
inside its fixtures, so it loads (and the rest of the suite runs) without SGLang.
"""

import pytest


@pytest.fixture
def marconi_cache():
    """make(alpha=..., profile=..., observer=..., **build_cache kwargs) -> CpuCache with
    Marconi's FULL and MAMBA components; its settings are at `.settings`."""
    pytest.importorskip("sglang")
    from sglang_cpu import build_cache

    from sglang_marconi.serving.components import marconi_component_overrides
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings

    def make(alpha=0.0, profile="nemotron-h-8b", observer=None, **kwargs):
        from sglang_marconi.serving.cache import marconi_cache_class

        settings = MarconiEvictionSettings(profile, choice=alpha, observer=observer)
        cc = build_cache(component_registry_override=marconi_component_overrides(settings),
                         cache_class=kwargs.pop("cache_class", None) or marconi_cache_class(), **kwargs)
        cc.settings = settings
        return cc

    return make


@pytest.fixture
def upstream_cache():
    """make(**build_cache kwargs) -> CpuCache with SGLang's default (LRU) components."""
    pytest.importorskip("sglang")
    from sglang_cpu import build_cache

    return build_cache

"""The `marconi` backend's factory, called as SGLang's scheduler calls it (a real
TreeCacheBuildContext over CPU pools), and the served model's config -> cache model."""

import logging
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang_cpu import CpuCache, build_cache, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.plugin import marconi_radix_cache_factory, served_model_profile  # noqa: E402

warnings.filterwarnings("ignore")


def build_context(hf_config, *, hybrid=True):
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.server_args import ServerArgs

    params = build_cache(return_params=True)
    ctx = TreeCacheBuildContext(
        server_args=ServerArgs(model_path="dummy", page_size=1), params=params, is_hybrid_swa=False, is_hybrid_ssm=hybrid,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
        model_config=SimpleNamespace(hf_config=hf_config), tp_size=1, tp_rank=0, tp_group=None,
    )
    return ctx, params


def as_cpu_cache(cache, params):
    pool, alloc = params.req_to_token_pool, params.token_to_kv_pool_allocator
    return CpuCache(cache, alloc, pool, alloc.size, pool.mamba_pool.size, pool.size)


def test_hybrid_model_gets_the_marconi_cache():
    from transformers import NemotronHConfig

    ctx, params = build_context(NemotronHConfig())
    cache = marconi_radix_cache_factory(ctx)
    assert type(cache).__name__ == "MarconiUnifiedRadixCache"
    assert cache.marconi_runtime is not None and cache.marconi_settings.profile.n_ssm_layers >= 1
    cc = as_cpu_cache(cache, params)
    for i in range(3):
        run_request(cc, list(range(1, 500)) + [9000 + i] * 10, 4, chunk_end=chunk_end_for_branch)
        cc.check_no_leak()
    assert cache.marconi_runtime.figures.hit_tokens > 0  # the 3rd request reused the shared prefix


def test_unknown_hybrid_architecture_falls_back_to_upstream_with_a_warning(caplog):
    ctx, _ = build_context({"architectures": ["BrandNewHybridForCausalLM"], "model_type": "brand_new"})
    with caplog.at_level(logging.WARNING):
        cache = marconi_radix_cache_factory(ctx)
    assert type(cache).__name__ == "UnifiedRadixCache" and not hasattr(cache, "marconi_runtime")
    assert "BrandNewHybridForCausalLM" in caplog.text


def test_model_without_ssm_layers_gets_upstreams_default_cache():
    from transformers import LlamaConfig

    ctx, _ = build_context(LlamaConfig(), hybrid=False)
    cache = marconi_radix_cache_factory(ctx)
    assert not hasattr(cache, "marconi_runtime")


@pytest.mark.parametrize("name", ["NemotronHConfig", "Qwen3NextConfig", "FalconH1Config", "JambaConfig",
                                  "Zamba2Config", "GraniteMoeHybridConfig"])
def test_transformers_hybrid_configs_give_sensible_profiles(name):
    import transformers

    profile = served_model_profile(getattr(transformers, name)())
    assert profile is not None and profile.n_ssm_layers > 0 and profile.ssm_state_bytes > 0
    assert profile.prefill_flops(0, 1000) > 0
    assert profile.prefill_flops(0, 2000) > 2 * profile.prefill_flops(0, 1000) * 0.99

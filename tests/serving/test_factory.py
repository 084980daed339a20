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
    assert cache.marconi_runtime is not None and cache.marconi.settings.profile.n_ssm_layers >= 1
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


# -- configurations Marconi cannot act in: upstream's cache, one warning, honest /server_info ------

def publish(**server_args):
    """Publish these server args as the scheduler's (what `get_memory()` etc. read)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=1, **server_args)
    args._mamba_cache_chunk_size = 64  # the HF config would say (as sglang_cpu.build_cache)
    set_global_server_args_for_scheduler(args)
    return args


def hybrid_context(**server_args):
    from transformers import NemotronHConfig

    ctx, params = build_context(NemotronHConfig())
    ctx.server_args = publish(**server_args)
    # as kv_cache_builder.build_kv_cache fills them from the published args
    from sglang.srt.runtime_context import get_memory

    params.eviction_policy = get_memory().radix_eviction_policy
    params.enable_session_radix_cache = get_memory().enable_session_radix_cache
    ctx.enable_hierarchical_cache = get_memory().enable_hierarchical_cache
    return ctx, params


def fallback_warnings(caplog):
    return [r for r in caplog.records if r.name == "sglang_marconi" and r.levelno == logging.WARNING
            and "upstream" in r.getMessage()]


def no_marconi_in(params):
    return not any("Marconi" in cls.__name__ for cls in (params.component_registry_override or {}).values())


def state_entry(cache):
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from sglang_marconi.serving.metrics import add_marconi_state

    controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cache))
    return add_marconi_state(GetInternalStateReqOutput(internal_state={}), controller).internal_state.get("marconi")


@pytest.mark.parametrize("server_args, flag, check", [
    (dict(enable_session_radix_cache=True), "--enable-session-radix-cache",
     lambda cache: cache.enable_session_radix_cache and cache.tree_core.enable_session_radix_cache),
    (dict(radix_eviction_policy="lfu"), "--radix-eviction-policy lfu",
     lambda cache: type(cache.tree_core.eviction_strategy).__name__ == "LFUStrategy"),
    (dict(radix_eviction_policy="fifo"), "--radix-eviction-policy fifo",
     lambda cache: type(cache.tree_core.eviction_strategy).__name__ == "FIFOStrategy"),
])
def test_flag_marconi_cannot_act_with_gets_upstreams_cache(caplog, server_args, flag, check):
    import multiprocessing

    ctx, params = hybrid_context(**server_args)
    children = set(multiprocessing.active_children())
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        cache = marconi_radix_cache_factory(ctx)
    assert type(cache).__name__ == "UnifiedRadixCache" and check(cache)  # upstream's, configured as asked
    assert not hasattr(cache, "marconi_runtime") and no_marconi_in(params)
    assert set(multiprocessing.active_children()) == children  # no tuner process
    warnings_ = fallback_warnings(caplog)
    assert len(warnings_) == 1 and flag in warnings_[0].getMessage()
    assert state_entry(cache) == {"marconi_eviction_policy": "upstream", "marconi_fallback": cache.marconi_fallback}
    assert flag in cache.marconi_fallback
    cc = as_cpu_cache(cache, params)
    for i in range(3):  # and it serves
        run_request(cc, list(range(1, 400)) + [9000 + i] * 10, 4)
        cc.check_no_leak()


def test_speculative_decoding_on_a_hybrid_model_gets_the_marconi_cache_keyed_by_tokens():
    """EAGLE / NEXTN (`params.is_eagle`, NEXTN is EAGLE there): with a Mamba component SGLang keys
    the tree by tokens (`UnifiedTreeCore.is_eagle` off), so Marconi serves it; the live path is
    `tests/server/test_live_speculative.py`."""
    ctx, params = hybrid_context()
    params.is_eagle = True  # kv_cache_builder: spec_algorithm.is_eagle()
    cache = marconi_radix_cache_factory(ctx)
    assert type(cache).__name__ == "MarconiUnifiedRadixCache" and cache.marconi_runtime is not None
    assert cache.tree_core.is_eagle is False  # token keys, not bigrams
    cc = as_cpu_cache(cache, params)
    for i in range(3):
        run_request(cc, list(range(1, 400)) + [9000 + i] * 10, 4, chunk_end=chunk_end_for_branch)
        cc.check_no_leak()
    assert cache.marconi_runtime.figures.hit_tokens > 0


def test_speculative_decoding_without_ssm_layers_falls_back():
    """Without SSM layers SGLang keys an EAGLE tree by bigrams, on which Marconi's window rules are
    not verified: such a server keeps upstream's cache (one warning naming the flag)."""
    from sglang_marconi.serving.plugin import upstream_only_flags

    def ctx(hybrid_ssm):
        return SimpleNamespace(enable_hierarchical_cache=False, is_hybrid_ssm=hybrid_ssm, server_args=SimpleNamespace(),
                               params=SimpleNamespace(is_eagle=True, enable_session_radix_cache=False,
                                                      eviction_policy="lru"))

    assert upstream_only_flags(ctx(True)) == []
    assert any("--speculative-algorithm" in flag for flag in upstream_only_flags(ctx(False)))


def _outcome(factory, ctx):
    try:
        return type(factory(ctx)).__name__
    except Exception as exc:  # what upstream's path needs that this CPU machine lacks
        return type(exc).__name__, str(exc).splitlines()[0][:200]


@pytest.mark.parametrize("server_args, flag", [
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(enable_lmcache=True), "--enable-lmcache"),
    (dict(enable_flexkv=True), "--enable-flexkv"),
])
def test_storage_flags_take_upstreams_own_path(caplog, server_args, flag):
    """HiCache, LMCache and FlexKV need a GPU or packages this machine may lack: the `marconi`
    factory must end exactly where SGLang's default chain ends for the same context (the cache it
    builds, or the error it stops with), after one warning naming the flag."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    ctx, params = hybrid_context(**server_args)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        ours = _outcome(marconi_radix_cache_factory, ctx)
    assert no_marconi_in(params)
    warnings_ = fallback_warnings(caplog)
    assert len(warnings_) == 1 and flag in warnings_[0].getMessage()
    ctx, _ = hybrid_context(**server_args)
    assert ours == _outcome(default_radix_cache_factory, ctx)
    assert "Marconi" not in str(ours)


def test_plugin_path_routes_through_sglangs_registry(caplog):
    """`--radix-cache-backend marconi --enable-session-radix-cache` through SGLang's own routing
    (`create_tree_cache`, with its checks after the factory): upstream's session-capable cache."""
    from sglang.srt.mem_cache.registry import (
        create_tree_cache, get_radix_cache_factory, register_radix_cache_backend,
    )

    if get_radix_cache_factory("marconi") is None:
        register_radix_cache_backend("marconi", marconi_radix_cache_factory)
    ctx, _ = hybrid_context(radix_cache_backend="marconi", enable_session_radix_cache=True)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        cache = create_tree_cache(ctx)
    assert type(cache).__name__ == "UnifiedRadixCache" and cache.enable_session_radix_cache
    assert len(fallback_warnings(caplog)) == 1
    ctx, _ = hybrid_context(radix_cache_backend="marconi")
    assert type(create_tree_cache(ctx)).__name__ == "MarconiUnifiedRadixCache"  # and without the flag, ours


def test_only_the_first_rank_warns(caplog):
    ctx, _ = hybrid_context(radix_eviction_policy="lfu")
    ctx.tp_rank = 1
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        cache = marconi_radix_cache_factory(ctx)
    assert not fallback_warnings(caplog) and "--radix-eviction-policy lfu" in cache.marconi_fallback


def test_unknown_architecture_fallback_is_reported_in_server_info():
    ctx, _ = build_context({"architectures": ["BrandNewHybridForCausalLM"], "model_type": "brand_new"})
    cache = marconi_radix_cache_factory(ctx)
    entry = state_entry(cache)
    assert entry["marconi_eviction_policy"] == "upstream" and "BrandNewHybridForCausalLM" in entry["marconi_fallback"]

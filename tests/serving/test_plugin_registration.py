"""The `marconi` backend is registered through SGLang's plugin entry points, including inside a
spawned process (SGLang starts its schedulers with spawn)."""

import pytest

pytest.importorskip("sglang")


def _registered_after_load_plugins(queue):
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what every scheduler process does first
    queue.put(registered_radix_cache_backends())


def test_backend_registered_in_spawned_process():
    from sglang_cpu import result_in_spawned_process

    assert "marconi" in result_in_spawned_process(_registered_after_load_plugins)


def test_register_is_idempotent():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from sglang_marconi.serving.plugin import marconi_radix_cache_factory, register

    register()
    register()
    assert get_radix_cache_factory("marconi") is marconi_radix_cache_factory


def test_unknown_architecture_falls_back_with_a_warning(caplog):
    from sglang_marconi.serving.plugin import served_model_profile

    assert served_model_profile({"architectures": ["TotallyNewForCausalLM"], "model_type": "new"}) is None
    assert "TotallyNewForCausalLM" in caplog.text and "LRU" in caplog.text

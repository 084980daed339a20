"""Sliding-window layers in model profiles and Hugging Face config parsing."""

import math

import pytest

from sglang_marconi.policy.errors import ProfileError
from sglang_marconi.policy.cost.model_profile import load_profile, profile_from_config


def _gpt_oss_config(**over):
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
           "layer_types": ["sliding_attention", "full_attention"] * 2, "torch_dtype": "bfloat16"}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("name,full,swa,window,full_kv,swa_kv", [
    ("gpt-oss-20b", 12, 12, 128, 12 * 2 * 8 * 64 * 2, 12 * 2 * 8 * 64 * 2),
    ("gpt-oss-120b", 18, 18, 128, 18 * 2 * 8 * 64 * 2, 18 * 2 * 8 * 64 * 2),
    ("gemma-4-31b", 10, 50, 1024, 10 * 2 * 4 * 512 * 2, 50 * 2 * 16 * 256 * 2),
    ("mimo-v2-flash", 9, 39, 128, 9 * 4 * (192 + 128) * 2, 39 * 8 * (192 + 128) * 2),
])
def test_swa_builtin_layouts(name, full, swa, window, full_kv, swa_kv):
    p = load_profile(name)
    assert (p.n_attention_layers, p.n_swa_layers, p.sliding_window) == (full, swa, window)
    assert (p.kv_bytes_per_token, p.swa_kv_bytes_per_token) == (full_kv, swa_kv)
    assert p.has_sliding_window and p.n_ssm_layers == 0
    assert p.describe()["layers"]["swa"] == swa


def test_profiles_without_windows_are_unchanged():
    p = load_profile("llama-3-8b")
    assert not p.has_sliding_window and p.swa_kv_bytes_per_token == 0
    n, e, s = 1000, 5000, 4000
    assert p.prefill_flops(s, e) == float(p.linear_flops_per_token * n + p.attention_score_flops_coeff * n * (e + s))
    assert "swa" not in p.describe()["layers"] and "swa_attention" not in p.prefill_flops_by_kind(0, 10)


def test_window_wider_than_the_prefix_costs_as_global_attention():
    windowed = profile_from_config(_gpt_oss_config(sliding_window=10_000))
    global_only = profile_from_config(_gpt_oss_config(layer_types=["full_attention"] * 4))
    for a, b in ((0, 100), (50, 9_000), (0, 10_000)):
        assert windowed.prefill_flops(a, b) == global_only.prefill_flops(a, b)
    assert windowed.prefill_flops(0, 20_000) < global_only.prefill_flops(0, 20_000)


def test_swa_score_work_is_linear_past_the_window():
    p = profile_from_config(_gpt_oss_config())  # window 16
    global_only = profile_from_config(_gpt_oss_config(layer_types=["full_attention"] * 4, num_hidden_layers=4))
    # per token beyond the window, an SWA layer attends exactly `window` tokens: 8·d·w in this convention
    swa_part = lambda a, b: p.prefill_flops(a, b) - (p.linear_flops_per_token * (b - a)
                                                     + p.attention_score_flops_coeff * (b - a) * (a + b))
    assert swa_part(100, 101) == swa_part(5000, 5001) == p.swa_score_flops_coeff * 2 * 16
    assert swa_part(0, 16) == p.swa_score_flops_coeff * 16 ** 2
    assert math.isclose(p.prefill_flops(0, 50) + p.prefill_flops(50, 300), p.prefill_flops(0, 300))
    assert p.prefill_flops_array([0, 100], [16, 5000]).tolist() == [p.prefill_flops(0, 16), p.prefill_flops(100, 5000)]
    assert global_only.prefill_flops(0, 16) == p.prefill_flops(0, 16)


def test_layer_patterns_from_each_config_style():
    gemma = profile_from_config({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                                 "text_config": {"model_type": "gemma4_text", "hidden_size": 512,
                                                 "num_hidden_layers": 12, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "head_dim": 64,
                                                 "num_global_key_value_heads": 1, "global_head_dim": 128,
                                                 "intermediate_size": 1024, "sliding_window": 32,
                                                 "sliding_window_pattern": 6}})
    assert (gemma.n_attention_layers, gemma.n_swa_layers, gemma.sliding_window) == (2, 10, 32)
    assert gemma.kv_bytes_per_token == 2 * 2 * 1 * 128 * 2 and gemma.swa_kv_bytes_per_token == 10 * 2 * 2 * 64 * 2
    mimo = profile_from_config({"architectures": ["MiMoV2FlashForCausalLM"], "hidden_size": 256,
                                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
                                "head_dim": 48, "v_head_dim": 32, "swa_num_attention_heads": 4,
                                "swa_num_key_value_heads": 2, "swa_head_dim": 48, "swa_v_head_dim": 32,
                                "sliding_window_size": 8, "hybrid_layer_pattern": [0, 1, 1], "n_routed_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 64, "intermediate_size": 512,
                                "moe_layer_freq": [0, 1, 1]})
    assert (mimo.n_attention_layers, mimo.n_swa_layers, mimo.sliding_window) == (1, 2, 8)
    assert mimo.kv_bytes_per_token == 1 * (48 + 32) * 2 and mimo.n_moe_layers == 2 and mimo.n_mlp_layers == 1
    no_types = profile_from_config(_gpt_oss_config(layer_types=None))  # gpt-oss alternates from layer 0
    assert (no_types.n_attention_layers, no_types.n_swa_layers) == (2, 2)


@pytest.mark.parametrize("over,message", [
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "chunked_attention"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"sliding_window": None}, "lacks sliding_window"),
    ({"layer_types": ["sliding_attention"] * 3}, "3 entries for 4 layers"),
])
def test_bad_window_configs_name_the_value(over, message):
    with pytest.raises(ProfileError, match=message):
        profile_from_config(_gpt_oss_config(**over))

"""Model profiles: Table 1 of Marconi, additivity, the built-in profiles, config parsing, errors."""

import dataclasses
import json
import math

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError, ProfileError
from sglang_marconi.policy.cost.model_profile import (
    BUILTIN_PROFILE_NAMES,
    ModelProfile,
    load_profile,
    paper_hybrid_profile,
    profile_from_config,
)

try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is an optional test dependency
    given = None

D, N = 4096, 128
PAPER = load_profile("paper-7b")

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "torch_dtype": "bfloat16",
}


# --- Table 1 (paper-7b) ----------------------------------------------------------------------

def test_paper_7b_shape():
    p = PAPER
    assert (p.n_attention_layers, p.n_ssm_layers, p.n_mlp_layers, p.n_moe_layers) == (4, 24, 28, 0)
    assert p.dtype_bytes == p.ssm_dtype_bytes == 2
    assert p.hidden_size == D


@pytest.mark.parametrize("L", [1, 1000, 10_000, 100_000])
def test_paper_7b_per_layer_flops_match_table_1(L):
    by_kind = PAPER.prefill_flops_by_kind(0, L)
    assert by_kind["attention"] / 4 == 8 * L * D**2 + 4 * L**2 * D
    assert by_kind["mlp"] / 28 == 16 * L * D**2
    assert by_kind["ssm"] / 24 == 12 * L * D**2 + 16 * L * D * N + 10 * L * D
    assert PAPER.prefill_flops(0, L) == sum(by_kind.values())


def test_paper_7b_state_bytes_match_table_1():
    assert PAPER.kv_bytes_per_token / 4 == 4 * D  # K and V, fp16
    temporal = PAPER.ssm_temporal_bytes / 24
    conv = PAPER.ssm_conv_bytes / 24
    assert temporal == 2 * D * N
    assert conv == (2 * D + 2 * N) * 4 * 2
    assert temporal / (PAPER.kv_bytes_per_token / 4) == 64  # SSM state vs one token's KV, per layer
    share = PAPER.ssm_conv_bytes / PAPER.ssm_state_bytes
    assert abs(share - 0.061) < 0.001  # "~6.1% of the total for the 7B"


@pytest.mark.parametrize("L", [1000, 10_000])
def test_paper_7b_flops_saved_per_byte(L):
    by_kind = PAPER.prefill_flops_by_kind(0, L)
    attn_per_byte = (by_kind["attention"] / 4) / (L * PAPER.kv_bytes_per_token / 4)
    assert attn_per_byte == L + 2 * D  # L + 8192
    ssm_per_byte = (by_kind["ssm"] / 24) / (PAPER.ssm_temporal_bytes / 24)
    assert ssm_per_byte == pytest.approx(L * (6 * D / N + 8), rel=1e-3)
    assert ssm_per_byte == pytest.approx(200 * L, rel=1e-3)


def test_paper_hybrid_family():
    assert paper_hybrid_profile() == dataclasses.replace(PAPER, name=paper_hybrid_profile().name)
    pure = paper_hybrid_profile(n_attention=32, n_ssm=0)
    assert (pure.n_ssm_layers, pure.ssm_state_bytes, pure.n_mlp_layers) == (0, 0, 28)
    assert pure.kv_bytes_per_token == 32 * 4 * D
    small = paper_hybrid_profile(d_state=16)
    assert small.ssm_temporal_bytes == PAPER.ssm_temporal_bytes // 8
    ratio = paper_hybrid_profile(n_attention=2, n_ssm=16)
    assert (ratio.n_attention_layers, ratio.n_ssm_layers) == (2, 16)
    with pytest.raises(ProfileError):
        paper_hybrid_profile(n_attention=0, n_ssm=0)


# --- additivity and the vectorised form --------------------------------------------------------

def _assert_additive(p, a, b, c):
    ab, bc, ac = p.prefill_flops(a, b), p.prefill_flops(b, c), p.prefill_flops(a, c)
    assert math.isclose(ab + bc, ac, rel_tol=1e-12, abs_tol=1e-6)


@pytest.mark.parametrize("name", BUILTIN_PROFILE_NAMES)
@pytest.mark.parametrize("a,b,c", [(0, 0, 0), (0, 1, 2), (0, 512, 10_000), (77, 4096, 4097),
                                   (1000, 1000, 131_072), (3, 99_999, 2_000_000)])
def test_prefill_flops_additive(name, a, b, c):
    p = load_profile(name)
    _assert_additive(p, a, b, c)
    assert p.prefill_flops(b, b) == 0.0


if given is not None:
    @settings(max_examples=200, deadline=None)
    @given(name=st.sampled_from(BUILTIN_PROFILE_NAMES),
           xs=st.lists(st.integers(min_value=0, max_value=4_000_000), min_size=3, max_size=3))
    def test_prefill_flops_additive_hypothesis(name, xs):
        a, b, c = sorted(xs)
        _assert_additive(load_profile(name), a, b, c)


@pytest.mark.parametrize("name", BUILTIN_PROFILE_NAMES)
def test_prefill_flops_array_matches_scalar(name):
    p = load_profile(name)
    start = np.array([0, 0, 100, 5000, 7])
    end = np.array([0, 10_000, 100, 65_536, 8])
    got = p.prefill_flops_array(start, end)
    want = [p.prefill_flops(int(s), int(e)) for s, e in zip(start, end)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert p.prefill_flops_array(0, np.array([1, 2])).shape == (2,)  # broadcasts


def test_prefill_flops_grows_faster_than_linear():
    p = load_profile("llama-3-8b")
    assert p.prefill_flops(10_000, 20_000) > p.prefill_flops(0, 10_000)
    fractional = p.linear_flops_per_token * 1.5 + p.attention_score_flops_coeff * 2.25
    assert p.prefill_flops(0, 1.5) == pytest.approx(fractional)


# --- built-in profiles -------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTIN_PROFILE_NAMES)
def test_builtin_profiles_are_plausible(name):
    p = load_profile(name)
    assert isinstance(p, ModelProfile) and p.name == name
    assert p.n_attention_layers + p.n_ssm_layers > 0
    assert (p.kv_bytes_per_token > 0) == (p.n_attention_layers > 0)
    assert (p.ssm_state_bytes > 0) == (p.n_ssm_layers > 0)
    assert 0 <= p.ssm_conv_bytes < p.ssm_state_bytes or p.n_ssm_layers == 0
    per_token = p.prefill_flops(0, 10_000) / 10_000
    assert 1e9 < per_token < 1e11  # 2-billion-ish to 40-billion-ish active parameters
    summary = p.describe()
    json.dumps(summary)
    assert summary["layers"]["attention"] == p.n_attention_layers
    assert load_profile(name) is p  # cached


def test_builtin_names():
    assert set(BUILTIN_PROFILE_NAMES) >= {
        "paper-7b", "jamba-1.5-mini", "zamba2-7b", "nemotron-h-8b", "falcon-h1-7b",
        "qwen3-next-80b-a3b", "granite-4.0-h-small", "mamba2-2.7b", "llama-3-8b"}


@pytest.mark.parametrize("name,attn,ssm,kind,kv", [
    ("llama-3-8b", 32, 0, None, 32 * 2 * 8 * 128 * 2),
    ("nemotron-h-8b", 4, 24, "mamba2", 4 * 2 * 8 * 128 * 2),
    ("jamba-1.5-mini", 4, 28, "mamba1", 4 * 2 * 8 * 128 * 2),
    ("granite-4.0-h-small", 4, 36, "mamba2", 4 * 2 * 8 * 128 * 2),
    ("falcon-h1-7b", 44, 44, "mamba2", 44 * 2 * 2 * 128 * 2),
    ("qwen3-next-80b-a3b", 12, 36, "gated_delta_net", 12 * 2 * 2 * 256 * 2),
    ("zamba2-7b", 13, 81, "mamba2", 13 * 2 * 32 * 224 * 2),
    ("mamba2-2.7b", 0, 64, "mamba2", 0),
])
def test_builtin_layouts(name, attn, ssm, kind, kv):
    p = load_profile(name)
    assert (p.n_attention_layers, p.n_ssm_layers) == (attn, ssm)
    assert (p.ssm.kind if p.ssm else None) == kind
    assert p.kv_bytes_per_token == kv


def test_llama_3_8b_kv_is_128_kib():
    assert load_profile("llama-3-8b").kv_bytes_per_token == 128 * 1024


def test_nemotron_h_state_bytes():
    p = load_profile("nemotron-h-8b")
    assert (p.n_mlp_layers, p.n_moe_layers) == (24, 0)
    temporal = 128 * 64 * 128 * 2
    conv = (8192 + 2 * 8 * 128) * 3 * 2  # conv_kernel - 1 columns, as SGLang/vLLM allocate
    assert p.ssm_state_bytes == 24 * (temporal + conv)
    assert p.ssm_conv_bytes == 24 * conv


def test_qwen3_next_gated_delta_net_state():
    p = load_profile("qwen3-next-80b-a3b")
    assert p.n_moe_layers == 48 and p.n_mlp_layers == 0
    assert p.ssm_state_bytes == 36 * (32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 2)


def test_moe_layouts():
    jamba = load_profile("jamba-1.5-mini")
    assert (jamba.n_moe_layers, jamba.n_mlp_layers) == (16, 16)
    assert (jamba.moe.num_experts, jamba.moe.top_k) == (16, 2)
    granite = load_profile("granite-4.0-h-small")
    assert (granite.n_moe_layers, granite.moe.top_k, granite.moe.shared_intermediate_size) == (40, 10, 1536)


def test_ssm_state_dtype_override():
    bf16 = load_profile("nemotron-h-8b")
    fp32 = profile_from_config(dict(json.load(open(_profile_json("nemotron-h-8b")))), ssm_state_dtype="float32")
    assert fp32.ssm_temporal_bytes == 2 * bf16.ssm_temporal_bytes
    assert fp32.ssm_conv_bytes == bf16.ssm_conv_bytes
    cfg = dict(json.load(open(_profile_json("nemotron-h-8b"))), mamba_ssm_dtype="float32")
    assert profile_from_config(cfg).ssm_state_bytes == fp32.ssm_state_bytes


def _profile_json(name):
    from sglang_marconi.policy.cost import model_profile
    return model_profile._PROFILE_DIR / f"{name}.json"


# --- parsing configs ---------------------------------------------------------------------------

def test_gqa_reduces_kv_bytes():
    gqa = profile_from_config(LLAMA)
    mha = profile_from_config({**LLAMA, "num_key_value_heads": 32})
    assert mha.kv_bytes_per_token == 4 * gqa.kv_bytes_per_token
    assert mha.attention_score_flops_coeff == gqa.attention_score_flops_coeff


def test_dtype_bytes():
    assert profile_from_config({**LLAMA, "torch_dtype": "float32"}).kv_bytes_per_token == 256 * 1024
    assert profile_from_config({**LLAMA, "torch_dtype": "float16"}).kv_bytes_per_token == 128 * 1024
    with pytest.raises(ProfileError):
        profile_from_config({**LLAMA, "torch_dtype": "int3"})


def test_profile_from_config_path(tmp_path):
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    by_file = profile_from_config(model_dir / "config.json")
    by_dir = profile_from_config(str(model_dir))
    assert by_file.name == by_dir.name == "my-llama"
    assert by_file.kv_bytes_per_token == load_profile("llama-3-8b").kv_bytes_per_token
    assert load_profile(str(model_dir / "config.json")).kv_bytes_per_token == by_file.kv_bytes_per_token
    assert profile_from_config(LLAMA, name="x").name == "x"


def test_other_ssm_config_formats():
    hf_mamba2 = profile_from_config({
        "architectures": ["Mamba2ForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 64,
        "num_heads": 80, "head_dim": 64, "state_size": 128, "n_groups": 1, "conv_kernel": 4, "expand": 2})
    assert hf_mamba2.ssm_state_bytes == load_profile("mamba2-2.7b").ssm_state_bytes
    hf_mamba1 = profile_from_config({
        "architectures": ["MambaForCausalLM"], "hidden_size": 768, "num_hidden_layers": 24,
        "state_size": 16, "conv_kernel": 4, "expand": 2})
    assert hf_mamba1.ssm_state_bytes == 24 * (1536 * 16 * 2 + 1536 * 3 * 2)
    wrapped = profile_from_config({"architectures": ["LlamaForCausalLM"], "text_config": LLAMA})
    assert wrapped.kv_bytes_per_token == 128 * 1024


def test_nemotron_moe_pattern():
    cfg = dict(json.load(open(_profile_json("nemotron-h-8b"))))
    cfg.update(hybrid_override_pattern="M*EM", num_hidden_layers=4, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024)
    p = profile_from_config(cfg)
    assert (p.n_ssm_layers, p.n_attention_layers, p.n_moe_layers, p.n_mlp_layers) == (2, 1, 1, 0)
    assert p.moe.flops_per_token() == 2 * 4 * 4096 * 512 + 4 * 4096 * 1024 + 2 * 4096 * 8


# --- errors ------------------------------------------------------------------------------------

def test_unknown_profile_name_lists_known_names():
    with pytest.raises(ProfileError) as err:
        load_profile("gpt-5")
    assert "gpt-5" in str(err.value) and "llama-3-8b" in str(err.value) and "paper-7b" in str(err.value)


def test_unknown_architecture_is_named():
    with pytest.raises(ProfileError, match="GPT2LMHeadModel"):
        profile_from_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768})


def test_missing_field_and_bad_pattern():
    with pytest.raises(ProfileError, match="intermediate_size"):
        profile_from_config({k: v for k, v in LLAMA.items() if k != "intermediate_size"})
    cfg = dict(json.load(open(_profile_json("nemotron-h-8b"))), hybrid_override_pattern="M*-")
    with pytest.raises(ProfileError, match="3 entries for 52 layers"):
        profile_from_config(cfg)
    with pytest.raises(ProfileError):
        profile_from_config("/nonexistent/config.json")


@pytest.mark.parametrize("start,end", [(-1, 5), (5, 4), (float("nan"), 3)])
def test_bad_token_range(start, end):
    with pytest.raises(MarconiError):
        PAPER.prefill_flops(start, end)
    with pytest.raises(ValueError):  # MarconiError is a ValueError
        PAPER.prefill_flops_array(np.array([0, start]), np.array([1, end]))


def test_profile_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PAPER.kv_bytes_per_token = 1

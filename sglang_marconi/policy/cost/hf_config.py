"""Read a Hugging Face-style ``config.json`` into the layer inventory a ModelProfile needs.

Plain dict work: no torch, no transformers. ``parse_config`` returns a dict of plain values
(layer counts and dimensions per layer kind); ``model_profile`` turns it into FLOP and byte
formulas. Where a config omits a secondary field, the default of the matching transformers
config class (or of ``mamba_ssm`` for its own format) is used; the core dimensions are required.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from sglang_marconi.policy.errors import ProfileError

_DTYPE_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
}
DEFAULT_DTYPE = "bfloat16"  # assumed when a config names no dtype (e.g. mamba_ssm configs)
_MISSING = object()


def load_config(config: dict | str | os.PathLike) -> tuple[dict, str | None]:
    """Return (config dict, name hint). A path may be a JSON file or a directory holding config.json."""
    if isinstance(config, dict):
        return dict(config), None
    if not isinstance(config, (str, os.PathLike)):
        raise ProfileError(f"config must be a dict or a path to config.json, got {type(config).__name__}")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ProfileError(f"no config file at {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read model config {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"model config {str(path)!r} is not a JSON object")
    hint = path.parent.name if path.name == "config.json" else path.stem
    return data, hint or None


def dtype_bytes(name: Any, what: str = "dtype") -> int:
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ProfileError(f"unknown {what} {name!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


class _Cfg:
    """A config dict with 'first present key' lookups and errors that name the model."""

    def __init__(self, data: dict, label: str):
        self.data, self.label = data, label

    def get(self, *keys: str, default: Any = None) -> Any:
        for key in keys:
            value = self.data.get(key)
            if value is not None:
                return value
        return default

    def req(self, *keys: str) -> Any:
        value = self.get(*keys, default=_MISSING)
        if value is _MISSING:
            raise ProfileError(f"{self.label}: config lacks {' / '.join(keys)}")
        return value

    def int(self, *keys: str, default: Any = _MISSING) -> int:
        value = self.req(*keys) if default is _MISSING else self.get(*keys, default=default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ProfileError(f"{self.label}: {keys[0]} must be an integer, got {value!r}") from None


# --- shared pieces ---------------------------------------------------------------------------

def _attention(c: _Cfg, n_layers: int, *, d_in: int | None = None, q_mult: int = 1,
               head_dim_keys: tuple[str, ...] = ("head_dim",), head_dim_default: int | None = None,
               extra_flops: int = 0) -> dict:
    d = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", default=heads)
    head_dim = c.int(*head_dim_keys, default=head_dim_default or d // heads)
    return dict(n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                d_in=d_in or d, d_out=d, q_mult=q_mult, extra_flops_per_token=extra_flops)


def _mamba2(c: _Cfg, n_layers: int, *, heads: int, head_dim: int, groups: int, state: int,
            conv: int) -> dict:
    return dict(kind="mamba2", n_layers=n_layers, d_model=c.int("hidden_size", "d_model"),
                n_heads=heads, head_dim=head_dim, n_groups=groups, d_state=state, conv_kernel=conv)


def _auto_head_dim(value: Any, d_inner: int, heads: int) -> int:
    return d_inner // heads if value in (None, "auto") else int(value)


def _counts(kinds: list[str], n_layers: int, label: str) -> dict[str, int]:
    if len(kinds) != n_layers:
        raise ProfileError(f"{label}: layer pattern has {len(kinds)} entries for {n_layers} layers")
    out: dict[str, int] = {}
    for kind in kinds:
        out[kind] = out.get(kind, 0) + 1
    return out


def _layer_kinds(c: _Cfg, n_layers: int, aliases: dict[str, str]) -> dict[str, int]:
    """Count layer kinds from layer_types / layers_block_type, or the trimmed `_layer_type_counts`."""
    counts = c.get("_layer_type_counts")
    if counts is not None:
        out = {aliases.get(str(k), str(k)): int(v) for k, v in counts.items()}
        if sum(out.values()) != n_layers:
            raise ProfileError(f"{c.label}: _layer_type_counts sum to {sum(out.values())}, not {n_layers}")
    else:
        kinds = c.req("layer_types", "layers_block_type")
        out = _counts([aliases.get(str(k), str(k)) for k in kinds], n_layers, c.label)
    unknown = set(out) - set(aliases.values())
    if unknown:
        raise ProfileError(f"{c.label}: unknown layer types {sorted(unknown)}")
    return out


# --- architectures ---------------------------------------------------------------------------

def _dense(c: _Cfg) -> dict:
    n = c.int("num_hidden_layers")
    return dict(attention=_attention(c, n),
                mlp=dict(n_layers=n, intermediate_size=c.int("intermediate_size"), gated=True))


def _jamba(c: _Cfg) -> dict:
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    period, offset = c.int("attn_layer_period", default=8), c.int("attn_layer_offset", default=4)
    n_attn = sum(1 for i in range(n) if i % period == offset)
    experts = c.int("num_experts", default=16)
    e_period, e_offset = c.int("expert_layer_period", default=2), c.int("expert_layer_offset", default=1)
    n_moe = sum(1 for i in range(n) if i % e_period == e_offset) if experts > 1 else 0
    dt_rank = c.get("mamba_dt_rank", default="auto")
    ffn = c.int("intermediate_size", default=14336)
    return dict(
        attention=_attention(c, n_attn),
        ssm=dict(kind="mamba1", n_layers=n - n_attn, d_model=d,
                 d_inner=c.int("mamba_expand", default=2) * d, d_state=c.int("mamba_d_state", default=16),
                 conv_kernel=c.int("mamba_d_conv", default=4),
                 dt_rank=math.ceil(d / 16) if dt_rank == "auto" else int(dt_rank)),
        mlp=dict(n_layers=n - n_moe, intermediate_size=ffn, gated=True),
        moe=dict(n_layers=n_moe, num_experts=experts, top_k=c.int("num_experts_per_tok", default=2),
                 expert_intermediate_size=ffn, shared_intermediate_size=0, gated=True),
    )


def _zamba2(c: _Cfg) -> dict:
    """Every layer is a Mamba2 block; hybrid layers also run a shared transformer block whose
    attention reads concat(hidden, embeddings) (2·D wide) and keeps its own KV cache, followed by
    a gated MLP and a D×D output linear. LoRA adapters on the shared block are ignored (rank ≪ D)."""
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    ids = c.get("hybrid_layer_ids")
    if ids is None:
        ids = [i for i, t in enumerate(c.req("layers_block_type")) if t == "hybrid"]
    n_hybrid = len(ids)
    heads = c.int("n_mamba_heads", default=8)
    d_inner = c.int("mamba_expand", default=2) * d
    mamba = _mamba2(c, n, heads=heads, head_dim=_auto_head_dim(c.get("mamba_headdim"), d_inner, heads),
                    groups=c.int("mamba_ngroups", default=1), state=c.int("mamba_d_state", default=64),
                    conv=c.int("mamba_d_conv", default=4))
    attn = _attention(c, n_hybrid, d_in=c.int("attention_hidden_size", default=2 * d),
                      head_dim_keys=("attention_head_dim",),
                      head_dim_default=2 * d // c.int("num_attention_heads"), extra_flops=2 * d * d)
    return dict(attention=attn, ssm=mamba,
                mlp=dict(n_layers=n_hybrid, gated=True,
                         intermediate_size=c.int("intermediate_size", "ffn_hidden_size", default=4 * d)))


# transformers >= 5 spells Nemotron-H's layout as a list (layers_block_type); checkpoints use the string.
_NEMOTRON_BLOCKS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                    "mlp": "-", "moe": "E"}


def _nemotron_h(c: _Cfg) -> dict:
    """hybrid_override_pattern: M = Mamba2, * = attention, - = MLP (ReLU², not gated), E = MoE."""
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        blocks = list(c.req("layers_block_type"))
        pattern = [_NEMOTRON_BLOCKS.get(str(b), str(b)) for b in blocks]
    n = c.int("num_hidden_layers", default=len(pattern))
    counts = _counts(list(pattern), n, c.label)
    unknown = set(counts) - set("M*-E")
    if unknown:
        raise ProfileError(f"{c.label}: unknown hybrid_override_pattern symbols {sorted(unknown)}")
    out = dict(
        attention=_attention(c, counts.get("*", 0), head_dim_keys=("attention_head_dim", "head_dim")),
        ssm=_mamba2(c, counts.get("M", 0), heads=c.int("mamba_num_heads"), head_dim=c.int("mamba_head_dim"),
                    groups=c.int("n_groups", default=8), state=c.int("ssm_state_size"),
                    conv=c.int("conv_kernel", default=4)),
        mlp=dict(n_layers=counts.get("-", 0), intermediate_size=c.int("intermediate_size"), gated=False),
    )
    if counts.get("E"):
        shared = c.int("moe_shared_expert_intermediate_size", default=0) * c.int("n_shared_experts", default=1)
        out["moe"] = dict(n_layers=counts["E"], num_experts=c.int("n_routed_experts"),
                          top_k=c.int("num_experts_per_tok"),
                          expert_intermediate_size=c.int("moe_intermediate_size"),
                          shared_intermediate_size=shared, gated=False)
    return out


def _falcon_h1(c: _Cfg) -> dict:
    """Every layer runs attention and Mamba2 in parallel, then a gated MLP."""
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    heads = c.int("mamba_n_heads", default=128)
    d_ssm = c.int("mamba_d_ssm", default=c.int("mamba_expand", default=2) * d)
    return dict(
        attention=_attention(c, n),
        ssm=_mamba2(c, n, heads=heads, head_dim=_auto_head_dim(c.get("mamba_d_head"), d_ssm, heads),
                    groups=c.int("mamba_n_groups", default=1), state=c.int("mamba_d_state", default=256),
                    conv=c.int("mamba_d_conv", default=4)),
        mlp=dict(n_layers=n, intermediate_size=c.int("intermediate_size"), gated=True),
    )


def _qwen3_next(c: _Cfg) -> dict:
    """Gated DeltaNet ("linear_attention") and gated full attention (q_proj also emits an output
    gate, so q is 2·H·hd wide); each layer's MLP is a sparse MoE unless listed in mlp_only_layers."""
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    kinds = c.get("layer_types")
    if kinds is None:
        interval = c.int("full_attention_interval", default=4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    counts = _counts(list(kinds), n, c.label)
    if set(counts) - {"full_attention", "linear_attention"}:
        raise ProfileError(f"{c.label}: unknown layer_types {sorted(set(counts))}")
    experts, step = c.int("num_experts", default=512), c.int("decoder_sparse_step", default=1)
    mlp_only = set(c.get("mlp_only_layers", default=[]))
    n_moe = sum(1 for i in range(n) if i not in mlp_only and experts > 0 and (i + 1) % step == 0)
    out = dict(
        attention=_attention(c, counts.get("full_attention", 0),
                             q_mult=2 if c.get("attn_output_gate", default=True) else 1),
        ssm=dict(kind="gated_delta_net", n_layers=counts.get("linear_attention", 0), d_model=d,
                 n_k_heads=c.int("linear_num_key_heads"), n_v_heads=c.int("linear_num_value_heads"),
                 k_head_dim=c.int("linear_key_head_dim"), v_head_dim=c.int("linear_value_head_dim"),
                 conv_kernel=c.int("linear_conv_kernel_dim", default=4)),
        moe=dict(n_layers=n_moe, num_experts=experts, top_k=c.int("num_experts_per_tok"),
                 expert_intermediate_size=c.int("moe_intermediate_size"),
                 shared_intermediate_size=c.int("shared_expert_intermediate_size", default=0), gated=True),
    )
    if n - n_moe:
        out["mlp"] = dict(n_layers=n - n_moe, intermediate_size=c.int("intermediate_size"), gated=True)
    return out


def _granite_hybrid(c: _Cfg) -> dict:
    """layer_types mamba/attention; every layer also has a MoE block with a shared expert
    (or, with num_local_experts == 0, just the shared MLP)."""
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    counts = _layer_kinds(c, n, {"mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba",
                                 "attention": "attention", "full_attention": "attention"})
    heads = c.int("mamba_n_heads", default=128)
    d_inner = c.int("mamba_expand", default=2) * d
    shared = c.int("shared_intermediate_size", default=1024)
    experts = c.int("num_local_experts", default=8)
    out = dict(
        attention=_attention(c, counts.get("attention", 0)),
        ssm=_mamba2(c, counts.get("mamba", 0), heads=heads,
                    head_dim=_auto_head_dim(c.get("mamba_d_head"), d_inner, heads),
                    groups=c.int("mamba_n_groups", default=1), state=c.int("mamba_d_state", default=256),
                    conv=c.int("mamba_d_conv", default=4)),
    )
    if experts > 0:
        out["moe"] = dict(n_layers=n, num_experts=experts, top_k=c.int("num_experts_per_tok", default=2),
                          expert_intermediate_size=c.int("intermediate_size"),
                          shared_intermediate_size=shared, gated=True)
    else:
        out["mlp"] = dict(n_layers=n, intermediate_size=shared, gated=True)
    return out


def _mamba2_hf(c: _Cfg) -> dict:
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    heads = c.int("num_heads", default=128)
    d_inner = c.int("expand", default=2) * d
    return dict(ssm=_mamba2(c, n, heads=heads, head_dim=_auto_head_dim(c.get("head_dim"), d_inner, heads),
                            groups=c.int("n_groups", default=8), state=c.int("state_size", default=128),
                            conv=c.int("conv_kernel", default=4)))


def _mamba1(c: _Cfg, n: int, d: int, *, expand: int, state: int, conv: int, dt_rank: Any) -> dict:
    return dict(kind="mamba1", n_layers=n, d_model=d, d_inner=expand * d, d_state=state,
                conv_kernel=conv, dt_rank=math.ceil(d / 16) if dt_rank in (None, "auto") else int(dt_rank))


def _mamba_hf(c: _Cfg) -> dict:
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    return dict(ssm=_mamba1(c, n, d, expand=c.int("expand", default=2), state=c.int("state_size", default=16),
                            conv=c.int("conv_kernel", default=4), dt_rank=c.get("time_step_rank")))


def _mamba_ssm(c: _Cfg) -> dict:
    """state-spaces/mamba checkpoints (MambaLMHeadModel config: d_model, n_layer, ssm_cfg)."""
    n, d = c.int("n_layer"), c.int("d_model")
    if c.get("attn_layer_idx"):
        raise ProfileError(f"{c.label}: mamba_ssm configs with attention layers (attn_layer_idx) are not supported")
    ssm_cfg = _Cfg(dict(c.get("ssm_cfg", default={})), c.label)
    layer = ssm_cfg.get("layer", default="Mamba1")
    if layer == "Mamba2":  # mamba_ssm.modules.mamba2.Mamba2 defaults
        d_inner = ssm_cfg.int("expand", default=2) * d
        head_dim = ssm_cfg.int("headdim", default=64)
        ssm = dict(kind="mamba2", n_layers=n, d_model=d, n_heads=d_inner // head_dim, head_dim=head_dim,
                   n_groups=ssm_cfg.int("ngroups", default=1), d_state=ssm_cfg.int("d_state", default=128),
                   conv_kernel=ssm_cfg.int("d_conv", default=4))
    elif layer == "Mamba1":  # mamba_ssm.modules.mamba_simple.Mamba defaults
        ssm = _mamba1(c, n, d, expand=ssm_cfg.int("expand", default=2), state=ssm_cfg.int("d_state", default=16),
                      conv=ssm_cfg.int("d_conv", default=4), dt_rank=ssm_cfg.get("dt_rank"))
    else:
        raise ProfileError(f"{c.label}: unknown mamba_ssm layer {layer!r}")
    out = dict(ssm=ssm)
    if c.int("d_intermediate", default=0) > 0:  # GatedMLP after each mixer
        out["mlp"] = dict(n_layers=n, intermediate_size=c.int("d_intermediate"), gated=True)
    return out


# --- sliding-window hybrids -------------------------------------------------------------------

_SWA_KINDS = {"sliding_attention": "swa", "sliding": "swa", "local": "swa", "swa": "swa",
              "full_attention": "full", "full": "full", "global": "full", "attention": "full"}


def _swa_layout(c: _Cfg, n: int) -> tuple[int, int, int]:
    """(global layers, SWA layers, window) from `layer_types`, MiMo's `hybrid_layer_pattern`
    (1 = SWA) or Gemma's `sliding_window_pattern` P (layer i global iff (i + 1) % P == 0)."""
    window = c.int("sliding_window", "sliding_window_size")
    if window < 1:
        raise ProfileError(f"{c.label}: sliding_window must be a positive integer, got {window!r}")
    kinds = c.get("layer_types")
    if kinds is not None:
        bad = sorted({str(k) for k in kinds} - set(_SWA_KINDS))
        if bad:
            raise ProfileError(f"{c.label}: unknown layer_types {bad}; expected sliding_attention / full_attention")
        counts = _counts([_SWA_KINDS[str(k)] for k in kinds], n, c.label)
    elif c.get("hybrid_layer_pattern") is not None:
        pattern = list(c.get("hybrid_layer_pattern"))
        bad = sorted({str(x) for x in pattern} - {"0", "1"})
        if bad:
            raise ProfileError(f"{c.label}: hybrid_layer_pattern entries must be 0 (global) or 1 (SWA), got {bad}")
        counts = _counts(["swa" if int(x) else "full" for x in pattern], n, c.label)
    elif c.get("sliding_window_pattern") is not None:
        period = c.int("sliding_window_pattern")
        if period < 1:
            raise ProfileError(f"{c.label}: sliding_window_pattern must be >= 1, got {period!r}")
        counts = {"full": sum(1 for i in range(n) if (i + 1) % period == 0)}
        counts["swa"] = n - counts["full"]
    else:
        raise ProfileError(f"{c.label}: config lacks layer_types / hybrid_layer_pattern / sliding_window_pattern")
    return counts.get("full", 0), counts.get("swa", 0), window


def _gpt_oss(c: _Cfg) -> dict:
    """gpt-oss: alternating sliding-window and full attention (layer_types; sinks ignored), every
    layer a gated MoE of num_local_experts experts of width intermediate_size."""
    n = c.int("num_hidden_layers")
    if c.get("layer_types") is None and c.get("sliding_window_pattern") is None:
        c = _Cfg({**c.data, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(n)]}, c.label)
    n_full, n_swa, window = _swa_layout(c, n)
    return dict(attention=_attention(c, n_full), swa_attention=dict(_attention(c, n_swa), sliding_window=window),
                moe=dict(n_layers=n, num_experts=c.int("num_local_experts", "num_experts"),
                         top_k=c.int("num_experts_per_tok", "experts_per_token"),
                         expert_intermediate_size=c.int("intermediate_size"), shared_intermediate_size=0, gated=True))


def _gemma4(c: _Cfg) -> dict:
    """Gemma 4 (text): SWA layers use head_dim and num_key_value_heads, global layers
    global_head_dim and num_global_key_value_heads; a gated MLP per layer. attention_k_eq_v
    (global V = K) is counted as a regular V (the KV pool stores both)."""
    n = c.int("num_hidden_layers")
    if c.get("enable_moe_block", default=False):
        raise ProfileError(f"{c.label}: Gemma 4 MoE checkpoints (enable_moe_block) are not supported yet")
    if c.int("num_kv_shared_layers", default=0):
        raise ProfileError(f"{c.label}: KV-shared layers (num_kv_shared_layers) are not supported yet")
    n_full, n_swa, window = _swa_layout(c, n)
    glob = dict(_attention(c, n_full), n_kv_heads=c.int("num_global_key_value_heads", "num_key_value_heads"),
                head_dim=c.int("global_head_dim", "head_dim"))
    return dict(attention=glob, swa_attention=dict(_attention(c, n_swa), sliding_window=window),
                mlp=dict(n_layers=n, intermediate_size=c.int("intermediate_size"), gated=True))


def _mimo_v2_flash(c: _Cfg) -> dict:
    """MiMo-V2-Flash: hybrid_layer_pattern (1 = SWA) with separate SWA head counts and widths
    (swa_*), Q/K head_dim distinct from v_head_dim; layers with moe_layer_freq 1 are a gated MoE,
    the others a dense gated MLP."""
    n, d = c.int("num_hidden_layers"), c.int("hidden_size")
    n_full, n_swa, window = _swa_layout(c, n)
    glob = dict(_attention(c, n_full), v_head_dim=c.int("v_head_dim", "head_dim"))
    swa = dict(n_layers=n_swa, n_heads=c.int("swa_num_attention_heads", "num_attention_heads"),
               n_kv_heads=c.int("swa_num_key_value_heads", "num_key_value_heads"),
               head_dim=c.int("swa_head_dim", "head_dim"), d_in=d, d_out=d, q_mult=1, extra_flops_per_token=0,
               v_head_dim=c.int("swa_v_head_dim", "v_head_dim", "swa_head_dim", "head_dim"), sliding_window=window)
    freq = c.get("moe_layer_freq", default=[1] * n)
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(n)]
    n_moe = sum(1 for x in list(freq)[:n] if int(x))
    out = dict(attention=glob, swa_attention=swa,
               moe=dict(n_layers=n_moe, num_experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
                        expert_intermediate_size=c.int("moe_intermediate_size"),
                        shared_intermediate_size=c.int("n_shared_experts", default=0)
                        * c.int("moe_intermediate_size"), gated=True))
    if n - n_moe:
        out["mlp"] = dict(n_layers=n - n_moe, intermediate_size=c.int("intermediate_size"), gated=True)
    return out


_BY_MODEL_TYPE = {
    "llama": _dense, "mistral": _dense, "qwen2": _dense, "qwen3": _dense,
    "jamba": _jamba, "zamba2": _zamba2, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
    "qwen3_next": _qwen3_next, "granitemoehybrid": _granite_hybrid, "mamba2": _mamba2_hf, "mamba": _mamba_hf,
    "gpt_oss": _gpt_oss, "gemma4_text": _gemma4, "gemma4": _gemma4, "mimo_v2_flash": _mimo_v2_flash,
}
_BY_ARCHITECTURE = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "JambaForCausalLM": "jamba", "Zamba2ForCausalLM": "zamba2",
    "NemotronHForCausalLM": "nemotron_h", "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3NextForCausalLM": "qwen3_next", "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "Mamba2ForCausalLM": "mamba2", "MambaForCausalLM": "mamba",
    "GptOssForCausalLM": "gpt_oss", "Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4",
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_BY_ARCHITECTURE)) + ("mamba_ssm (d_model/n_layer/ssm_cfg)",)


def parse_config(data: dict) -> dict:
    """Layer inventory of a config: architecture, dims, dtypes, and per-kind layer specs."""
    if "text_config" in data and "hidden_size" not in data:  # multimodal wrapper
        data = {**data, **data["text_config"]}
    archs = data.get("architectures") or []
    arch = archs[0] if archs else None
    model_type = data.get("model_type")
    if arch in _BY_ARCHITECTURE:
        family = _BY_ARCHITECTURE[arch]
    elif model_type in _BY_MODEL_TYPE:
        family = model_type
    elif arch is None and model_type is None and "ssm_cfg" in data and "d_model" in data:
        family = "mamba_ssm"
    else:
        raise ProfileError(
            f"cannot interpret architecture {arch or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    label = arch or family
    c = _Cfg(data, label)
    parts = _mamba_ssm(c) if family == "mamba_ssm" else _BY_MODEL_TYPE[family](c)
    dtype = str(c.get("torch_dtype", "dtype", default=DEFAULT_DTYPE)).removeprefix("torch.")
    ssm_dtype = str(c.get("mamba_ssm_dtype", "ssm_state_dtype", default=dtype)).removeprefix("torch.")
    return dict(architecture=label, hidden_size=c.int("hidden_size", "d_model"),
                dtype=dtype, dtype_bytes=dtype_bytes(dtype), ssm_dtype=ssm_dtype,
                ssm_dtype_bytes=dtype_bytes(ssm_dtype, "SSM state dtype"),
                dtype_assumed=c.get("torch_dtype", "dtype") is None, **parts)

"""Model profiles: the FLOP and byte model Marconi's eviction scores are built on.

A ModelProfile says, for one model, how many bytes one token of KV costs (all attention
layers), how many bytes one SSM checkpoint costs (all SSM layers, temporal + conv state), and
how many FLOPs prefilling tokens [start, end) costs when [0, start) is cached:

    prefill_flops(start, end) = linear_flops_per_token · (end − start)
                              + attention_score_flops_coeff · (end² − start²)

The quadratic term counts QKᵀ and AV over the whole prefix, 2·L²·d_attn FLOPs each without
causal halving (the paper's convention: 4·L²·D from scratch), written in the additive form
4·d_attn·(end² − start²), so prefill_flops(a, b) + prefill_flops(b, c) == prefill_flops(a, c).
Everything else (projections, SSM mixers, MLPs, MoE) is linear in tokens. A multiply-add is
2 FLOPs. Norms, rotary embeddings, embeddings and the LM head are ignored.

The built-in ``paper-7b`` profile reproduces Table 1 of Marconi (Pan et al., MLSys 2025).
"""

from __future__ import annotations

import functools
import operator
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Union

import numpy as np

from sglang_marconi.policy.errors import MarconiError, ProfileError
from sglang_marconi.policy.cost.hf_config import dtype_bytes, load_config, parse_config

_PROFILE_DIR = Path(__file__).with_name("profiles")


# --- per-layer specs -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AttentionSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_in: int                      # width the q/k/v projections read (2·D for Zamba2's shared block)
    d_out: int                     # width o_proj writes
    q_mult: int = 1                # 2 when q_proj also emits an output gate (Qwen3-Next)
    extra_flops_per_token: int = 0  # Zamba2's per-hybrid-layer D×D output linear
    v_head_dim: int | None = None  # V's head width where it differs from Q/K's (MiMo-V2: 192 vs 128)

    def proj_flops_per_token(self) -> int:
        """q (and gate), k, v from d_in, o back to d_out: 2·(d_in·(q_mult·H·hd + 2·Hkv·hd) + H·hd·d_out).
        Equals 8·D² for plain multi-head attention with H·hd = D. With a distinct V width vhd,
        v and o use vhd: 2·(d_in·(q_mult·H·hd + Hkv·(hd + vhd)) + H·vhd·d_out)."""
        if self.v_head_dim is None:
            q_width, kv_width = self.q_mult * self.n_heads * self.head_dim, 2 * self.n_kv_heads * self.head_dim
            return 2 * (self.d_in * (q_width + kv_width) + self.n_heads * self.head_dim * self.d_out) \
                + self.extra_flops_per_token
        q_width = self.q_mult * self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * (self.head_dim + self.v_head_dim)
        return 2 * (self.d_in * (q_width + kv_width) + self.n_heads * self.v_head_dim * self.d_out) \
            + self.extra_flops_per_token

    def score_flops_coeff(self) -> int:
        """Coefficient of (end² − start²): 4·d_attn, d_attn = H·hd (QKᵀ and AV, no causal halving);
        2·H·(hd + vhd) with a distinct V width."""
        if self.v_head_dim is None:
            return 4 * self.n_heads * self.head_dim
        return 2 * self.n_heads * (self.head_dim + self.v_head_dim)

    def kv_elems_per_token(self) -> int:
        """K and V: 2·Hkv·hd elements per token (GQA shrinks this, not the FLOPs of the scores)."""
        if self.v_head_dim is None:
            return 2 * self.n_kv_heads * self.head_dim
        return self.n_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True, slots=True)
class PaperMambaSpec:
    """The paper's SSM layer (Table 1, Mamba with expand 2): 12·D² + 16·D·N + 10·D FLOPs per token,
    written for d_inner = expand·D as 6·D·d_inner + 8·d_inner·N + 5·d_inner. State: D·N elements
    (2·D·N bytes in fp16) plus the paper's conv state (d_inner + 2·N)·conv_kernel (full kernel)."""
    kind: ClassVar[str] = "paper_mamba"
    d_model: int
    d_state: int
    expand: int = 2
    conv_kernel: int = 4

    def flops_per_token(self) -> int:
        d_inner = self.expand * self.d_model
        return 6 * self.d_model * d_inner + 8 * d_inner * self.d_state + 5 * d_inner

    def temporal_elems(self) -> int:
        return self.d_model * self.d_state

    def conv_elems(self) -> int:
        return (self.expand * self.d_model + 2 * self.d_state) * self.conv_kernel


@dataclass(frozen=True, slots=True)
class Mamba1Spec:
    """Mamba (selective scan, Jamba). Per token: in_proj 2·D·2·d_inner, conv 2·d_inner·k,
    x_proj 2·d_inner·(R + 2N), dt_proj 2·R·d_inner, scan ≈ 6·d_inner·N (decay, B·x outer product
    and add, C·h), out_proj 2·d_inner·D. State: d_inner·N temporal, d_inner·(k−1) conv (what
    vLLM/SGLang allocate)."""
    kind: ClassVar[str] = "mamba1"
    d_model: int
    d_inner: int
    d_state: int
    conv_kernel: int
    dt_rank: int

    def flops_per_token(self) -> int:
        di, n, r = self.d_inner, self.d_state, self.dt_rank
        return (4 * self.d_model * di + 2 * di * self.conv_kernel + 2 * di * (r + 2 * n)
                + 2 * r * di + 6 * di * n + 2 * di * self.d_model)

    def temporal_elems(self) -> int:
        return self.d_inner * self.d_state

    def conv_elems(self) -> int:
        return self.d_inner * (self.conv_kernel - 1)


@dataclass(frozen=True, slots=True)
class Mamba2Spec:
    """Mamba2 / SSD with H heads of P channels (d_inner = H·P), G groups, state N, kernel k.
    Per token: in_proj 2·D·(2·d_inner + 2·G·N + H) (z, x, B, C, dt), conv 2·(d_inner + 2GN)·k,
    SSD scan ≈ 6·d_inner·N (recurrent-form count; the chunked kernel's intra-chunk work is not
    added), out_proj 2·d_inner·D. State: H·P·N temporal, (d_inner + 2GN)·(k−1) conv."""
    kind: ClassVar[str] = "mamba2"
    d_model: int
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    def _conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def flops_per_token(self) -> int:
        di, n = self.d_inner, self.d_state
        return (2 * self.d_model * (2 * di + 2 * self.n_groups * n + self.n_heads)
                + 2 * self._conv_dim() * self.conv_kernel + 6 * di * n + 2 * di * self.d_model)

    def temporal_elems(self) -> int:
        return self.n_heads * self.head_dim * self.d_state

    def conv_elems(self) -> int:
        return self._conv_dim() * (self.conv_kernel - 1)


@dataclass(frozen=True, slots=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet linear attention (Qwen3-Next). Hk key heads of dk, Hv value heads of dv.
    Per token: in_proj 2·D·(2·Hk·dk + 2·Hv·dv + 2·Hv) (q, k, v, z, b, a), conv over q, k, v
    2·(2·Hk·dk + Hv·dv)·k, state update ≈ 8·Hv·dk·dv (decay, kᵀS, rank-1 delta update, qᵀS),
    out_proj 2·Hv·dv·D. State: Hv·dk·dv temporal, (2·Hk·dk + Hv·dv)·(k−1) conv."""
    kind: ClassVar[str] = "gated_delta_net"
    d_model: int
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def _conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    def flops_per_token(self) -> int:
        qk, v = self.n_k_heads * self.k_head_dim, self.n_v_heads * self.v_head_dim
        return (2 * self.d_model * (2 * qk + 2 * v + 2 * self.n_v_heads)
                + 2 * self._conv_dim() * self.conv_kernel
                + 8 * self.n_v_heads * self.k_head_dim * self.v_head_dim + 2 * v * self.d_model)

    def temporal_elems(self) -> int:
        return self.n_v_heads * self.k_head_dim * self.v_head_dim

    def conv_elems(self) -> int:
        return self._conv_dim() * (self.conv_kernel - 1)


SsmSpec = Union[PaperMambaSpec, Mamba1Spec, Mamba2Spec, GatedDeltaNetSpec]
_SSM_KINDS = {cls.kind: cls for cls in (PaperMambaSpec, Mamba1Spec, Mamba2Spec, GatedDeltaNetSpec)}


@dataclass(frozen=True, slots=True)
class MlpSpec:
    """Gated (SwiGLU: gate, up, down) 6·D·I FLOPs per token; non-gated (up, down) 4·D·I
    (16·D² for the paper's I = 4·D)."""
    d_model: int
    intermediate_size: int
    gated: bool = True

    def flops_per_token(self) -> int:
        return (6 if self.gated else 4) * self.d_model * self.intermediate_size


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Sparse MoE: top_k experts of width I_e, shared experts of total width I_s, router 2·D·E:
    top_k·m·D·I_e + m·D·I_s + 2·D·E with m = 6 (gated) or 4. Shared-expert gates are ignored."""
    d_model: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    gated: bool = True

    def flops_per_token(self) -> int:
        m = 6 if self.gated else 4
        return (self.top_k * m * self.d_model * self.expert_intermediate_size
                + m * self.d_model * self.shared_intermediate_size + 2 * self.d_model * self.num_experts)


# --- the profile ---------------------------------------------------------------------------

def _check_range(start, end) -> None:
    if not float(start) >= 0:
        raise MarconiError(f"prefill range start must be >= 0, got {start!r}")
    if not float(end) >= float(start):
        raise MarconiError(f"prefill range end must be >= start, got start={start!r}, end={end!r}")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Immutable FLOP/byte model of one model. Build with profile_from_config / load_profile /
    paper_hybrid_profile. Derived totals are computed from the layer specs at construction."""
    name: str
    architecture: str
    hidden_size: int
    dtype_bytes: int
    ssm_dtype_bytes: int
    n_attention_layers: int = 0
    n_ssm_layers: int = 0
    n_mlp_layers: int = 0
    n_moe_layers: int = 0
    attention: AttentionSpec | None = None
    ssm: SsmSpec | None = None
    mlp: MlpSpec | None = None
    moe: MoeSpec | None = None
    source: str = ""
    # Sliding-window attention (SWA) layers: their K and V matter only for the `sliding_window`
    # tokens before a position. Optional: a profile without them has no SWA layers.
    n_swa_layers: int = 0
    swa_attention: AttentionSpec | None = None
    sliding_window: int = 0
    kv_bytes_per_token: int = field(init=False)        # all global (full) attention layers, K and V
    swa_kv_bytes_per_token: int = field(init=False)    # all SWA layers, K and V of one token
    swa_score_flops_coeff: int = field(init=False)     # 4·d_attn summed over the SWA layers
    ssm_state_bytes: int = field(init=False)           # one checkpoint, all SSM layers, temporal + conv
    ssm_conv_bytes: int = field(init=False)            # the conv part of ssm_state_bytes
    linear_flops_per_token: int = field(init=False)
    attention_score_flops_coeff: int = field(init=False)

    def __post_init__(self) -> None:
        for count, spec, what in ((self.n_attention_layers, self.attention, "attention"),
                                  (self.n_ssm_layers, self.ssm, "ssm"),
                                  (self.n_mlp_layers, self.mlp, "mlp"), (self.n_moe_layers, self.moe, "moe")):
            if count < 0 or (count and spec is None):
                raise ProfileError(f"{self.name}: {count} {what} layers need a {what} spec")
        if self.n_swa_layers < 0 or (self.n_swa_layers and self.swa_attention is None):
            raise ProfileError(f"{self.name}: {self.n_swa_layers} sliding-window layers need a swa_attention spec")
        if self.n_swa_layers and (isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                                  or self.sliding_window < 1):
            raise ProfileError(f"{self.name}: sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.n_attention_layers + self.n_ssm_layers + self.n_swa_layers == 0:
            raise ProfileError(f"{self.name}: a model needs attention or SSM layers")
        per = self._per_layer()
        conv = self.n_ssm_layers * (self.ssm.conv_elems() * self.dtype_bytes if self.ssm else 0)
        temporal = self.n_ssm_layers * (self.ssm.temporal_elems() * self.ssm_dtype_bytes if self.ssm else 0)
        setattr_ = object.__setattr__
        setattr_(self, "kv_bytes_per_token", self.n_attention_layers * per["kv_bytes_per_token"])
        setattr_(self, "ssm_conv_bytes", conv)
        setattr_(self, "ssm_state_bytes", conv + temporal)
        setattr_(self, "linear_flops_per_token",
                 self.n_attention_layers * per["attention_proj_flops_per_token"]
                 + self.n_ssm_layers * per["ssm_flops_per_token"]
                 + self.n_mlp_layers * per["mlp_flops_per_token"] + self.n_moe_layers * per["moe_flops_per_token"])
        setattr_(self, "attention_score_flops_coeff", self.n_attention_layers * per["attention_score_flops_coeff"])
        swa = self.swa_attention if self.n_swa_layers else None
        setattr_(self, "swa_kv_bytes_per_token", self.n_swa_layers * swa.kv_elems_per_token() * self.dtype_bytes if swa else 0)
        setattr_(self, "swa_score_flops_coeff", self.n_swa_layers * swa.score_flops_coeff() if swa else 0)
        if swa:  # SWA projections are linear in tokens like every other projection
            setattr_(self, "linear_flops_per_token",
                     self.linear_flops_per_token + self.n_swa_layers * swa.proj_flops_per_token())

    def _per_layer(self) -> dict[str, int]:
        a, s = self.attention, self.ssm
        return dict(
            kv_bytes_per_token=a.kv_elems_per_token() * self.dtype_bytes if a else 0,
            attention_proj_flops_per_token=a.proj_flops_per_token() if a else 0,
            attention_score_flops_coeff=a.score_flops_coeff() if a else 0,
            ssm_state_bytes=(s.temporal_elems() * self.ssm_dtype_bytes + s.conv_elems() * self.dtype_bytes) if s else 0,
            ssm_conv_bytes=s.conv_elems() * self.dtype_bytes if s else 0,
            ssm_flops_per_token=s.flops_per_token() if s else 0,
            mlp_flops_per_token=self.mlp.flops_per_token() if self.mlp else 0,
            moe_flops_per_token=self.moe.flops_per_token() if self.moe else 0,
        )

    @property
    def ssm_temporal_bytes(self) -> int:
        return self.ssm_state_bytes - self.ssm_conv_bytes

    @property
    def has_sliding_window(self) -> bool:
        return self.n_swa_layers > 0

    def swa_band(self, length):
        """Score work of an SWA layer over a prefix of `length` tokens, in units of its coefficient:
        length² while the prefix fits the window w, then w² + 2·w·(length − w) (each further token
        attends w tokens). The difference band(end) − band(start) is additive like end² − start²."""
        w = self.sliding_window
        if isinstance(length, np.ndarray):
            return np.where(length <= w, length * length, 2.0 * w * length - w * w)
        return length * length if length <= w else 2 * w * length - w * w

    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes of num_tokens tokens over all attention layers."""
        return self.kv_bytes_per_token * int(num_tokens)

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill tokens [start, end) when [0, start) is cached (0 when start == end)."""
        _check_range(start, end)
        try:  # exact integer arithmetic for integer positions
            s, e = operator.index(start), operator.index(end)
        except TypeError:
            s, e = float(start), float(end)
        n = e - s
        flops = self.linear_flops_per_token * n + self.attention_score_flops_coeff * n * (e + s)
        if self.n_swa_layers:
            flops += self.swa_score_flops_coeff * (self.swa_band(e) - self.swa_band(s))
        return float(flops)

    def prefill_flops_array(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Vectorised prefill_flops over broadcastable arrays of positions (float64 result)."""
        s, e = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
        s, e = np.broadcast_arrays(s, e)
        bad = ~(s >= 0) | ~(e >= s)
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), bad.shape)
            _check_range(s[i], e[i])
        n = e - s
        flops = self.linear_flops_per_token * n + self.attention_score_flops_coeff * n * (e + s)
        if self.n_swa_layers:
            flops = flops + self.swa_score_flops_coeff * (self.swa_band(e) - self.swa_band(s))
        return flops

    def prefill_flops_by_kind(self, start: int, end: int) -> dict[str, float]:
        """prefill_flops split by layer kind (attention includes its score term)."""
        _check_range(start, end)
        n, plus = float(end) - float(start), float(end) + float(start)
        per = self._per_layer()
        out = dict(
            attention=self.n_attention_layers * (per["attention_proj_flops_per_token"] * n
                                                 + per["attention_score_flops_coeff"] * n * plus),
            ssm=self.n_ssm_layers * per["ssm_flops_per_token"] * n,
            mlp=self.n_mlp_layers * per["mlp_flops_per_token"] * n,
            moe=self.n_moe_layers * per["moe_flops_per_token"] * n,
        )
        if self.n_swa_layers:
            out["swa_attention"] = (self.n_swa_layers * self.swa_attention.proj_flops_per_token() * n
                                    + self.swa_score_flops_coeff * (self.swa_band(float(end)) - self.swa_band(float(start))))
        return out

    def describe(self) -> dict:
        """JSON-able summary: layer counts, dtypes, bytes, FLOP coefficients, layer dims."""
        spec = lambda x: None if x is None else {"kind": getattr(x, "kind", type(x).__name__), **asdict(x)}
        out = dict(
            name=self.name, architecture=self.architecture, source=self.source, hidden_size=self.hidden_size,
            layers=dict(attention=self.n_attention_layers, ssm=self.n_ssm_layers, mlp=self.n_mlp_layers,
                        moe=self.n_moe_layers, ssm_kind=self.ssm.kind if self.ssm else None),
            dtype_bytes=self.dtype_bytes, ssm_dtype_bytes=self.ssm_dtype_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token, ssm_state_bytes=self.ssm_state_bytes,
            ssm_conv_bytes=self.ssm_conv_bytes, ssm_temporal_bytes=self.ssm_temporal_bytes,
            linear_flops_per_token=self.linear_flops_per_token,
            attention_score_flops_coeff=self.attention_score_flops_coeff,
            per_layer=self._per_layer(),
            attention=spec(self.attention), ssm=spec(self.ssm), mlp=spec(self.mlp), moe=spec(self.moe),
        )
        if self.n_swa_layers:
            out.update(sliding_window=self.sliding_window, swa_attention=spec(self.swa_attention),
                       swa_kv_bytes_per_token=self.swa_kv_bytes_per_token,
                       swa_score_flops_coeff=self.swa_score_flops_coeff)
            out["layers"]["swa"] = self.n_swa_layers
        return out


# --- constructors --------------------------------------------------------------------------

def _from_inventory(inv: dict, name: str, source: str, ssm_dtype_bytes: int | None) -> ModelProfile:
    d = inv["hidden_size"]
    parts: dict = {}
    if inv.get("attention") and inv["attention"]["n_layers"]:
        a = dict(inv["attention"])
        parts.update(n_attention_layers=a.pop("n_layers"), attention=AttentionSpec(**a))
    if inv.get("swa_attention") and inv["swa_attention"]["n_layers"]:
        a = dict(inv["swa_attention"])
        parts.update(n_swa_layers=a.pop("n_layers"), sliding_window=a.pop("sliding_window"),
                     swa_attention=AttentionSpec(**a))
    if inv.get("ssm") and inv["ssm"]["n_layers"]:
        s = dict(inv["ssm"])
        n, kind = s.pop("n_layers"), s.pop("kind")
        parts.update(n_ssm_layers=n, ssm=_SSM_KINDS[kind](**s))
    if inv.get("mlp") and inv["mlp"]["n_layers"]:
        m = dict(inv["mlp"])
        parts.update(n_mlp_layers=m.pop("n_layers"), mlp=MlpSpec(d_model=d, **m))
    if inv.get("moe") and inv["moe"]["n_layers"]:
        m = dict(inv["moe"])
        parts.update(n_moe_layers=m.pop("n_layers"), moe=MoeSpec(d_model=d, **m))
    return ModelProfile(name=name, architecture=inv["architecture"], hidden_size=d,
                        dtype_bytes=inv["dtype_bytes"],
                        ssm_dtype_bytes=ssm_dtype_bytes or inv["ssm_dtype_bytes"], source=source, **parts)


def profile_from_config(config: dict | str | os.PathLike, name: str | None = None, *,
                        ssm_state_dtype: str | None = None) -> ModelProfile:
    """Profile of a Hugging Face-style config (dict, config.json path, or a directory holding one).

    The SSM temporal state dtype is the config's mamba_ssm_dtype / ssm_state_dtype, else the model
    dtype; ssm_state_dtype overrides it (SGLang 0.5.x defaults it to float32 when the config names
    none). Unknown architectures raise ProfileError naming them."""
    data, hint = load_config(config)
    inv = parse_config(data)
    source = str(data.get("_source", "")) or (str(config) if not isinstance(config, dict) else "")
    name = name or data.get("_name") or hint or data.get("_name_or_path") or inv["architecture"]
    ssm_bytes = dtype_bytes(ssm_state_dtype, "SSM state dtype") if ssm_state_dtype else None
    return _from_inventory(inv, str(name), source, ssm_bytes)


def paper_hybrid_profile(n_attention: int = 4, n_ssm: int = 24, d_state: int = 128,
                         d_model: int = 4096) -> ModelProfile:
    """The paper's synthetic hybrid family (§5): multi-head attention with H·hd = D, Mamba SSM
    layers (expand 2, conv kernel 4) in the Table 1 convention, 28 non-gated 4·D MLP layers, fp16.
    The defaults are the paper's 7B model {4 attention, 24 SSM, 28 MLP}, D = 4096, N = 128."""
    if n_attention < 0 or n_ssm < 0 or n_attention + n_ssm == 0 or d_state <= 0 or d_model <= 0:
        raise ProfileError(f"bad paper hybrid shape: n_attention={n_attention}, n_ssm={n_ssm}, "
                           f"d_state={d_state}, d_model={d_model}")
    heads = 32 if d_model % 32 == 0 else 1
    return ModelProfile(
        name=f"paper-hybrid-a{n_attention}-s{n_ssm}-n{d_state}-d{d_model}",
        architecture="paper-hybrid", hidden_size=d_model, dtype_bytes=2, ssm_dtype_bytes=2,
        n_attention_layers=n_attention, n_ssm_layers=n_ssm, n_mlp_layers=28,
        attention=AttentionSpec(n_heads=heads, n_kv_heads=heads, head_dim=d_model // heads,
                                d_in=d_model, d_out=d_model) if n_attention else None,
        ssm=PaperMambaSpec(d_model=d_model, d_state=d_state) if n_ssm else None,
        mlp=MlpSpec(d_model=d_model, intermediate_size=4 * d_model, gated=False),
        source="Marconi (Pan et al., MLSys 2025), Table 1 and Appendix A",
    )


def _builtin_names() -> tuple[str, ...]:
    return ("paper-7b",) + tuple(sorted(p.stem for p in _PROFILE_DIR.glob("*.json")))


BUILTIN_PROFILE_NAMES: tuple[str, ...] = _builtin_names()


@functools.lru_cache(maxsize=None)
def _builtin(name: str) -> ModelProfile:
    if name == "paper-7b":
        return replace(paper_hybrid_profile(), name="paper-7b")
    return profile_from_config(_PROFILE_DIR / f"{name}.json", name=name)


def load_profile(name_or_path: str | os.PathLike) -> ModelProfile:
    """A built-in profile by name, or the profile of a config.json path (file or directory)."""
    key = os.fspath(name_or_path)
    if key in BUILTIN_PROFILE_NAMES:
        return _builtin(key)
    if os.path.exists(key):
        return profile_from_config(key)
    raise ProfileError(f"unknown profile {key!r}: not a built-in ({', '.join(BUILTIN_PROFILE_NAMES)}) "
                       f"and no such config file")

"""Gated RMSNorm and the shared-expert sigmoid gate (Qwen3-Next).

Replaces two Triton launchers SGLang still calls on a CPU without AMX:
`rms_norm_gated` of `sglang.kernels.ops.attention.fla.fused_norm_gate` (behind
`FusedRMSNormGated`, the GDN output norm) and `_launch_fused_gate_sigmoid_mul` of
`sglang.kernels.ops.elementwise.elementwise` (the MoE shared-expert gate).
Both compute in float64 (see the package docstring), so a token's result does not depend on
how many tokens share the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import COMPUTE_DTYPE


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                   residual_in_fp32=False, eps=1e-6):
    """Drop-in for the Triton `rms_norm_gated`: over the last dim,
    y = (h / rms(h)) * weight + bias, times silu(g) ("swish"/"silu") or sigmoid(g) ("sigmoid"),
    where h = x (+ residual). Returns y in x's dtype and shape; with prenorm, (y, h) where h is
    kept in the residual's dtype (float32 with residual_in_fp32, else x's dtype)."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"Unsupported activation: {activation}")
    to64 = lambda t: t.to(COMPUTE_DTYPE)
    h = to64(x)
    if residual is not None:
        h = h + to64(residual)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * to64(weight)
    if bias is not None:
        y = y + to64(bias)
    gate = to64(g).reshape(y.shape)
    y = (y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))).to(x.dtype)
    if not prenorm:
        return y
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    return y, h.to(residual_dtype)


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, *, do_add):
    """Drop-in for `_launch_fused_gate_sigmoid_mul`: per token,
    output = sigmoid(hidden_states . gate_weight) * shared_output (+ output when do_add),
    written in place. hidden_states, shared_output, output [T, D]; gate_weight [D]."""
    gate = torch.sigmoid(hidden_states.to(COMPUTE_DTYPE) @ gate_weight.to(COMPUTE_DTYPE))[:, None]
    result = gate * shared_output.to(COMPUTE_DTYPE)
    if do_add:
        result = result + output.to(COMPUTE_DTYPE)
    output.copy_(result.to(output.dtype))

"""SGLang's own Triton kernels, run by the Triton interpreter on CPU, next to the plain-torch
stand-ins of tests/cpu_engine on identical inputs. Prints one JSON object mapping
"case/output" to {"diff", "magnitude", "perturbed_diff", "dtype"}: the largest absolute
difference between kernel and stand-in, the largest magnitude of the kernel's output, and the
largest difference once the stand-in's input is perturbed (it must dwarf the tolerance, or the
comparison could not catch a wrong input).

Run as a script by tests/server/test_cpu_kernels.py, with TRITON_INTERPRET=1 (it must be set
before triton is imported and holds for the whole process) and tests/cpu_engine on PYTHONPATH.

Inputs are float32 (ACT), the tightest comparison: the interpreter computes garbage (values
around 1e10, NaN) for several of these kernels on bfloat16 tensors, while float32 and float16
agree with the stand-ins. The chunked delta rule refuses float32 and runs in float16.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
assert os.environ.get("SGLANG_USE_CPU_ENGINE") != "1", "the references must be SGLang's unpatched kernels"


def _interpreter_workarounds() -> None:
    """Let the Triton launchers run under the interpreter on a CPU-only host."""
    import triton.language as tl
    from triton.runtime import autotuner

    # Launchers enter torch.get_device_module(device).device(index); torch.cpu has no such context.
    torch.cpu.device = lambda *args, **kwargs: contextlib.nullcontext()

    # Autotuning benchmarks through the (absent) GPU driver; run the first surviving config instead.
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, *args, **kwargs: prune(self, *args, **kwargs)[:1]

    # Module-level aliases such as `exp = tl.exp` (fla/op.py) escape the interpreter's patching of
    # `tl`; import the kernel modules, then rebind those aliases to look `tl` up at call time.
    import sglang.kernels.ops.attention.fla.chunk  # noqa: F401

    builtins = {id(getattr(owner, name)): (owner, name)
                for owner in (tl, tl.math) for name in ("exp", "exp2", "log", "log2")
                if hasattr(owner, name)}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("sglang.kernels.ops"):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in builtins:
                owner, name = builtins[id(value)]
                setattr(module, attr, lambda *a, _o=owner, _n=name, **k: getattr(_o, _n)(*a, **k))


_interpreter_workarounds()

from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule  # noqa: E402
from sglang.kernels.ops.attention.fla.fused_norm_gate import rms_norm_gated  # noqa: E402
from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating  # noqa: E402
from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)
from sglang.kernels.ops.elementwise.elementwise import _launch_fused_gate_sigmoid_mul  # noqa: E402
from sglang.kernels.ops.mamba import causal_conv1d_triton  # noqa: E402
from sglang.kernels.ops.mamba.triton_ops.mamba_ssm import selective_state_update  # noqa: E402
from sglang.kernels.ops.mamba.triton_ops.ssd_combined import mamba_chunk_scan_combined  # noqa: E402
from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata  # noqa: E402
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool  # noqa: E402

# The references must be SGLang's kernels, not stand-ins patched in by tests/cpu_engine/sitecustomize.
assert causal_conv1d_triton.causal_conv1d_fn.__module__.startswith("sglang."), "references are patched"

import sgl_kernel  # noqa: E402  (the stand-in; registers torch.ops.sgl_kernel.*_cpu)
from sgl_kernel import mamba as sgl_kernel_mamba  # noqa: E402
from torch_kernels import conv1d, gated_delta_rule, mamba2_scan, norms  # noqa: E402

RESULTS: dict[str, dict] = {}
ACT = torch.float32  # activation dtype of the inputs (see the module docstring)


def _cloned(inputs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare(case: str, inputs: dict, run, reference, stand_in, perturb) -> None:
    """run(kernel, inputs) -> {output name: tensor} (returned values and mutated pools);
    perturb(inputs) changes an input the outputs depend on, in place."""
    expected = run(reference, _cloned(inputs))
    actual = run(stand_in, _cloned(inputs))
    perturbed_inputs = _cloned(inputs)
    perturb(perturbed_inputs)
    perturbed = run(stand_in, perturbed_inputs)
    for name, want in expected.items():
        RESULTS[f"{case}/{name}"] = {
            "diff": _max_abs(want, actual[name]),
            "magnitude": want.double().abs().max().item(),
            "perturbed_diff": _max_abs(want, perturbed[name]),
            "dtype": str(want.dtype).removeprefix("torch."),
        }


def _bump(key, index, amount=0.5):
    def perturb(inputs):
        inputs[key][index] += amount

    return perturb


# ---- causal conv1d (Mamba2 and GDN) ----

def conv_cases() -> None:
    dim, width, slots = 40, 4, 5
    lengths = [5, 1, 9, 2]
    starts = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    slot_of_seq = torch.tensor([3, 0, -1, 1], dtype=torch.int32)  # sequence 2 has no slot: skipped
    live_columns = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in range(len(lengths)) if slot_of_seq[i] >= 0])
    prefill = dict(
        x=torch.randn(int(starts[-1]), dim).to(ACT).t(),  # [dim, tokens], channel-last as SGLang passes it
        weight=torch.randn(dim, width).to(ACT), bias=torch.randn(dim).to(ACT),
        conv_states=torch.randn(slots, width - 1, dim).to(ACT).transpose(1, 2),
        query_start_loc=starts, seq_lens_cpu=lengths, cache_indices=slot_of_seq,
        has_initial_state=torch.tensor([True, False, True, True]))

    def run_fn(kernel, i):
        out = kernel(i["x"], i["weight"], i["bias"], conv_states=i["conv_states"],
                     query_start_loc=i["query_start_loc"], seq_lens_cpu=i["seq_lens_cpu"],
                     cache_indices=i["cache_indices"], has_initial_state=i["has_initial_state"],
                     activation="silu")
        return {"out": out[:, live_columns], "conv_states": i["conv_states"]}

    def cpu_op(x, weight, bias, *, conv_states, query_start_loc, seq_lens_cpu, cache_indices,
               has_initial_state, activation):
        return sgl_kernel_mamba.causal_conv1d_fn_cpu(x, weight, bias, activation, conv_states,
                                                     has_initial_state, cache_indices, query_start_loc,
                                                     seq_lens_cpu)

    for case, stand_in in (("conv1d_fn", conv1d.causal_conv1d_fn), ("conv1d_fn_cpu_op", cpu_op)):
        compare(case, prefill, run_fn, causal_conv1d_triton.causal_conv1d_fn, stand_in,
                _bump("conv_states", 3))

    decode = dict(x=torch.randn(3, dim).to(ACT), conv_state=prefill["conv_states"],
                  weight=prefill["weight"], bias=prefill["bias"],
                  conv_state_indices=torch.tensor([2, -1, 0], dtype=torch.int32))

    def run_update(kernel, i):
        out = kernel(i["x"], i["conv_state"], i["weight"], i["bias"], "silu",
                     conv_state_indices=i["conv_state_indices"])
        return {"out": out[[0, 2]], "conv_state": i["conv_state"]}

    def cpu_update(x, conv_state, weight, bias, activation, *, conv_state_indices):
        return sgl_kernel_mamba.causal_conv1d_update_cpu(x, conv_state, weight, bias, activation, conv_state_indices)

    for case, stand_in in (("conv1d_update", conv1d.causal_conv1d_update), ("conv1d_update_cpu_op", cpu_update)):
        compare(case, decode, run_update, causal_conv1d_triton.causal_conv1d_update, stand_in,
                _bump("conv_state", 2))


# ---- Mamba2 SSD scan (Nemotron-H) ----

def mamba2_cases() -> None:
    H, P, G, N, chunk = 4, 8, 2, 16, 16
    lengths = [5, 23, 12]  # crosses chunk boundaries, one sequence inside a chunk
    starts = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    T = int(starts[-1])
    pool = torch.randn(4, H, P, N) * 0.5
    slots = torch.tensor([2, 0, 3])
    has_initial = torch.tensor([True, False, True])
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(starts, chunk, T)
    common = dict(
        x=torch.randn(1, T, H, P).to(ACT), dt=torch.randn(1, T, H).to(ACT),
        A=-torch.exp(torch.randn(H) * 0.5), B=torch.randn(1, T, G, N).to(ACT),
        C=torch.randn(1, T, G, N).to(ACT), D=torch.randn(H), dt_bias=torch.randn(H) * 0.5,
        seq_idx=torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                        torch.tensor(lengths)).unsqueeze(0),
        cu_seqlens=starts)

    def run_scan(kernel, i):
        out = torch.empty(1, T, H, P, dtype=ACT)
        chunk_states, final_states, _ = kernel(
            i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=chunk, D=i["D"], z=None,
            dt_bias=i["dt_bias"], seq_idx=i["seq_idx"], chunk_indices=i.get("chunk_indices"),
            chunk_offsets=i.get("chunk_offsets"), cu_seqlens=i["cu_seqlens"],
            initial_states=i.get("initial_states"), return_varlen_states=True,
            return_final_states=False, return_track_states=True, dt_softplus=True,
            dt_limit=(0.0, float("inf")), out=out, state_dtype=torch.float32)
        return {"out": out, "final_states": final_states, "chunk_states": chunk_states}

    # As mamba.py calls it: states gathered from the pool, zeros where a request has no prefix.
    with_states = dict(common, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                       initial_states=torch.where(has_initial[:, None, None, None], pool[slots], 0))
    compare("mamba2_scan_from_states", with_states, run_scan, mamba_chunk_scan_combined,
            mamba2_scan.mamba_chunk_scan_combined, _bump("initial_states", 0))
    compare("mamba2_scan_from_zero", common, run_scan, mamba_chunk_scan_combined,
            mamba2_scan.mamba_chunk_scan_combined, _bump("x", (0, 2, 1)))

    # Decode, shaped as mamba.py passes it: per-head parameters expanded over headdim / dstate.
    batch = 3
    decode = dict(state=pool, x=torch.randn(batch, H, P).to(ACT),
                  dt=torch.randn(batch, H).to(ACT)[:, :, None].expand(-1, -1, P),
                  A=common["A"][:, None, None].expand(-1, P, N), B=torch.randn(batch, G, N).to(ACT),
                  C=torch.randn(batch, G, N).to(ACT), D=common["D"][:, None].expand(-1, P),
                  dt_bias=common["dt_bias"][:, None].expand(-1, P),
                  state_batch_indices=torch.tensor([1, -1, 3], dtype=torch.int32))

    def run_step(kernel, i):
        out = torch.empty(batch, H, P, dtype=ACT)
        kernel(i["state"], i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], z=None, dt_bias=i["dt_bias"],
               dt_softplus=True, state_batch_indices=i["state_batch_indices"], out=out)
        return {"out": out, "state": i["state"]}

    compare("mamba2_decode", decode, run_step, selective_state_update,
            mamba2_scan.selective_state_update, _bump("state", 1))


# ---- gated delta rule (Qwen3-Next) ----

def gdn_cases() -> None:
    H, HV, K, V = 2, 4, 16, 8  # K != V catches a transposed state layout; HV = 2 H is GQA
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV).to(ACT)

    def run_gating(kernel, i):
        g, beta = kernel(i["A_log"], i["a"], i["b"], i["dt_bias"])
        return {"g": g, "beta": beta}

    def bump_gates(inputs):
        inputs["a"][0] += 1.0
        inputs["b"][0] += 1.0

    # bfloat16 as served: the kernel rounds beta to b's dtype, the stand-in keeps float32.
    for dtype in (ACT, torch.bfloat16):
        gating = dict(a=torch.randn(9, 6).to(dtype), b=torch.randn(9, 6).to(dtype),
                      A_log=torch.randn(6), dt_bias=torch.randn(6).to(dtype))
        compare(f"gdn_gating_{str(dtype).removeprefix('torch.')}", gating, run_gating, fused_gdn_gating,
                sgl_kernel_mamba.fused_gdn_gating_cpu, bump_gates)

    lengths = [70, 9]  # the first spans two of the kernel's 64-token chunks
    T = sum(lengths)
    g, beta = fused_gdn_gating(A_log, torch.randn(T, HV), torch.randn(T, HV), dt_bias)
    half = torch.float16  # the chunked kernel refuses float32
    prefill = dict(q=torch.randn(1, T, H, K).to(half), k=torch.randn(1, T, H, K).to(half),
                   v=torch.randn(1, T, HV, V).to(half), g=g, beta=beta,
                   initial_state=torch.randn(4, HV, V, K) * 0.5,
                   cu_seqlens=torch.tensor([0, lengths[0], T]), initial_state_indices=torch.tensor([2, 0]))

    def run_chunk(kernel, i):
        out, _, _ = kernel(q=i["q"], k=i["k"], v=i["v"], g=i["g"], beta=i["beta"],
                           initial_state=i["initial_state"], cu_seqlens=i["cu_seqlens"], head_first=False,
                           use_qk_l2norm_in_kernel=True, initial_state_indices=i["initial_state_indices"])
        return {"out": out, "initial_state": i["initial_state"]}

    compare("gdn_prefill_cpu_op", prefill, run_chunk, chunk_gated_delta_rule,
            sgl_kernel_mamba.chunk_gated_delta_rule_cpu, _bump("initial_state", 2))

    batch = 3
    decode = dict(A_log=A_log, dt_bias=dt_bias, q=torch.randn(1, batch, H, K).to(ACT),
                  k=torch.randn(1, batch, H, K).to(ACT), v=torch.randn(1, batch, HV, V).to(ACT),
                  a=torch.randn(batch, HV).to(ACT), b=torch.randn(batch, HV).to(ACT),
                  initial_state_source=torch.randn(4, HV, V, K) * 0.5,
                  initial_state_indices=torch.tensor([1, -1, 3]),
                  cu_seqlens=torch.arange(batch + 1, dtype=torch.int32))

    def run_decode(kernel, i):
        out = kernel(A_log=i["A_log"], dt_bias=i["dt_bias"], q=i["q"], k=i["k"], v=i["v"], a=i["a"], b=i["b"],
                     initial_state_source=i["initial_state_source"],
                     initial_state_indices=i["initial_state_indices"], cu_seqlens=i["cu_seqlens"],
                     use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
        return {"out": out, "initial_state_source": i["initial_state_source"]}

    compare("gdn_decode_cpu_op", decode, run_decode, fused_sigmoid_gating_delta_rule_update,
            torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu, _bump("initial_state_source", 1))


# ---- elementwise: gated RMSNorm, shared-expert gate; KV slot table ----

def elementwise_cases() -> None:
    T, D = 7, 32
    norm = dict(x=torch.randn(T, D).to(ACT), g=torch.randn(T, D).to(ACT),
                weight=torch.randn(D).to(ACT), residual=torch.randn(T, D).to(ACT))
    for activation in ("swish", "sigmoid"):
        def run_norm(kernel, i, activation=activation):
            return {"y": kernel(i["x"], i["g"], i["weight"], None, activation, eps=1e-6)}

        compare(f"rms_norm_gated_{activation}", norm, run_norm, rms_norm_gated, norms.rms_norm_gated,
                _bump("g", 0, 1.0))

    def run_prenorm(kernel, i):
        y, h = kernel(i["x"], i["g"], i["weight"], None, "swish", residual=i["residual"], prenorm=True, eps=1e-6)
        return {"y": y, "residual_out": h}

    compare("rms_norm_gated_residual", norm, run_prenorm, rms_norm_gated, norms.rms_norm_gated,
            _bump("residual", 0, 1.0))

    gate = dict(hidden_states=torch.randn(5, 64).to(ACT), gate_weight=(torch.randn(64) * 0.2).to(ACT),
                shared_output=torch.randn(5, 64).to(ACT), output=torch.randn(5, 64).to(ACT))
    for do_add in (False, True):
        def run_gate(kernel, i, do_add=do_add):
            kernel(i["hidden_states"], i["gate_weight"], i["shared_output"], i["output"], do_add=do_add)
            return {"output": i["output"]}

        compare(f"gate_sigmoid_mul_add{int(do_add)}", gate, run_gate, _launch_fused_gate_sigmoid_mul,
                norms.fused_gate_sigmoid_mul, _bump("gate_weight", slice(None), 0.3))

    table = dict(req_pool_indices=torch.tensor([2, 0, 3]), req_to_token=torch.full((4, 48), -7, dtype=torch.int32),
                 start_offset=torch.tensor([0, 5, 10]), end_offset=torch.tensor([7, 6, 45]),
                 out_cache_loc=torch.arange(100, 100 + 43))

    def run_table(kernel, i):
        kernel(i["req_pool_indices"], i["req_to_token"], i["start_offset"], i["end_offset"], i["out_cache_loc"])
        return {"req_to_token": i["req_to_token"]}

    def triton_table(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
        batch = len(req_pool_indices)
        assign_req_to_token_pool[(batch,)](req_pool_indices, req_to_token, start_offset, end_offset,
                                           out_cache_loc, req_to_token.shape[1], 1 << (batch - 1).bit_length())

    def cpu_table(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
        sgl_kernel.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                                out_cache_loc, req_to_token.shape[1])

    compare("assign_req_to_token_pool_cpu_op", table, run_table, triton_table, cpu_table,
            _bump("out_cache_loc", slice(None), 1))


if __name__ == "__main__":
    torch.manual_seed(0)
    for cases in (conv_cases, mamba2_cases, gdn_cases, elementwise_cases):
        cases()
    print(json.dumps(RESULTS))

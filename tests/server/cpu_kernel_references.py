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

    # Speculative verify: a chain of 4 draft tokens per request ([batch, dim, steps]), the window
    # after every step saved to the verify's scratch rows (SGLang commits the accepted one).
    steps = 4
    verify = dict(x=torch.randn(3, dim, steps).to(ACT), conv_state=prefill["conv_states"],
                  weight=prefill["weight"], bias=prefill["bias"],
                  conv_state_indices=torch.tensor([2, 4, 0], dtype=torch.int32),
                  intermediate_conv_window=torch.zeros(3, steps, dim, width - 1).to(ACT),
                  intermediate_state_indices=torch.tensor([1, 2, 0], dtype=torch.int32))

    def run_verify(kernel, i):
        out = kernel(i["x"], i["conv_state"], i["weight"], i["bias"], "silu",
                     conv_state_indices=i["conv_state_indices"],
                     intermediate_conv_window=i["intermediate_conv_window"],
                     intermediate_state_indices=i["intermediate_state_indices"])
        return {"out": out, "conv_state": i["conv_state"], "intermediate_conv_window": i["intermediate_conv_window"]}

    compare("conv1d_update_verify", verify, run_verify, causal_conv1d_triton.causal_conv1d_update,
            conv1d.causal_conv1d_update, _bump("x", (0, slice(None), 1)))


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

    # Speculative verify (SGLang's target_verify): 4 draft tokens per request, the pool untouched
    # (disable_state_update), the state after every step in the verify's scratch rows.
    steps, T = 4, 4 * batch
    verify = dict(A_log=A_log, dt_bias=dt_bias, q=torch.randn(1, T, H, K).to(ACT),
                  k=torch.randn(1, T, H, K).to(ACT), v=torch.randn(1, T, HV, V).to(ACT),
                  a=torch.randn(T, HV).to(ACT), b=torch.randn(T, HV).to(ACT),
                  initial_state_source=torch.randn(4, HV, V, K) * 0.5,
                  initial_state_indices=torch.tensor([1, 0, 3]),
                  cu_seqlens=torch.arange(0, T + 1, steps, dtype=torch.int32),
                  intermediate_states_buffer=torch.zeros(batch, steps, HV, V, K),
                  intermediate_state_indices=torch.tensor([2, 0, 1], dtype=torch.int32))

    def run_verify(kernel, i):
        out = kernel(A_log=i["A_log"], dt_bias=i["dt_bias"], q=i["q"], k=i["k"], v=i["v"], a=i["a"], b=i["b"],
                     initial_state_source=i["initial_state_source"],
                     initial_state_indices=i["initial_state_indices"], cu_seqlens=i["cu_seqlens"],
                     use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
                     disable_state_update=True, intermediate_states_buffer=i["intermediate_states_buffer"],
                     intermediate_state_indices=i["intermediate_state_indices"], cache_steps=steps)
        return {"out": out, "initial_state_source": i["initial_state_source"],
                "intermediate_states_buffer": i["intermediate_states_buffer"]}

    compare("gdn_verify", verify, run_verify, fused_sigmoid_gating_delta_rule_update,
            gated_delta_rule.fused_sigmoid_gating_delta_rule_update, _bump("initial_state_source", 1))


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


# ---- speculative decoding's bookkeeping (EAGLE / NEXTN) ----

def speculative_cases() -> None:
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton

    from torch_kernels import speculative

    pool_len = 64
    slots = dict(req_pool_indices=torch.tensor([2, 0, 3]), req_to_token=torch.randperm(4 * pool_len).reshape(4, pool_len),
                 seq_lens=torch.tensor([5, 17, 40]), out_cache_loc=torch.full((3 * 4,), -1))

    def run_draft_locs(kernel, i):
        kernel(i["req_pool_indices"], i["req_to_token"], i["seq_lens"], i["out_cache_loc"])
        return {"out_cache_loc": i["out_cache_loc"]}

    def triton_draft_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc):
        assign_draft_cache_locs_contiguous[(3,)](req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, 1, 4,
                                                 BS=3)

    def cpu_draft_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc):
        speculative.assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                                           pool_len, 1, 4)

    compare("spec_assign_draft_cache_locs", slots, run_draft_locs, triton_draft_locs, cpu_draft_locs,
            _bump("seq_lens", 1, 1))

    extend = dict(req_pool_indices=torch.tensor([2, 0, 3]), req_to_token=slots["req_to_token"],
                  start_offset=torch.tensor([5, 17, 40]), end_offset=torch.tensor([7, 21, 41]),
                  out_cache_loc=torch.full((7,), -1))

    def run_extend_locs(kernel, i):
        kernel(i["req_pool_indices"], i["req_to_token"], i["start_offset"], i["end_offset"], i["out_cache_loc"])
        return {"out_cache_loc": i["out_cache_loc"]}

    def triton_extend_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
        assign_extend_cache_locs[(3,)](req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                       pool_len, 4)

    def cpu_extend_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
        speculative.assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                                 out_cache_loc, pool_len)

    compare("spec_assign_extend_cache_locs", extend, run_extend_locs, triton_extend_locs, cpu_extend_locs,
            _bump("start_offset", 0, 1))

    accept = dict(accept_tokens=torch.randint(2, 500, (3, 4)), accept_lens=torch.tensor([1, 4, 2]),
                  bonus=torch.zeros(3, dtype=torch.int64))

    def run_bonus(kernel, i):
        kernel(i["accept_tokens"], i["accept_lens"], i["bonus"], 4)
        return {"bonus": i["bonus"]}

    compare("spec_fill_bonus_tokens", accept, run_bonus, lambda *a: fill_bonus_tokens[(3,)](*a),
            speculative.fill_bonus_tokens_cpu, _bump("accept_lens", 0, 1))

    index = dict(accept_index=torch.tensor([0, -1, -1, -1, 4, 5, 6, 7, 8, 9, -1, -1]),
                 out_cache_loc=torch.randperm(100)[:12], accept_out=torch.full((12,), -1))

    def run_accept_locs(kernel, i):
        kernel(i["accept_index"], i["out_cache_loc"], i["accept_out"])
        return {"accept_out": i["accept_out"]}

    compare("spec_fill_accept_out_cache_loc", index, run_accept_locs,
            lambda *a: fill_accept_out_cache_loc[(12,)](*a, 16), speculative.fill_accept_out_cache_loc_cpu,
            _bump("accept_index", 4, 2))

    # A chain of 3 drafts (topk 1, NEXTN's) for two requests, and a topk-2 tree for a third.
    n, bs = 4, 2
    seq = torch.tensor([7, 12])
    tree = dict(parent_list=torch.tensor([[-1, 0, 1], [-1, 0, 1]]), selected_index=torch.tensor([[0, 1, 2], [0, 1, 2]]),
                verified_seq_len=seq, tree_mask=torch.ones(int(((seq + n) * n).sum()) + 16, dtype=torch.bool),  # room for the perturbed run
                positions=torch.zeros(bs * n, dtype=torch.int64),
                retrieve_index=torch.full((bs, n), -1), retrieve_next_token=torch.full((bs, n), -1),
                retrieve_next_sibling=torch.full((bs, n), -1))

    def run_tree(kernel, i):
        kernel(i["parent_list"], i["selected_index"], i["verified_seq_len"], i["tree_mask"], i["positions"],
               i["retrieve_index"], i["retrieve_next_token"], i["retrieve_next_sibling"], 1, 3, n, 0)
        return {k: i[k] for k in ("tree_mask", "positions", "retrieve_index", "retrieve_next_token",
                                  "retrieve_next_sibling")}

    compare("spec_build_tree", tree, run_tree, sgl_build_tree_kernel_triton,
            speculative.build_tree_kernel_efficient_cpu, _bump("verified_seq_len", 1, 1))

    # Greedy verification: request 0 rejects the first draft, 1 accepts all three, 2 (a tree:
    # the root's children 1 and 2 are siblings) accepts its second child, then its grandchild.
    verify = dict(
        predicts=torch.zeros(12, dtype=torch.int32), accept_index=torch.full((3, 4), -1, dtype=torch.int32),
        accept_token_num=torch.zeros(3, dtype=torch.int32),
        candidates=torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]),
        retrieve_index=torch.arange(12).reshape(3, 4),
        retrieve_next_token=torch.tensor([[1, 2, 3, -1], [1, 2, 3, -1], [1, -1, 3, -1]]),
        retrieve_next_sibling=torch.tensor([[-1, -1, -1, -1], [-1, -1, -1, -1], [-1, 2, -1, -1]]),
        target_predict=torch.tensor([99, 12, 13, 50, 21, 22, 23, 24, 32, 0, 33, 34]))

    def run_verify(kernel, i):
        kernel(i["predicts"], i["accept_index"], i["accept_token_num"], i["candidates"], i["retrieve_index"],
               i["retrieve_next_token"], i["retrieve_next_sibling"], i["target_predict"])
        return {k: i[k] for k in ("predicts", "accept_index", "accept_token_num")}

    compare("spec_verify_tree_greedy", verify, run_verify, verify_tree_greedy_triton,
            speculative.verify_tree_greedy_cpu, _bump("target_predict", 0, -88))


if __name__ == "__main__":
    torch.manual_seed(0)
    for cases in (conv_cases, mamba2_cases, gdn_cases, elementwise_cases, speculative_cases):
        cases()
    print(json.dumps(RESULTS))

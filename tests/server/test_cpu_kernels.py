"""The plain-torch kernel stand-ins of tests/cpu_engine (which let SGLang's CPU engine serve
hybrid models here), each checked against a reference.

- Against SGLang's own Triton kernels, run by the Triton interpreter in a subprocess
  (cpu_kernel_references.py prints the comparisons as JSON): every stand-in, including the
  sgl_kernel CPU-op wrappers.
- Against float64 token-by-token recurrences written out here: a prefill from a given state,
  that prefill split anywhere, the same tokens decoded one at a time, and a varlen batch
  (some sequences from a state, some from zeros, a padded slot) against each sequence alone.
  The stand-ins promise bitwise equality for the split / decode / batch comparisons (a prefix
  cache hit must reproduce the uncached output exactly), so those assert equality.
Every comparison also shows that a perturbed input moves the result far beyond the tolerance.
"""

import pytest

pytest.importorskip("sglang")

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CPU_ENGINE = Path(__file__).resolve().parents[1] / "cpu_engine"
REFERENCES = Path(__file__).with_name("cpu_kernel_references.py")


def stand_ins(*names: str) -> tuple:
    """The modules `names` of torch_kernels, imported without leaving tests/cpu_engine on sys.path
    (its sgl_kernel stand-in must not shadow anything else the suite imports)."""
    sys.path.insert(0, str(CPU_ENGINE))
    try:
        return tuple(importlib.import_module(f"torch_kernels.{name}") for name in names)
    finally:
        sys.path.remove(str(CPU_ENGINE))


conv1d, gated_delta_rule, mamba2_scan = stand_ins("conv1d", "gated_delta_rule", "mamba2_scan")


def _run_python(code_or_path, env_updates, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(CPU_ENGINE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(env_updates)
    args = [str(code_or_path)] if isinstance(code_or_path, Path) else ["-c", code_or_path]
    done = subprocess.run([sys.executable, "-W", "ignore", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- SGLang's kernels, interpreted

# Largest |stand-in - kernel| allowed, relative to max(1, largest |kernel output|). float32 runs
# agree to ~2e-7; the chunked delta rule runs in float16 (it refuses float32) and rounds its
# intermediates to it; on bfloat16 gates the kernel rounds beta to bfloat16 (one ulp below 1 is
# 2^-8), the stand-in keeps float32 so a token gets the same gate prefilled or decoded.
DEFAULT_RTOL = 1e-5
RTOL = {"gdn_prefill_cpu_op": 3e-3, "gdn_gating_bfloat16": 2.0 ** -8}
CASES = [
    "conv1d_fn", "conv1d_fn_cpu_op", "conv1d_update", "conv1d_update_cpu_op",
    "mamba2_scan_from_states", "mamba2_scan_from_zero", "mamba2_decode",
    "gdn_gating_float32", "gdn_gating_bfloat16", "gdn_prefill_cpu_op", "gdn_decode_cpu_op",
    "rms_norm_gated_swish", "rms_norm_gated_sigmoid", "rms_norm_gated_residual",
    "gate_sigmoid_mul_add0", "gate_sigmoid_mul_add1", "assign_req_to_token_pool_cpu_op",
    # speculative decoding (NEXTN / EAGLE): verify's per-step states, and the bookkeeping ops
    "conv1d_update_verify", "gdn_verify", "spec_assign_draft_cache_locs", "spec_assign_extend_cache_locs",
    "spec_fill_bonus_tokens", "spec_fill_accept_out_cache_loc", "spec_build_tree", "spec_verify_tree_greedy",
]


@pytest.fixture(scope="module")
def kernel_comparisons():
    return _run_python(REFERENCES, {"TRITON_INTERPRET": "1"})


def test_every_case_was_compared(kernel_comparisons):
    assert {key.split("/")[0] for key in kernel_comparisons} == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_stand_in_matches_sglang_kernel(kernel_comparisons, case):
    outputs = {key: r for key, r in kernel_comparisons.items() if key.split("/")[0] == case}
    rtol = RTOL.get(case, DEFAULT_RTOL)
    sensitivity = 0.0
    for key, r in outputs.items():
        tolerance = rtol * max(1.0, r["magnitude"]) if r["dtype"].startswith("float") else 0.0
        assert r["diff"] <= tolerance, (key, r)
        sensitivity = max(sensitivity, r["perturbed_diff"] / max(tolerance, 1e-12))
    assert sensitivity > 10, f"{case}: a perturbed input stays within tolerance: {outputs}"


def test_patches_bind_stand_ins():
    """With SGLANG_USE_CPU_ENGINE=1 and tests/cpu_engine on PYTHONPATH, sitecustomize swaps the
    Triton-only kernels for the stand-ins in the modules that call them, and the sgl_kernel
    stand-in provides the CPU ops."""
    code = """
import json, torch
import sglang.srt.layers.attention.mamba.mamba as mamba
from sglang.kernels.ops.mamba import causal_conv1d_triton
from sglang.kernels.ops.mamba.triton_ops import mamba_ssm
from sglang.kernels.ops.attention.fla import fused_norm_gate
from sglang.kernels.ops.elementwise import elementwise
from sglang.srt.layers.attention.linear import gdn_backend
from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
bound = {name: f.__module__ for name, f in {
    "scatter.fused_mamba_state_scatter_with_mask": scatter.fused_mamba_state_scatter_with_mask,
    "scatter.fused_conv_window_scatter_with_mask": scatter.fused_conv_window_scatter_with_mask,
    "scatter.fused_conv_window_scatter_multi": scatter.fused_conv_window_scatter_multi,
    "mamba.causal_conv1d_fn_triton": mamba.causal_conv1d_fn_triton,
    "mamba.causal_conv1d_update_triton": mamba.causal_conv1d_update_triton,
    "mamba.causal_conv1d_fn": mamba.causal_conv1d_fn,
    "mamba.mamba_chunk_scan_combined": mamba.mamba_chunk_scan_combined,
    "causal_conv1d_triton.causal_conv1d_update": causal_conv1d_triton.causal_conv1d_update,
    "mamba_ssm.selective_state_update": mamba_ssm.selective_state_update,
    "fused_norm_gate.rms_norm_gated": fused_norm_gate.rms_norm_gated,
    "elementwise._launch_fused_gate_sigmoid_mul": elementwise._launch_fused_gate_sigmoid_mul,
    "gdn_backend.causal_conv1d_fn": gdn_backend.causal_conv1d_fn,
    "gdn_backend.fused_gdn_gating": gdn_backend.fused_gdn_gating,
}.items()}
bound["device_module"] = torch.get_device_module().__name__
import sgl_kernel
try:
    sgl_kernel.rotate_input_ids_cpu()
except NotImplementedError as error:
    bound["stub_error"] = str(error)
print(json.dumps(bound))
"""
    bound = _run_python(code, {"SGLANG_USE_CPU_ENGINE": "1"})
    assert bound.pop("device_module") == "torch.cpu"
    assert "rotate_input_ids_cpu" in bound.pop("stub_error")  # unported ops import, and name themselves
    assert bound["gdn_backend.causal_conv1d_fn"] == "sgl_kernel.mamba"
    assert bound.pop("gdn_backend.fused_gdn_gating") == "sgl_kernel.mamba"
    assert all(module.startswith("torch_kernels.") for name, module in bound.items()
               if not name.startswith("gdn_backend")), bound


# ---------------------------------------------------------------- float64 recurrences

def _max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_close_and_sensitive(actual, expected, perturbed_expected, rtol=1e-5):
    tolerance = rtol * max(1.0, expected.abs().max().item())
    assert _max_abs(actual, expected) <= tolerance
    assert _max_abs(actual, perturbed_expected) > 100 * tolerance


def _assert_same(*pairs):
    for actual, expected in pairs:
        assert torch.equal(actual, expected), _max_abs(actual, expected)


# ---- causal conv1d

def conv_reference(x, weight, bias, history):
    """float64: x [dim, T], history [dim, width - 1] -> silu(conv) [dim, T], new history."""
    width = weight.shape[1]
    window = torch.cat([history.double(), x.double()], dim=1)
    out = torch.stack([(window[:, t:t + width] * weight.double()).sum(1) + bias.double()
                       for t in range(x.shape[1])], dim=1)
    return F.silu(out), window[:, -(width - 1):]


def _conv_inputs(dim=12, width=4, slots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    return rand(dim, width), rand(dim), rand(slots, dim, width - 1), lambda T: rand(dim, T)


def _conv_prefill(x, weight, bias, pool, slot, from_state):
    return conv1d.causal_conv1d_fn(x, weight, bias, pool, torch.tensor([0, x.shape[1]]),
                                   cache_indices=torch.tensor([slot]), has_initial_state=torch.tensor([from_state]),
                                   activation="silu")


def test_conv_prefill_matches_float64_recurrence():
    weight, bias, pool, tokens = _conv_inputs()
    x = tokens(9)
    expected, history = conv_reference(x, weight, bias, pool[1])
    perturbed, _ = conv_reference(x, weight, bias, pool[1] + 1)
    out = _conv_prefill(x, weight, bias, pool, 1, True)
    _assert_close_and_sensitive(out, expected, perturbed)
    _assert_close_and_sensitive(pool[1], history, history + 1)


def test_conv_prefill_equals_split_prefill_and_decode_steps():
    weight, bias, pool, tokens = _conv_inputs()
    x = tokens(10)
    whole = pool.clone()
    expected = _conv_prefill(x, weight, bias, whole, 2, True)
    for split in range(1, 10):
        parts = pool.clone()
        head = _conv_prefill(x[:, :split], weight, bias, parts, 2, True)
        tail = _conv_prefill(x[:, split:], weight, bias, parts, 2, True)
        _assert_same((torch.cat([head, tail], 1), expected), (parts, whole))
    steps = pool.clone()
    decoded = [conv1d.causal_conv1d_update(x[:, t][None], steps, weight, bias, "silu",
                                           conv_state_indices=torch.tensor([2]))[0] for t in range(10)]
    _assert_same((torch.stack(decoded, 1), expected), (steps, whole))


def test_conv_varlen_batch_equals_each_sequence_alone():
    weight, bias, pool, tokens = _conv_inputs()
    lengths, slots, from_state = [4, 7, 3, 5], [3, 0, -1, 1], [True, False, True, False]
    x = tokens(sum(lengths))
    starts = torch.tensor([0, *lengths]).cumsum(0)
    batched = pool.clone()
    out = conv1d.causal_conv1d_fn(x, weight, bias, batched, starts, cache_indices=torch.tensor(slots),
                                  has_initial_state=torch.tensor(from_state), activation="silu")
    alone = pool.clone()
    for i, slot in enumerate(slots):
        if slot < 0:  # padded row: skipped
            continue
        cols = slice(starts[i], starts[i + 1])
        _assert_same((out[:, cols], _conv_prefill(x[:, cols], weight, bias, alone, slot, from_state[i])))
    _assert_same((batched, alone))
    assert not torch.equal(batched[3], pool[3]) and torch.equal(batched[2], pool[2])


# ---- Mamba2 scan

def ssm_reference(x, dt, A, B, C, D, dt_bias, state):
    """float64, one sequence: x [T, H, P]; dt [T, H] (raw); A, D, dt_bias [H]; B, C [T, G, N];
    state [H, P, N]. Returns y [T, H, P] and the final state."""
    H = x.shape[1]
    state = state.double()
    ys = []
    for t in range(x.shape[0]):
        step = F.softplus(dt[t].double() + dt_bias.double())  # [H]
        Bh = B[t].double().repeat_interleave(H // B.shape[1], 0)  # [H, N]
        Ch = C[t].double().repeat_interleave(H // C.shape[1], 0)
        state = torch.exp(step * A.double())[:, None, None] * state \
            + (step[:, None] * x[t].double())[:, :, None] * Bh[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, Ch) + D.double()[:, None] * x[t].double())
    return torch.stack(ys), state


def _ssm_inputs(T, H=4, P=8, G=2, N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    return dict(x=rand(T, H, P), dt=rand(T, H), A=-torch.exp(rand(H) * 0.5), B=rand(T, G, N), C=rand(T, G, N),
                D=rand(H), dt_bias=rand(H) * 0.5), rand(3, H, P, N) * 0.5


def _ssm_prefill(inp, lengths, initial_states, chunk_size=8):
    """mamba_chunk_scan_combined as mamba.py calls it; returns (y, per-sequence final states, chunk states)."""
    T, H, P = inp["x"].shape
    out = torch.empty(1, T, H, P)
    chunk_states, finals, _ = mamba2_scan.mamba_chunk_scan_combined(
        inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None], chunk_size, D=inp["D"],
        dt_bias=inp["dt_bias"], cu_seqlens=torch.tensor([0, *lengths]).cumsum(0), initial_states=initial_states,
        return_varlen_states=True, return_track_states=True, dt_softplus=True, out=out, state_dtype=torch.float32)
    return out[0], finals, chunk_states[0]


def _ssm_decode(inp, pool, slot):
    """The tokens of `inp` one at a time through selective_state_update, shaped as mamba.py passes them."""
    T, H, P = inp["x"].shape
    N = inp["B"].shape[-1]
    ys = []
    for t in range(T):
        out = torch.empty(1, H, P)
        mamba2_scan.selective_state_update(
            pool, inp["x"][t][None], inp["dt"][t][None, :, None].expand(-1, -1, P),
            inp["A"][:, None, None].expand(-1, P, N), inp["B"][t][None], inp["C"][t][None],
            inp["D"][:, None].expand(-1, P), dt_bias=inp["dt_bias"][:, None].expand(-1, P), dt_softplus=True,
            state_batch_indices=torch.tensor([slot]), out=out)
        ys.append(out[0])
    return torch.stack(ys)


def _slice(inp, start, stop):
    return {k: v[start:stop] if k in ("x", "dt", "B", "C") else v for k, v in inp.items()}


def test_mamba2_prefill_matches_float64_recurrence():
    inp, pool = _ssm_inputs(30)
    expected_y, expected_state = ssm_reference(**inp, state=pool[0])
    # A perturbed entering state moves the early outputs; a perturbed last token the final state.
    perturbed_x = inp["x"].clone()
    perturbed_x[-1] += 1
    perturbed_y, perturbed_state = ssm_reference(**dict(inp, x=perturbed_x), state=pool[0] + 0.5)
    y, finals, chunk_states = _ssm_prefill(inp, [30], pool[:1])
    _assert_close_and_sensitive(y, expected_y, perturbed_y)
    _assert_close_and_sensitive(finals[0], expected_state, perturbed_state)
    # Chunk-grid states: entry c is the state after token c * chunk_size - 1.
    _, after_16 = ssm_reference(**_slice(inp, 0, 16), state=pool[0])
    _, after_17 = ssm_reference(**_slice(inp, 0, 17), state=pool[0])
    _assert_close_and_sensitive(chunk_states[2], after_16, after_17)


def test_mamba2_prefill_equals_split_prefill_and_decode_steps():
    T = 20
    inp, pool = _ssm_inputs(T)
    y, finals, _ = _ssm_prefill(inp, [T], pool[:1])
    for split in range(1, T):
        y_head, head_state, _ = _ssm_prefill(_slice(inp, 0, split), [split], pool[:1])
        y_tail, tail_state, _ = _ssm_prefill(_slice(inp, split, T), [T - split], head_state)
        _assert_same((torch.cat([y_head, y_tail]), y), (tail_state, finals))
    steps = pool.clone()
    _assert_same((_ssm_decode(inp, steps, 0), y), (steps[0], finals[0]))


def test_mamba2_varlen_batch_equals_each_sequence_alone():
    lengths = [5, 11, 1, 9]
    inp, pool = _ssm_inputs(sum(lengths))
    initial = torch.stack([pool[0], torch.zeros_like(pool[0]), pool[1], pool[2]])  # the second from zeros
    y, finals, _ = _ssm_prefill(inp, lengths, initial)
    start = 0
    for i, length in enumerate(lengths):
        y_alone, final_alone, _ = _ssm_prefill(_slice(inp, start, start + length), [length], initial[i:i + 1])
        _assert_same((y[start:start + length], y_alone), (finals[i], final_alone[0]))
        start += length
    assert not torch.equal(finals[0], finals[3])


# ---- gated delta rule

def delta_rule_reference(q, k, v, g, beta, state):
    """float64, one sequence: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; state [HV, V, K].
    l2-normalised q, k (eps 1e-6), q scaled by K^-0.5. Returns o [T, HV, V] and the final state."""
    group = v.shape[1] // q.shape[1]
    norm = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)
    q = norm(q.double().repeat_interleave(group, 1)) * q.shape[-1] ** -0.5
    k = norm(k.double().repeat_interleave(group, 1))
    state = state.double()
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t].double())[:, None, None]
        error = v[t].double() - torch.einsum("hvk,hk->hv", state, k[t])
        state = state + beta[t].double()[:, None, None] * error[:, :, None] * k[t][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", state, q[t]))
    return torch.stack(outs), state


def _gdn_inputs(T, H=2, HV=4, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    return dict(q=rand(T, H, K), k=rand(T, H, K), v=rand(T, HV, V), a=rand(T, HV), b=rand(T, HV),
                A_log=rand(HV) * 0.5, dt_bias=rand(HV)), rand(4, HV, V, K) * 0.5


def _gdn_prefill(inp, lengths, pool, slots):
    g, beta = gated_delta_rule.fused_gdn_gating(inp["A_log"], inp["a"], inp["b"], inp["dt_bias"])
    out, _, _ = gated_delta_rule.chunk_gated_delta_rule(
        inp["q"][None], inp["k"][None], inp["v"][None], g, beta, initial_state=pool,
        initial_state_indices=torch.tensor(slots), cu_seqlens=torch.tensor([0, *lengths]).cumsum(0),
        use_qk_l2norm_in_kernel=True)
    return out[0]


def _gdn_slice(inp, start, stop):
    return {k: v[start:stop] if k in ("q", "k", "v", "a", "b") else v for k, v in inp.items()}


def test_gdn_prefill_matches_float64_recurrence():
    inp, pool = _gdn_inputs(30)
    g, beta = gated_delta_rule.fused_gdn_gating(inp["A_log"], inp["a"], inp["b"], inp["dt_bias"])
    expected_o, expected_state = delta_rule_reference(inp["q"], inp["k"], inp["v"], g[0], beta[0], pool[3])
    # A perturbed entering state moves the early outputs; a perturbed last token the final state.
    perturbed_v = inp["v"].clone()
    perturbed_v[-1] += 1
    perturbed_o, perturbed_state = delta_rule_reference(inp["q"], inp["k"], perturbed_v, g[0], beta[0], pool[3] + 0.5)
    out = _gdn_prefill(inp, [30], pool, [3])
    _assert_close_and_sensitive(out, expected_o, perturbed_o)
    _assert_close_and_sensitive(pool[3], expected_state, perturbed_state)


def test_gdn_prefill_equals_split_prefill_and_decode_steps():
    T = 20
    inp, pool = _gdn_inputs(T)
    whole = pool.clone()
    expected = _gdn_prefill(inp, [T], whole, [1])
    for split in range(1, T):
        parts = pool.clone()
        head = _gdn_prefill(_gdn_slice(inp, 0, split), [split], parts, [1])
        tail = _gdn_prefill(_gdn_slice(inp, split, T), [T - split], parts, [1])
        _assert_same((torch.cat([head, tail]), expected), (parts, whole))
    steps = pool.clone()
    decoded = [gated_delta_rule.fused_sigmoid_gating_delta_rule_update(
        inp["A_log"], inp["a"][t:t + 1], inp["dt_bias"], 1.0, 20.0, inp["q"][None, t:t + 1],
        inp["k"][None, t:t + 1], inp["v"][None, t:t + 1], inp["b"][t:t + 1], steps, torch.tensor([1]),
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 1]))[0, 0] for t in range(T)]
    _assert_same((torch.stack(decoded), expected), (steps, whole))


def test_gdn_varlen_batch_equals_each_sequence_alone():
    lengths, slots = [6, 9, 4, 7], [2, -1, 0, 3]  # the second row is padding: skipped, output 0
    inp, pool = _gdn_inputs(sum(lengths))
    pool[0] = 0  # a sequence without a prefix starts from a zeroed slot
    batched = pool.clone()
    out = _gdn_prefill(inp, lengths, batched, slots)
    alone = pool.clone()
    start = 0
    for length, slot in zip(lengths, slots):
        rows = slice(start, start + length)
        expected = torch.zeros_like(out[rows]) if slot < 0 else _gdn_prefill(_gdn_slice(inp, start, start + length),
                                                                              [length], alone, [slot])
        _assert_same((out[rows], expected))
        start += length
    _assert_same((batched, alone))
    assert torch.equal(batched[1], pool[1]) and not torch.equal(batched[2], pool[2])


# ---------------------------------------------------------------- speculative decoding's commits

def _speculative_stand_ins():
    sys.path.insert(0, str(CPU_ENGINE))
    try:
        from torch_kernels import speculative
    finally:
        sys.path.remove(str(CPU_ENGINE))
    return speculative


def test_verified_state_scatters_match_sglangs_torch_path():
    """Committing the accepted draft step's states after a verify: the stand-ins of SGLang's
    Triton scatters against SGLang's own torch path for the same scatter
    (`HybridLinearAttnBackend._scatter_speculative_state_with_mask`, which it runs off CUDA), on
    SSM states, on conv windows read through an overlapping strided view (as SGLang keeps them),
    with steps of -1 (nothing to commit), out-of-range rows, and the track slots' second set."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    reference = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    speculative = _speculative_stand_ins()
    g = torch.Generator().manual_seed(3)
    layers, slots, rows, steps = 2, 6, 4, 4
    dst_rows = torch.tensor([3, 0, 5, 9], dtype=torch.int32)  # 9: out of range, skipped
    step_rows = torch.tensor([2, -1, 0, 1], dtype=torch.int32)  # -1: nothing to commit
    src_rows = torch.tensor([1, 0, 3, 2], dtype=torch.int32)
    ssm_dst = torch.randn(layers, slots, 3, 5, generator=g)
    ssm_src = torch.randn(layers, rows, steps, 3, 5, generator=g)
    for src_indices in (None, src_rows):
        want, got = ssm_dst.clone(), ssm_dst.clone()
        reference(want, ssm_src, dst_rows, step_rows, src_indices)
        speculative.fused_mamba_state_scatter_with_mask(got, ssm_src, dst_rows, step_rows, src_indices)
        assert torch.equal(got, want) and not torch.equal(want, ssm_dst)
    dim, width = 6, 4
    inputs = torch.randn(layers, rows, dim, steps + width - 1, generator=g)
    windows = inputs.unfold(3, width - 1, 1)[..., 1:steps + 1, :].permute(0, 1, 3, 2, 4)  # [L, rows, steps, dim, w-1]
    assert windows.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()  # a view: windows overlap
    conv_dst = torch.randn(layers, slots, dim, width - 1, generator=g)
    want, got = conv_dst.clone(), conv_dst.clone()
    reference(want, windows, dst_rows, step_rows)
    speculative.fused_conv_window_scatter_with_mask(got, windows, dst_rows, step_rows)
    assert torch.equal(got, want) and not torch.equal(want, conv_dst)
    track_rows, track_steps = torch.tensor([4, 1, 2, 0], dtype=torch.int32), torch.tensor([-1, 3, -1, 0], dtype=torch.int32)
    want, got = conv_dst.clone(), conv_dst.clone()
    reference(want, windows, dst_rows, step_rows)
    reference(want, windows, track_rows, track_steps)
    speculative.fused_conv_window_scatter_multi([(got, windows)], dst_rows, step_rows, track_rows, track_steps)
    assert torch.equal(got, want)


def test_kv_slot_copy_matches_indexing():
    """`copy_all_layer_kv_cache_cpu` (moving accepted drafts' KV to their final slots): every
    buffer's rows `tgt` take rows `src` as they were before the copy, as indexing does."""
    speculative = _speculative_stand_ins()
    g = torch.Generator().manual_seed(4)
    buffers = [torch.randn(12, 2, 3, generator=g), torch.randn(12, 5, generator=g).to(torch.bfloat16)]
    want = [b.clone() for b in buffers]
    src, tgt = torch.tensor([3, 4, 5, 9]), torch.tensor([4, 5, 6, 1])  # overlapping: read before written
    for w in want:
        w[tgt] = w[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    speculative.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(buffers, want):
        assert torch.equal(b, w)


# ---------------------------------------------------------------- tensor parallelism (--tp-size 2)

# One rank of a 2-rank gloo group, run as its own process (RANK, PORT in the environment) with
# the stand-ins installed: SGLang's GroupCoordinator as `init_model_parallel_group` builds it on
# CPU (PyNccl asked for), its collectives against torch.distributed's on the same gloo world,
# and PyNccl with the real NCCL library (the guard undone) for contrast.
_TP_RANK = """
import json, os, torch
import torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=2)
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.distributed.device_communicators import pynccl
tp = GroupCoordinator(group_ranks=[[0, 1]], local_rank=rank, torch_distributed_backend="gloo", use_pynccl=True,
                      use_mscclpp=False, use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                      use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
out = {"device": str(tp.device), "pynccl_disabled": tp.pynccl_comm.disabled}
g = torch.Generator().manual_seed(100 + rank)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(5, 6, generator=g).to(dtype)
    ref = x.clone()
    dist.all_reduce(ref)
    got = tp.all_reduce(x.clone())
    out[f"all_reduce/{dtype}"] = dict(equal=torch.equal(got, ref), moved=(got.double() - x.double()).abs().max().item())
    for dim in (0, -1):
        parts = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(parts, x)
        got = tp.all_gather(x, dim=dim)
        ref = torch.cat(parts, dim=dim)
        out[f"all_gather/{dtype}/{dim}"] = dict(equal=torch.equal(got, ref), shape=list(got.shape))
pynccl.NCCLLibrary = pynccl.NCCLLibrary.original  # the guard undone: what the server met
try:
    comm = pynccl.PyNcclCommunicator(group=tp.cpu_group, device=tp.device)
    out["unguarded"] = "disabled" if comm.disabled else "enabled"  # disabled: no NCCL library here at all
except Exception as error:
    out["unguarded"] = f"{type(error).__name__}: {error}"
print(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


def _tp_ranks(code, extra_env=None, timeout=300):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(CPU_ENGINE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", PORT=str(port), **(extra_env or {}))
    ranks = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    try:
        for p in ranks:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_tensor_parallel_collectives_on_cpu_match_torch_distributed():
    """The PyNccl guard (cpu_distributed.guard_pynccl): SGLang's TP group comes up on CPU with
    PyNccl disabled, and its all-reduce / all-gather (SGLang's own gloo path: no shm kernel
    without AMX) equal torch.distributed's on the same tensors. Without the guard, PyNccl finds
    the CUDA build's NCCL and fails as the server did."""
    for out in _tp_ranks(_TP_RANK):
        assert out.pop("device") == "cpu" and out.pop("pynccl_disabled") is True
        unguarded = out.pop("unguarded")
        checked = out
        assert len(checked) == 6, checked
        assert all(r["equal"] for r in checked.values()), checked
        for key, r in checked.items():
            if key.startswith("all_reduce"):
                assert r["moved"] > 0.1, (key, r)  # the other rank's tensor was added
            else:
                assert r["shape"] == ([10, 6] if key.endswith("/0") else [5, 12]), (key, r)
        # The guard is what keeps PyNccl off, where torch ships NCCL (SGLang's pinned CUDA build).
        assert unguarded in ("ValueError: Expected a cuda device, but got: cpu", "disabled"), unguarded

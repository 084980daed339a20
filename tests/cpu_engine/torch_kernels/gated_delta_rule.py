"""Gated delta rule (Qwen3-Next's gated delta net layers): gating, prefill, decode.

Replaces SGLang's Triton `fused_gdn_gating` (`sglang.kernels.ops.attention.linear`),
`chunk_gated_delta_rule` (`...attention.fla.chunk`) and
`fused_sigmoid_gating_delta_rule_update` (`...attention.linear.fused_sigmoid_gating_recurrent`),
which sgl-kernel's CPU build provides as `fused_gdn_gating_cpu`, `chunk_gated_delta_rule_cpu`
and `fused_sigmoid_gating_delta_rule_update_cpu`.

Per value head (query/key head hv // (HV // H) serves value head hv), with the state S [V, K]
(pool layout [slots, HV, V, K], as SGLang's kernels keep it):
    S_t = exp(g_t) S_{t-1};  S_t += beta_t (v_t - S_t k_t) k_t^T;  o_t = S_t q_t
with q, k l2-normalised (when requested; eps 1e-6) and q scaled by `scale` (default K^-0.5).
The gates come from g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), in float32.
Prefill and decode advance S with the same per-token arithmetic (see the package docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import COMPUTE_DTYPE, PAD_SLOT_ID, round_to_state_precision

CHUNK_SIZE = 64  # the Triton kernel's chunk (FLA's CHUNK_SIZE): the grid of the states h returns


def _gates(A_log, a, dt_bias, b, softplus_beta=1.0, softplus_threshold=20.0):
    """float32 (g, beta), each shaped like a / b: computed in float64 and rounded, so prefill
    (many tokens) and decode (one) agree although float32 exp takes a different (vectorised or
    scalar) path depending on the element count."""
    to64 = lambda t: t.to(COMPUTE_DTYPE)
    g = -torch.exp(to64(A_log)) * F.softplus(to64(a) + to64(dt_bias), beta=softplus_beta,
                                             threshold=softplus_threshold)
    return g.float(), torch.sigmoid(to64(b)).float()


def fused_gdn_gating(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """a, b [T, HV] -> (g, beta), each [1, T, HV] float32. The Triton kernel rounds beta to b's
    dtype; it stays float32 here, as the decode kernel computes it, so that a token prefilled
    and the same token decoded get the same gate."""
    g, gate = _gates(A_log, a, dt_bias, b, beta, threshold)
    return g.unsqueeze(0), gate.unsqueeze(0)


def _prepared_qk(q, k, num_v_heads, use_qk_l2norm, scale):
    """q, k [..., H, K] -> float64 [..., HV, K] (one head per value head), l2-normalised when
    asked (eps 1e-6, as the kernels do); q scaled."""
    group = num_v_heads // q.shape[-2]
    q = q.to(COMPUTE_DTYPE).repeat_interleave(group, dim=-2)
    k = k.to(COMPUTE_DTYPE).repeat_interleave(group, dim=-2)
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * scale, k


def delta_rule_step(state, q, k, v, decay, beta):
    """One token (float64): state [..., HV, V, K]; q, k [..., HV, K] (prepared); v [..., HV, V];
    decay = exp(g), beta [..., HV]. Returns (o [..., HV, V], new state)."""
    state = state * decay[..., None, None]
    correction = (v - (state * k[..., None, :]).sum(-1)) * beta[..., None]
    state = round_to_state_precision(state + correction[..., None] * k[..., None, :])
    return (state * q[..., None, :]).sum(-1), state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           initial_state_indices=None, cu_seqlens=None, head_first=False,
                           use_qk_l2norm_in_kernel=False, inplace_update=True):
    """Drop-in for the Triton `chunk_gated_delta_rule` (prefill). q, k [1, T, H, K];
    v [1, T, HV, V]; g, beta [1, T, HV]; cu_seqlens [N + 1] delimits the sequences;
    sequence i starts from initial_state[initial_state_indices[i]] ([slots, HV, V, K]) and,
    with inplace_update, leaves its final state there. Rows whose slot is PAD_SLOT_ID are
    skipped (output 0). Returns (o [1, T, HV, V] in q's dtype, None, h): h [1, NT, HV, V, K]
    holds, as the Triton kernel's per-chunk states do, the state entering each CHUNK_SIZE-token
    chunk of each sequence (sequence i's chunks from sum_{j<i} ceil(len_j / CHUNK_SIZE) on;
    chunk 0: its initial state), which the extra_buffer strategy snapshots. They stay float32
    (the Triton kernel rounds them to q's dtype): a snapshot then equals the state a prefill
    ending there leaves in the pool, so a hit on it reproduces the uncached output exactly."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule stand-in: head_first layout")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qs, ks = _prepared_qk(q[0], k[0], v.shape[2], use_qk_l2norm_in_kernel, scale)
    vs, decays, betas = v[0].to(COMPUTE_DTYPE), torch.exp(g[0].to(COMPUTE_DTYPE)), beta[0].to(COMPUTE_DTYPE)
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    slots = initial_state_indices.tolist() if initial_state_indices is not None else list(range(len(bounds) - 1))
    out = torch.zeros(v.shape, dtype=q.dtype)
    chunks = [-(-(bounds[i + 1] - bounds[i]) // CHUNK_SIZE) for i in range(len(bounds) - 1)]
    h = torch.zeros(1, sum(chunks), *initial_state.shape[1:], dtype=torch.float32)
    for seq, slot in enumerate(slots):
        start, end = bounds[seq], bounds[seq + 1]
        if slot == PAD_SLOT_ID or end <= start:
            continue
        state = initial_state[slot].to(COMPUTE_DTYPE)
        outputs = torch.empty(end - start, *v.shape[2:], dtype=COMPUTE_DTYPE)
        first_chunk = sum(chunks[:seq])
        for t in range(start, end):
            if (t - start) % CHUNK_SIZE == 0:
                h[0, first_chunk + (t - start) // CHUNK_SIZE] = state
            outputs[t - start], state = delta_rule_step(state, qs[t], ks[t], vs[t], decays[t], betas[t])
        out[0, start:end] = outputs.to(out.dtype)
        if inplace_update:
            initial_state[slot] = state.to(initial_state.dtype)
    return out, None, h


def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold,
                                           q, k, v, b, initial_state_source,
                                           initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                           is_kda=False, lower_bound=None,
                                           disable_state_update=False,
                                           intermediate_states_buffer=None,
                                           intermediate_state_indices=None, cache_steps=None,
                                           retrieve_parent_token=None, **speculative_options):
    """Drop-in for the Triton decode kernel: gating plus the recurrence, token by token.
    q, k [1, T, H, K]; v [1, T, HV, V]; a, b [T, HV]; cu_seqlens [N + 1] (without it, each of
    the B rows of [B, T, ...] inputs is a sequence). Sequence i runs from
    initial_state_source[initial_state_indices[i]] and writes its final state back (unless
    disable_state_update); a PAD_SLOT_ID row runs from a zero state and writes nothing, as the
    Triton kernel does. Returns o shaped like v, in q's dtype.

    Speculative verify (SGLang's target_verify: a chain of draft tokens per sequence, state
    update disabled): with `intermediate_states_buffer` ([rows, >= steps, HV, V, K]) the state
    after each step t goes to intermediate_states_buffer[intermediate_state_indices[i], t]
    (a negative row: none), as the kernel's CACHE_INTERMEDIATE_STATES does; SGLang commits the
    accepted step's state after verification. KDA gates, draft trees (retrieve_parent_token)
    and the ReplaySSM options (speculative_options; any that is set is rejected) are not
    supported."""
    if is_kda or lower_bound is not None or retrieve_parent_token is not None \
            or any(option is not None and option is not False for option in speculative_options.values()):
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update stand-in: KDA, draft trees, ReplaySSM")
    batch, steps, _, K = k.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    flat = lambda t: t.reshape(batch * steps, *t.shape[2:])
    qs, ks = _prepared_qk(flat(q), flat(k), HV, use_qk_l2norm_in_kernel, scale)
    vs = flat(v).to(COMPUTE_DTYPE)
    g, beta = _gates(A_log, a.reshape(-1, HV), dt_bias, b.reshape(-1, HV), softplus_beta, softplus_threshold)
    decays, betas = torch.exp(g.to(COMPUTE_DTYPE)), beta.to(COMPUTE_DTYPE)
    if cu_seqlens is not None:
        bounds = cu_seqlens.long()
    else:
        bounds = torch.arange(batch + 1) * steps
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    slots = initial_state_indices.long()
    live = slots != PAD_SLOT_ID
    state = torch.zeros(len(slots), *initial_state_source.shape[1:], dtype=COMPUTE_DTYPE)
    state[live] = initial_state_source[slots[live]].to(COMPUTE_DTYPE)
    out = torch.zeros(vs.shape, dtype=COMPUTE_DTYPE)
    cache_rows = None
    if intermediate_states_buffer is not None:
        cache_rows = intermediate_state_indices.long()
    for step in range(int(lengths.max()) if len(lengths) else 0):
        rows = torch.nonzero(lengths > step).squeeze(1)  # sequences that have this step
        tok = starts[rows] + step
        o, state[rows] = delta_rule_step(state[rows], qs[tok], ks[tok], vs[tok], decays[tok], betas[tok])
        out[tok] = o
        if cache_rows is not None:
            keep = rows[cache_rows[rows] >= 0]
            intermediate_states_buffer[cache_rows[keep], step] = state[keep].to(intermediate_states_buffer.dtype)
    if not disable_state_update and live.any():
        initial_state_source[slots[live]] = state[live].to(initial_state_source.dtype)
    return out.reshape(v.shape).to(q.dtype)

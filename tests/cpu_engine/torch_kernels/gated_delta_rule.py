"""Gated delta rule (Qwen3-Next's gated delta net layers): gating, chunked prefill, decode.

Replaces SGLang's Triton `fused_gdn_gating` (`sglang.kernels.ops.attention.linear`),
`chunk_gated_delta_rule` (`...attention.fla.chunk`) and
`fused_sigmoid_gating_delta_rule_update` (`...attention.linear.fused_sigmoid_gating_recurrent`),
which sgl-kernel's CPU build provides as `fused_gdn_gating_cpu`, `chunk_gated_delta_rule_cpu`
and `fused_sigmoid_gating_delta_rule_update_cpu`.

Per value head (query/key head hv // (HV // H) serves value head hv), with the state S [V, K]
(pool layout [slots, HV, V, K], as SGLang's kernels keep it):
    S_t = exp(g_t) S_{t-1};  S_t += beta_t (v_t - S_t k_t) k_t^T;  o_t = S_t q_t
with q, k l2-normalised (when requested; eps 1e-6) and q scaled by `scale` (default K^-0.5).
The gates come from g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import PAD_SLOT_ID

CHUNK_SIZE = 64  # the Triton kernel's chunk length


def _gates(A_log, a, dt_bias, b, softplus_beta=1.0, softplus_threshold=20.0):
    """float32 (g, beta), each shaped like a / b."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                               threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def fused_gdn_gating(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """a, b [T, HV] -> (g, beta), each [1, T, HV] float32. beta is rounded to b's dtype first,
    as the Triton kernel stores it."""
    g, gate = _gates(A_log, a, dt_bias, b, beta, threshold)
    return g.unsqueeze(0), gate.to(b.dtype).float().unsqueeze(0)


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepared_qk(q, k, num_v_heads, use_qk_l2norm, scale):
    """float32 q, k with one head per value head; q scaled."""
    group = num_v_heads // q.shape[-2]
    q, k = q.float().repeat_interleave(group, dim=-2), k.float().repeat_interleave(group, dim=-2)
    if use_qk_l2norm:
        q, k = _l2_normalised(q), _l2_normalised(k)
    return q * scale, k


def delta_rule_chunked(q, k, v, g, beta, state):
    """One sequence in chunks of CHUNK_SIZE (the WY form). q, k [L, HV, K] (prepared), v [L, HV, V],
    g, beta [L, HV], state [HV, V, K], all float32. Returns o [L, HV, V] and the final state.

    Inside a chunk, with G_t = exp(sum of g up to t within the chunk) and S the entering state,
    the corrections u_t = beta_t (v_t - G_t S k_t - sum_{s<t} (G_t / G_s) (k_t . k_s) u_s)
    solve one unit lower-triangular system per chunk; then
    o_t = G_t S q_t + sum_{s<=t} (G_t / G_s) (q_t . k_s) u_s and
    S' = G_C S + sum_s (G_C / G_s) u_s k_s^T."""
    L = q.shape[0]
    n = -(-L // CHUNK_SIZE)
    pad = n * CHUNK_SIZE - L

    def chunks(t):  # [L, HV, ...] -> [n, HV, C, ...], zero padded (beta 0, g 0: no effect)
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(n, CHUNK_SIZE, *t.shape[1:]).transpose(1, 2)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    log_decay = torch.cumsum(g, dim=-1)  # [n, HV, C]
    causal = torch.tril(torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool))
    gap = log_decay[..., :, None] - log_decay[..., None, :]  # [n, HV, i, j]
    decay = torch.exp(torch.where(causal, gap, float("-inf")))
    strict = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = torch.eye(CHUNK_SIZE) + strict.tril(-1)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w = solve(k * (beta * torch.exp(log_decay))[..., None])  # [n, HV, C, K]
    u0 = solve(v * beta[..., None])  # [n, HV, C, V]
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * torch.exp(log_decay)[..., None]
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [n, HV, C]

    out = torch.empty_like(u0)
    for c in range(n):
        state_t = state.transpose(-1, -2)  # [HV, K, V]
        u = u0[c] - w[c] @ state_t
        out[c] = q_decayed[c] @ state_t + qk[c] @ u
        state = torch.exp(log_decay[c, :, -1])[:, None, None] * state \
            + (u * to_end[c][..., None]).transpose(-1, -2) @ k[c]
    return out.transpose(1, 2).reshape(n * CHUNK_SIZE, out.shape[1], -1)[:L], state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           initial_state_indices=None, cu_seqlens=None, head_first=False,
                           use_qk_l2norm_in_kernel=False, inplace_update=True):
    """Drop-in for the Triton `chunk_gated_delta_rule` (prefill). q, k [1, T, H, K];
    v [1, T, HV, V]; g, beta [1, T, HV]; cu_seqlens [N + 1] delimits the sequences;
    sequence i starts from initial_state[initial_state_indices[i]] ([slots, HV, V, K]) and,
    with inplace_update, leaves its final state there. Rows whose slot is PAD_SLOT_ID are
    skipped (output 0). Returns (o [1, T, HV, V] in q's dtype, None, None): the per-chunk
    states the Triton kernel returns third are not produced."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule stand-in: head_first layout")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qs, ks = _prepared_qk(q[0], k[0], v.shape[2], use_qk_l2norm_in_kernel, scale)
    vs, gs, betas = v[0].float(), g[0].float(), beta[0].float()
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    slots = initial_state_indices.tolist() if initial_state_indices is not None else list(range(len(bounds) - 1))
    out = torch.zeros(v.shape, dtype=q.dtype)
    for seq, slot in enumerate(slots):
        start, end = bounds[seq], bounds[seq + 1]
        if slot == PAD_SLOT_ID or end <= start:
            continue
        o, final = delta_rule_chunked(qs[start:end], ks[start:end], vs[start:end], gs[start:end],
                                      betas[start:end], initial_state[slot].float())
        out[0, start:end] = o.to(out.dtype)
        if inplace_update:
            initial_state[slot] = final.to(initial_state.dtype)
    return out, None, None


def delta_rule_step(state, q, k, v, g, beta):
    """One token for a batch of sequences (float32): state [n, HV, V, K]; q, k [n, HV, K]
    (prepared); v [n, HV, V]; g, beta [n, HV]. Returns (o [n, HV, V], new state)."""
    state = state * torch.exp(g)[..., None, None]
    u = (v - torch.einsum("nhvk,nhk->nhv", state, k)) * beta[..., None]
    state = state + u[..., None] * k[:, :, None, :]
    return torch.einsum("nhvk,nhk->nhv", state, q), state


def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold,
                                           q, k, v, b, initial_state_source,
                                           initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                           is_kda=False, lower_bound=None,
                                           disable_state_update=False,
                                           intermediate_states_buffer=None, **spec_options):
    """Drop-in for the Triton decode kernel: gating plus the recurrence, token by token.
    q, k [1, T, H, K]; v [1, T, HV, V]; a, b [T, HV]; cu_seqlens [N + 1] (without it, each of
    the B rows of [B, T, ...] inputs is a sequence). Sequence i runs from
    initial_state_source[initial_state_indices[i]] and writes its final state back (unless
    disable_state_update); a PAD_SLOT_ID row runs from a zero state and writes nothing, as the
    Triton kernel does. Returns o shaped like v, in q's dtype. KDA gates and speculative-
    decoding buffers are not supported."""
    if is_kda or lower_bound is not None or intermediate_states_buffer is not None \
            or any(v_ is not None and v_ is not False for v_ in spec_options.values()):
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update stand-in: KDA, speculative decoding")
    batch, steps, _, K = k.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    flat = lambda t: t.reshape(batch * steps, *t.shape[2:])
    qs, ks = _prepared_qk(flat(q), flat(k), HV, use_qk_l2norm_in_kernel, scale)
    vs = flat(v).float()
    g, gate = _gates(A_log, a.reshape(-1, HV), dt_bias, b.reshape(-1, HV), softplus_beta, softplus_threshold)
    if cu_seqlens is not None:
        bounds = cu_seqlens.long()
    else:
        bounds = torch.arange(batch + 1) * steps
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    slots = initial_state_indices.long()
    live = slots != PAD_SLOT_ID
    state = torch.zeros(len(slots), *initial_state_source.shape[1:], dtype=torch.float32)
    state[live] = initial_state_source[slots[live]].float()
    out = torch.zeros(vs.shape, dtype=torch.float32)
    for step in range(int(lengths.max()) if len(lengths) else 0):
        rows = torch.nonzero(lengths > step).squeeze(1)  # sequences that have this step
        tok = starts[rows] + step
        o, state[rows] = delta_rule_step(state[rows], qs[tok], ks[tok], vs[tok], g[tok], gate[tok])
        out[tok] = o
    if not disable_state_update and live.any():
        initial_state_source[slots[live]] = state[live].to(initial_state_source.dtype)
    return out.reshape(v.shape).to(q.dtype)

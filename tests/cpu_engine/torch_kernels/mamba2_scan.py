"""Mamba2 selective state space (SSD) scan: chunked prefill and single-step decode.

Replaces SGLang's Triton `mamba_chunk_scan_combined`
(`sglang.kernels.ops.mamba.triton_ops.ssd_combined`) and `selective_state_update`
(`...triton_ops.mamba_ssm`, behind `...triton_ops.ssu_dispatch`).

Recurrence, per head h (heads share B/C within a group: head h reads group h // (H // G)):
    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)        (softplus when dt_softplus)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T            S: [headdim, dstate]
    y_t  = S_t C_t + D * x_t
Prefill evaluates it in chunks (the SSD form: quadratic inside a chunk, state passing between
chunks); decode applies it one token at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import PAD_SLOT_ID


def _discretised_dt(dt, dt_bias, dt_softplus, dt_limit=(0.0, float("inf"))):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group's B (or C) serves H // G consecutive heads."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _segments(seq_bounds, chunk_size):
    """Split every sequence [start, end) at multiples of chunk_size of the flat token index (the
    kernel's chunk grid): yields (seq, seg_start, seg_end) in token order."""
    for seq, (start, end) in enumerate(seq_bounds):
        pos = start
        while pos < end:
            stop = min(end, (pos // chunk_size + 1) * chunk_size)
            yield seq, pos, stop
            pos = stop


def ssd_scan_varlen(x, dt, A, B, C, seq_bounds, initial_states, chunk_size):
    """The chunked scan over sequences laid back to back (float32 in, float32 out).

    x [T, H, P]; dt [T, H] (already discretised); A [H]; B, C [T, H, N] (per head);
    seq_bounds: [(start, end)] per sequence; initial_states [num_seqs, H, P, N] or None (zeros).
    Returns y [T, H, P] (without the D skip term), final_states [num_seqs, H, P, N] and
    grid_states [ceil(T / chunk_size), H, P, N]: entry c is the state entering grid chunk c, i.e.
    after token c * chunk_size - 1 within its sequence (entry 0: sequence 0's initial state).
    """
    T, H, P = x.shape
    N = B.shape[-1]
    segs = list(_segments(seq_bounds, chunk_size))
    num_seqs = len(seq_bounds)
    zeros = x.new_zeros(H, P, N)
    init = [initial_states[s] if initial_states is not None else zeros for s in range(num_seqs)]
    final_states = torch.stack(init) if num_seqs else x.new_zeros(0, H, P, N)
    num_grid = -(-T // chunk_size)
    grid_states = x.new_zeros(num_grid, H, P, N)
    if num_grid:
        grid_states[0] = init[0] if num_seqs else zeros
    y = x.new_zeros(T, H, P)
    if not segs:
        return y, final_states, grid_states

    # Gather segments into a padded [S, L] layout; padding has dt = 0 (no decay, no input).
    L = chunk_size
    offsets = torch.arange(L)
    seg_start = torch.tensor([s for _, s, _ in segs])
    seg_len = torch.tensor([e - s for _, s, e in segs])
    valid = offsets[None, :] < seg_len[:, None]  # [S, L]
    token = torch.where(valid, seg_start[:, None] + offsets[None, :], 0)
    mask = valid.float()
    xs = x[token] * mask[..., None, None]  # [S, L, H, P]
    dts = dt[token] * mask[..., None]  # [S, L, H]
    Bs, Cs = B[token], C[token]  # [S, L, H, N]

    cum = torch.cumsum(dts * A.float(), dim=1)  # [S, L, H] log-decay from segment start
    total = cum[:, -1]  # [S, H]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    gap = cum[:, :, None, :] - cum[:, None, :, :]  # [S, i, j, H]: log-decay from j to i
    decay = torch.exp(torch.where(causal[None, :, :, None], gap, float("-inf")))
    scores = torch.einsum("sihn,sjhn->sijh", Cs, Bs) * decay * dts[:, None, :, :]
    y_local = torch.einsum("sijh,sjhp->sihp", scores, xs)
    to_end = torch.exp(total[:, None, :] - cum) * dts  # [S, L, H]
    local_states = torch.einsum("sjh,sjhp,sjhn->shpn", to_end, xs, Bs)

    # Pass states along each sequence's segments.
    entering = []
    state = None
    for idx, (seq, start, stop) in enumerate(segs):
        if start == seq_bounds[seq][0]:
            state = init[seq]
        entering.append(state)
        state = torch.exp(total[idx])[:, None, None] * state + local_states[idx]
        if stop == seq_bounds[seq][1]:
            final_states[seq] = state
        if stop % chunk_size == 0 and stop // chunk_size < num_grid:
            grid_states[stop // chunk_size] = state
    entering = torch.stack(entering)  # [S, H, P, N]
    y_carry = torch.einsum("sihn,shpn->sihp", Cs, entering) * torch.exp(cum)[..., None]
    y[token[valid]] = (y_local + y_carry)[valid]
    return y, final_states, grid_states


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, chunk_indices=None,
                              chunk_offsets=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), out=None, return_final_states=False,
                              return_varlen_states=False, return_intermediate_states=False,
                              state_dtype=None, return_track_states=False, track_seq_idx=None,
                              track_end_locs=None):
    """Drop-in for SGLang's Triton `mamba_chunk_scan_combined`.

    x [batch, seqlen, H, P]; dt [batch, seqlen, H]; A [H]; B, C [batch, seqlen, G, N];
    D [H] or [H, P]; initial_states [batch or num_seqs, H, P, N]. With return_varlen_states,
    batch is 1 and cu_seqlens [num_seqs + 1] delimits the sequences (seq_idx, chunk_indices and
    chunk_offsets describe the same layout for the Triton kernels and are not needed here).
    Writes y into `out` ([batch, seqlen, H, P]) and returns what the Triton function returns
    for the same flags: the chunk-grid states [batch, nchunks, H, P, N], the final state of
    the flat stream [batch, H, P, N] and the per-sequence final states [num_seqs, H, P, N].
    Not supported: the z gate and tracked states (extra-buffer radix tracking)."""
    if z is not None:
        raise NotImplementedError("mamba_chunk_scan_combined stand-in: z gate")
    if return_track_states and track_end_locs is not None and track_end_locs.numel() > 0:
        raise NotImplementedError("mamba_chunk_scan_combined stand-in: tracked states")
    if not return_varlen_states:
        cu_seqlens = None
    batch, seqlen, H, P = x.shape
    dts = _discretised_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _heads_from_groups(B, H), _heads_from_groups(C, H)
    out_dtype = state_dtype if state_dtype is not None else C.dtype
    if out is None:
        out = torch.empty_like(x)
    grid, final, varlen = [], [], None
    for row in range(batch):
        if cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            seq_bounds = list(zip(bounds[:-1], bounds[1:]))
            init = initial_states
        else:
            seq_bounds = [(0, seqlen)]
            init = initial_states[row:row + 1] if initial_states is not None else None
        y, finals, grid_states = ssd_scan_varlen(
            x[row].float(), dts[row], A, Bh[row], Ch[row], seq_bounds,
            init.float() if init is not None else None, chunk_size)
        if D is not None:
            skip = D.float() if D.dim() == 2 else D.float()[:, None]
            y = y + x[row].float() * skip
        out[row] = y.to(out.dtype)
        grid.append(grid_states)
        # The flat stream's final state is the last chunk's: its sequence's end state.
        final.append(finals[-1])
        if cu_seqlens is not None:
            varlen = finals.to(out_dtype)
    states = torch.stack(grid).to(out_dtype)
    final_states = torch.stack(final).to(out_dtype)

    if return_track_states:
        return states, varlen, None
    if return_intermediate_states:
        if return_varlen_states:
            return (states, final_states, varlen) if return_final_states else (states, varlen)
        return (states, final_states) if return_final_states else states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, varlen) if return_final_states else varlen


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, pad_slot_id=PAD_SLOT_ID,
                           out=None, disable_state_update=False, intermediate_states_buffer=None,
                           cache_steps=None, retrieve_parent_token=None,
                           intermediate_state_indices=None, enable_stochastic_rounding=False,
                           cache_philox_rounds=0):
    """Drop-in for SGLang's `selective_state_update` (decode): advances each request's state by
    its new token(s) and writes y into `out`.

    state [slots, H, P, N] (updated in place unless disable_state_update); x, dt, z
    [batch, H, P] or [batch, T, H, P]; A [H, P, N]; B, C [batch, G, N] or [batch, T, G, N];
    D, dt_bias [H, P]; request b uses slot state_batch_indices[b] (row b without indices).
    A row whose slot is `pad_slot_id` runs from a zero state and writes no state, as the Triton
    kernel does. Not supported: speculative-decoding buffers and stochastic rounding."""
    if intermediate_states_buffer is not None or retrieve_parent_token is not None \
            or intermediate_state_indices is not None or enable_stochastic_rounding:
        raise NotImplementedError("selective_state_update stand-in: speculative decoding, stochastic rounding")
    multi_token = x.dim() == 4
    x4 = x if multi_token else x.unsqueeze(1)  # [batch, T, H, P]
    batch, steps, H, P = x4.shape
    dt4 = dt if multi_token else dt.unsqueeze(1)
    B4 = B if multi_token else B.unsqueeze(1)
    C4 = C if multi_token else C.unsqueeze(1)
    z4 = None if z is None else (z if multi_token else z.unsqueeze(1))
    out4 = out if multi_token else out.unsqueeze(1)

    slots = state_batch_indices.long() if state_batch_indices is not None else torch.arange(batch)
    live = slots != pad_slot_id
    s = torch.zeros(batch, *state.shape[1:], dtype=torch.float32)
    s[live] = state[slots[live]].float()
    A32 = A.float()
    for t in range(steps):
        step_dt = _discretised_dt(dt4[:, t], dt_bias, dt_softplus)  # [batch, H, P]
        x_t = x4[:, t].float()
        B_t, C_t = _heads_from_groups(B4[:, t], H), _heads_from_groups(C4[:, t], H)  # [batch, H, N]
        s = s * torch.exp(A32[None] * step_dt[..., None]) + (step_dt * x_t)[..., None] * B_t[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", s, C_t)
        if D is not None:
            y = y + x_t * D.float()
        if z4 is not None:
            y = y * F.silu(z4[:, t].float())
        out4[:, t] = y.to(out4.dtype)
    if not disable_state_update and live.any():
        state[slots[live]] = s[live].to(state.dtype)

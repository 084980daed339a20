"""Mamba2 selective state space (SSD) scan: prefill and decode.

Replaces SGLang's Triton `mamba_chunk_scan_combined`
(`sglang.kernels.ops.mamba.triton_ops.ssd_combined`) and `selective_state_update`
(`...triton_ops.mamba_ssm`, behind `...triton_ops.ssu_dispatch`).

Recurrence, per head h (heads share B/C within a group: head h reads group h // (H // G)):
    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)        (softplus when dt_softplus)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T            S: [headdim, dstate]
    y_t  = S_t C_t + D * x_t
Prefill and decode advance S with the same per-token arithmetic (see the package docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import COMPUTE_DTYPE, PAD_SLOT_ID, round_to_state_precision

TOKEN_BLOCK = 256  # prefill precomputes per-token terms this many tokens at a time (bounds memory)


def _discretised_dt(dt, dt_bias, dt_softplus, dt_limit=(0.0, float("inf"))):
    dt = dt.to(COMPUTE_DTYPE)
    if dt_bias is not None:
        dt = dt + dt_bias.to(COMPUTE_DTYPE)
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group's B (or C) serves H // G consecutive heads."""
    return t.to(COMPUTE_DTYPE).repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _token_terms(x, dt, A, B):
    """Per-token decay exp(dt A) and input dt x B^T, each [..., H, P, N] (elementwise, so the
    same whether computed for one token or many). x, dt [..., H, P]; A [H, P, N]; B [..., H, N]."""
    return torch.exp(dt[..., None] * A), (dt * x)[..., None] * B[..., None, :]


def _advance(state, decay, drive):
    return round_to_state_precision(state * decay + drive)


def _readout(states, C, x, D):
    """y = S C (+ D x): states [..., H, P, N]; C [..., H, N]; x [..., H, P]; D [H, P] or None."""
    y = (states * C[..., None, :]).sum(-1)
    return y if D is None else y + x * D


def ssd_scan_sequence(x, dt, A, B, C, D, state, chunk_size, first_token=0, grid_states=None,
                      snapshots=None, snapshot_states=None):
    """One sequence, token by token (float64): x, dt [L, H, P]; A [H, P, N]; B, C [L, H, N];
    D [H, P] or None; state [H, P, N] (the entering state). Returns y [L, H, P] and the final
    state. The sequence's tokens sit at flat positions first_token + t; when grid_states
    ([nchunks, H, P, N]) is given, entry c receives the state after flat token c * chunk_size - 1.
    snapshots ({flat position p: [rows]}) copies the state after flat token p - 1 into those rows
    of snapshot_states (the extra_buffer strategy's tracked states off the chunk grid)."""
    L = x.shape[0]
    y = torch.empty(x.shape, dtype=COMPUTE_DTYPE)
    for block in range(0, L, TOKEN_BLOCK):
        stop = min(L, block + TOKEN_BLOCK)
        decay, drive = _token_terms(x[block:stop], dt[block:stop], A, B[block:stop])
        states = torch.empty(decay.shape, dtype=COMPUTE_DTYPE)
        for t in range(stop - block):
            state = states[t] = _advance(state, decay[t], drive[t])
            position = first_token + block + t + 1
            if grid_states is not None and position % chunk_size == 0 and position // chunk_size < len(grid_states):
                grid_states[position // chunk_size] = state
            if snapshots and position in snapshots:
                for row in snapshots[position]:
                    snapshot_states[row] = state
        y[block:stop] = _readout(states, C[block:stop], x[block:stop], D)
    return y, state


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
    With return_track_states (the extra_buffer strategy's prefill snapshots), also the states
    after flat position track_end_locs[i] of sequence track_seq_idx[i] ([1, n, H, P, N], None
    when none is asked), for tracked positions off the chunk grid; on the grid SGLang reads
    the chunk-grid states. Not supported: the z gate."""
    if z is not None:
        raise NotImplementedError("mamba_chunk_scan_combined stand-in: z gate")
    snapshots = {}
    if return_track_states and track_end_locs is not None and track_end_locs.numel() > 0:
        if cu_seqlens is None or not return_varlen_states:
            raise NotImplementedError("mamba_chunk_scan_combined stand-in: tracked states need cu_seqlens")
        for row, end in enumerate(track_end_locs.tolist()):
            snapshots.setdefault(int(end), []).append(row)
    if not return_varlen_states:
        cu_seqlens = None
    batch, seqlen, H, P = x.shape
    N = B.shape[-1]
    dts = _discretised_dt(dt, dt_bias, dt_softplus, dt_limit)[..., None].expand(-1, -1, -1, P)
    Bh, Ch = _heads_from_groups(B, H), _heads_from_groups(C, H)
    A_full = A.to(COMPUTE_DTYPE)[:, None, None].expand(H, P, N)
    D_full = None if D is None else (D if D.dim() == 2 else D[:, None]).to(COMPUTE_DTYPE).expand(H, P)
    out_dtype = state_dtype if state_dtype is not None else C.dtype
    if out is None:
        out = torch.empty_like(x)
    num_chunks = -(-seqlen // chunk_size)
    states = torch.zeros(batch, num_chunks, H, P, N, dtype=COMPUTE_DTYPE)
    final_states = torch.zeros(batch, H, P, N, dtype=COMPUTE_DTYPE)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        rows = [list(zip(bounds[:-1], bounds[1:]))]  # batch is 1: every sequence in row 0
    else:
        rows = [[(0, seqlen)] for _ in range(batch)]
    varlen = torch.zeros(sum(len(r) for r in rows), H, P, N, dtype=COMPUTE_DTYPE)
    tracked = torch.zeros(len(track_end_locs) if snapshots else 0, H, P, N, dtype=COMPUTE_DTYPE)
    seq = 0
    for row, seq_bounds in enumerate(rows):
        xs = x[row].to(COMPUTE_DTYPE)
        for start, end in seq_bounds:
            init = initial_states[seq if cu_seqlens is not None else row] if initial_states is not None else None
            state = init.to(COMPUTE_DTYPE) if init is not None else torch.zeros(H, P, N, dtype=COMPUTE_DTYPE)
            if start == 0 and num_chunks:
                states[row, 0] = state  # the grid's first entry: the stream's entering state
            y, state = ssd_scan_sequence(xs[start:end], dts[row, start:end], A_full, Bh[row, start:end],
                                         Ch[row, start:end], D_full, state, chunk_size, start, states[row],
                                         snapshots, tracked)
            out[row, start:end] = y.to(out.dtype)
            varlen[seq] = final_states[row] = state
            seq += 1
    states, final_states, varlen = states.to(out_dtype), final_states.to(out_dtype), varlen.to(out_dtype)
    if cu_seqlens is None:
        varlen = None

    if return_track_states:
        return states, varlen, (tracked.to(out_dtype).unsqueeze(0) if snapshots else None)
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
    as_steps = lambda t: None if t is None else (t if multi_token else t.unsqueeze(1))  # [batch, T, ...]
    x4, dt4, B4, C4, z4, out4 = map(as_steps, (x, dt, B, C, z, out))
    batch, steps, H, P = x4.shape
    slots = state_batch_indices.long() if state_batch_indices is not None else torch.arange(batch)
    live = slots != pad_slot_id
    s = torch.zeros(batch, *state.shape[1:], dtype=COMPUTE_DTYPE)
    s[live] = state[slots[live]].to(COMPUTE_DTYPE)
    A64 = A.to(COMPUTE_DTYPE)
    D64 = None if D is None else D.to(COMPUTE_DTYPE)
    for t in range(steps):
        x_t = x4[:, t].to(COMPUTE_DTYPE)
        decay, drive = _token_terms(x_t, _discretised_dt(dt4[:, t], dt_bias, dt_softplus), A64,
                                    _heads_from_groups(B4[:, t], H))
        s = _advance(s, decay, drive)
        y = _readout(s, _heads_from_groups(C4[:, t], H), x_t, D64)
        if z4 is not None:
            y = y * F.silu(z4[:, t].to(COMPUTE_DTYPE))
        out4[:, t] = y.to(out4.dtype)
    if not disable_state_update and live.any():
        state[slots[live]] = s[live].to(state.dtype)

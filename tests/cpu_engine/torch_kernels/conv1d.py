"""Causal depthwise conv1d over a pool of per-request conv states (Mamba2 and GDN layers).

Replaces SGLang's Triton `causal_conv1d_fn` / `causal_conv1d_update`
(`sglang.kernels.ops.mamba.causal_conv1d_triton`) and sgl-kernel's CPU ops
`causal_conv1d_fn_cpu` / `causal_conv1d_update_cpu`.

Shapes: `weight` [dim, width]; `conv_states` [slots, dim, width - 1] holds, per slot, the last
width - 1 inputs of its sequence (oldest first), which a call reads (when the sequence continues)
and overwrites with the newest inputs. Output channel c at token t is
`act(bias[c] + sum_j weight[c, j] * window[c, t + j])` over the window formed by the state
followed by the new tokens; `act` is SiLU for activation "silu"/"swish"/True, else identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import COMPUTE_DTYPE, PAD_SLOT_ID


def _check_state_width(conv_states: torch.Tensor, width: int) -> None:
    if conv_states.shape[-1] != width - 1:
        raise NotImplementedError(
            f"conv state length {conv_states.shape[-1]} != kernel width - 1 = {width - 1}")


def _convolve(window, weight, bias, activation):
    """window [..., dim, width - 1 + steps] -> [..., dim, steps]; prefill and decode share it so
    a token's output does not depend on which of them computed it."""
    width = weight.shape[1]
    y = (window.unfold(-1, width, 1) * weight.to(COMPUTE_DTYPE)[:, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.to(COMPUTE_DTYPE)[:, None]
    return F.silu(y) if activation is True or activation in ("silu", "swish") else y


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu=None,
                     cache_indices=None, has_initial_state=None, activation="silu",
                     pad_slot_id=PAD_SLOT_ID, validate_data=False, block_table=None):
    """Prefill: x [dim, total_tokens] holds the batch's sequences back to back, sequence i at
    columns query_start_loc[i]:query_start_loc[i+1]. Sequence i starts from
    conv_states[cache_indices[i]] when has_initial_state[i], else from zeros; that slot then
    holds its last width - 1 inputs. Rows whose slot is `pad_slot_id` are skipped (their output
    columns are left unwritten, as the Triton kernel leaves them). Returns [dim, total_tokens].
    The CUDA-graph launch table (block_table) is not supported."""
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn stand-in: block_table launches")
    dim, width = weight.shape
    _check_state_width(conv_states, width)
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    num_seqs = len(starts) - 1
    slots = cache_indices.tolist() if cache_indices is not None else list(range(num_seqs))
    continues = has_initial_state.tolist() if has_initial_state is not None else [False] * num_seqs
    for seq, slot in enumerate(slots):
        start, end = starts[seq], starts[seq + 1]
        if slot == pad_slot_id or end <= start:
            continue
        history = conv_states[slot] if continues[seq] else conv_states.new_zeros(dim, width - 1)
        window = torch.cat([history.to(COMPUTE_DTYPE), x[:, start:end].to(COMPUTE_DTYPE)], dim=1)
        out[:, start:end] = _convolve(window, weight, bias, activation).to(out.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, num_accept_tokens=None,
                         intermediate_conv_window=None, intermediate_state_indices=None,
                         retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None, pad_slot_id=PAD_SLOT_ID, metadata=None,
                         validate_data=False):
    """Decode: x [batch, dim] (one new token per request) or [batch, dim, steps]. Request b
    continues from conv_state[conv_state_indices[b]] (or row b when no indices are given), which
    then holds its last width - 1 inputs. Rows whose slot is `pad_slot_id` get output 0 and leave
    the pool untouched. Returns x's shape.

    Speculative verify (a chain of draft tokens per request): with `intermediate_conv_window`
    ([rows, steps, dim, width - 1]) the window after each step t goes to
    intermediate_conv_window[intermediate_state_indices[b], t], as the Triton kernel's
    SAVE_INTERMEDIATE does (SGLang commits the accepted step's window after verification).
    Circular buffers (cache_seqlens, num_accept_tokens) and draft trees (retrieve_*) are not
    supported."""
    unsupported = (cache_seqlens, num_accept_tokens, retrieve_next_token, retrieve_next_sibling,
                   retrieve_parent_token)
    if any(arg is not None for arg in unsupported):
        raise NotImplementedError("causal_conv1d_update stand-in: circular buffers and draft trees")
    single_step = x.dim() == 2
    x3 = x.unsqueeze(-1) if single_step else x  # [batch, dim, steps]
    width = weight.shape[1]
    _check_state_width(conv_state, width)
    slots = conv_state_indices.long() if conv_state_indices is not None else torch.arange(x3.shape[0])
    live = slots != pad_slot_id
    out = torch.zeros_like(x3)
    if live.any():
        live_slots = slots[live]
        window = torch.cat([conv_state[live_slots].to(COMPUTE_DTYPE), x3[live].to(COMPUTE_DTYPE)], dim=2)
        out[live] = _convolve(window, weight, bias, activation).to(out.dtype)
        conv_state[live_slots] = window[:, :, -(width - 1):].to(conv_state.dtype)
        if intermediate_conv_window is not None:
            rows = intermediate_state_indices.long()[live]
            steps = x3.shape[2]
            # the window after step t: inputs t + 1 .. t + width - 1 of [state, x]
            after = window.unfold(2, width - 1, 1)[:, :, 1:steps + 1]  # [live, dim, steps, width - 1]
            intermediate_conv_window[rows, :steps] = after.permute(0, 2, 1, 3).to(intermediate_conv_window.dtype)
    return out.squeeze(-1) if single_step else out

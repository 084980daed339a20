"""Mamba cache state snapshots (the `extra_buffer` radix strategy's decode-time track copies).

Replaces SGLang's Triton `track_mamba_states_if_needed` and `track_mamba_states_all_layers`
(`sglang.kernels.ops.mamba.mamba_state_scatter_triton`): for every batch row whose
`mamba_track_mask` is set, copy its conv and SSM state rows from slot `cache_indices[i]` to slot
`mamba_track_indices[i]` (one layer's pools, or every layer's at once). A copy, so bit-exact:
the state a snapshot holds is the state the request's own slot held, as SGLang's no_buffer
mode gets it by copying a slot (`MambaPool.copy_from`). With `check_freed_slots`, rows whose
source or destination is -1 (a freed slot of the unified pool) are skipped, as the kernel does.
"""

from __future__ import annotations

import torch


def _rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots):
    mask = mamba_track_mask[:batch_size].to(torch.bool)
    src = cache_indices[:batch_size][mask].long()
    dst = mamba_track_indices[:batch_size][mask].long()
    if check_freed_slots:
        live = (src >= 0) & (dst >= 0)
        src, dst = src[live], dst[live]
    return src, dst


def track_mamba_states_if_needed(conv_states, ssm_states, cache_indices, mamba_track_mask,
                                 mamba_track_indices, batch_size, check_freed_slots=False):
    """One layer: conv_states [slots, ...], ssm_states [slots, ...]."""
    src, dst = _rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel():
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask,
                                  mamba_track_indices, batch_size, check_freed_slots=False):
    """Every layer at once: conv_states_pool [layers, slots, ...], ssm_states_pool [layers, slots, ...]."""
    src, dst = _rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel():
        conv_states_pool[:, dst] = conv_states_pool[:, src]
        ssm_states_pool[:, dst] = ssm_states_pool[:, src]

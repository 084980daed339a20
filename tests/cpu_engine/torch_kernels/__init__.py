"""Plain-torch stand-ins for the GPU-only kernels SGLang 0.5.23's CPU engine calls for hybrid
models on a host without a GPU (or AMX): one module per kernel family.

Each public function keeps the signature and in-place side effects of the SGLang kernel it
replaces, so it can be bound in that kernel's place (see `../kernel_patches.py`). Test
infrastructure only: the package `sglang_marconi` never imports them.

Recurrences (conv windows, SSM and delta-rule states) run token by token in float64 and round
the state to float32 after every token, the precision SGLang's kernels keep states in. A token
then costs the same arithmetic whether it is prefilled, decoded, or prefilled after a prefix-
cache hit resumed the state from the pool, so a cache hit reproduces the uncached output bit for
bit. (Float32 chunked scans, whose rounding depends on where a prefill is split, moved logprobs
of the random tiny test models by up to 0.1 across a hit.) Work is vectorised across heads and
channels; only the recurrences loop over tokens.
"""

import torch

PAD_SLOT_ID = -1  # SGLang's marker for a batch row without a state slot (skipped, never written)
COMPUTE_DTYPE = torch.float64


def round_to_state_precision(state: torch.Tensor) -> torch.Tensor:
    """Round a float64 recurrence state to float32 precision (kept in float64)."""
    return state.float().to(COMPUTE_DTYPE)

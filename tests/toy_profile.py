"""A model profile with round numbers, for tests whose byte counts are checked by hand."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ToyProfile:
    """A profile with round numbers so byte counts can be checked by hand: 1 byte of KV per
    token, 10 bytes per SSM checkpoint, FLOPs(s, e) = e^2 - s^2 (additive, superlinear)."""

    name: str = "toy"
    kv_bytes_per_token: int = 1
    ssm_state_bytes: int = 10

    def prefill_flops(self, start: int, end: int) -> float:
        return float(end * end - start * start)

    def prefill_flops_array(self, start, end):
        start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
        return end * end - start * start

"""MODELED cost of a load back: bytes over an assumed sustained host-to-device link bandwidth.

Not a measurement. Each GPU is assumed to load over its own PCIe x16 link at a sustained share of
the link's peak (A100 and L40S: PCIe 4.0, 32 GB/s peak, 25 GB/s assumed; H100-SXM and H200: PCIe
5.0, 64 GB/s peak, 50 GB/s assumed); with tensor parallelism over n GPUs each loads its shard in
parallel (n links). The load is added to the modeled prefill time (`ttft_model.py`), not overlapped
with it: SGLang's HiCache loads layer by layer and can hide part of it behind the forward pass, so
the sum is an upper bound on what a host hit costs, never a free hit.

    modeled_load_seconds(bytes, gpu) = bytes / (n_gpus * link_bytes_per_s)
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.ttft_model import get_gpu_profile

HOST_LINK_BYTES_PER_S = {
    "A100-40GB": 25e9,
    "A100-80GB": 25e9,
    "H100-SXM": 50e9,
    "H200": 50e9,
    "L40S": 25e9,
}


def link_bytes_per_s(gpu: str) -> float:
    """Assumed sustained host-to-device bytes per second of the whole setup named `gpu`."""
    profile = get_gpu_profile(gpu)
    base = profile.name.partition("x")[2] if profile.n_gpus > 1 else profile.name
    if base not in HOST_LINK_BYTES_PER_S:
        raise MarconiError(f"no host link bandwidth assumed for GPU {gpu!r}; known: {', '.join(HOST_LINK_BYTES_PER_S)}")
    return profile.n_gpus * HOST_LINK_BYTES_PER_S[base]


def modeled_load_seconds(loaded_bytes, gpu: str):
    """MODELED seconds to copy `loaded_bytes` (a number or an array) host to device on `gpu`."""
    return np.asarray(loaded_bytes, dtype=np.float64) / link_bytes_per_s(gpu)

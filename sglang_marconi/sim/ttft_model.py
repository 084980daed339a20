"""MODELED time to first token: prefill FLOPs divided by an assumed sustained GPU throughput.

This is a roofline-style (compute-bound) model, NOT a measurement. It assumes prefill runs at a
fixed fraction (the model FLOPs utilization, MFU; 0.45 unless told otherwise) of the GPU's dense
bf16 tensor-core peak, that tensor parallelism over n GPUs scales perfectly, and it ignores
queueing, scheduling, memory-bandwidth-bound phases, kernel launch and communication overheads,
and the time to load cached states. Use it to compare policies on one workload (the FLOPs a hit
saves become modeled seconds); never quote it as a measured latency.

    modeled_ttft_seconds(flops, gpu) = flops / (n_gpus * peak_flops * mfu)

GPU names are the keys of `GPU_PROFILES` ("A100-40GB", "H100-SXM", ...), optionally prefixed with
a tensor-parallel GPU count as in the paper's "4xA100-40GB" (Jamba-1.5-Mini on 4x A100-40GB).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from sglang_marconi.policy.errors import MarconiError

DEFAULT_MFU = 0.45


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """An assumed GPU setup: dense bf16 peak per GPU, assumed MFU, tensor-parallel GPU count."""

    name: str
    peak_flops: float  # dense bf16 tensor-core peak of one GPU, FLOP/s (vendor datasheet)
    mfu: float = DEFAULT_MFU  # assumed model FLOPs utilization during prefill
    n_gpus: int = 1  # tensor-parallel degree (perfect scaling assumed)

    @property
    def effective_flops(self) -> float:
        """Assumed sustained FLOP/s of the whole setup."""
        return self.n_gpus * self.peak_flops * self.mfu


# Dense (no structured sparsity) bf16 tensor-core peaks from the vendors' datasheets.
GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("A100-40GB", 312e12),
        GpuProfile("A100-80GB", 312e12),
        GpuProfile("H100-SXM", 989e12),
        GpuProfile("H200", 989e12),
        GpuProfile("L40S", 362e12),
    )
}

_TP_PREFIX = re.compile(r"^\s*(\d+)\s*[xX]\s*(.+?)\s*$")


def get_gpu_profile(gpu: str | GpuProfile, mfu: float | None = None) -> GpuProfile:
    """Resolve a GPU name ("H100-SXM", "4xA100-40GB"; case-insensitive) to a `GpuProfile`.

    `mfu` overrides the assumed utilization. Unknown names raise `MarconiError` listing the known.
    """
    if isinstance(gpu, GpuProfile):
        profile = gpu
    else:
        if not isinstance(gpu, str):
            raise MarconiError(f"GPU must be a name or a GpuProfile, got {gpu!r}")
        n_gpus, base = 1, gpu.strip()
        m = _TP_PREFIX.match(base)
        if m:
            n_gpus, base = int(m.group(1)), m.group(2)
        by_lower = {k.lower(): v for k, v in GPU_PROFILES.items()}
        if base.lower() not in by_lower:
            known = ", ".join(GPU_PROFILES)
            raise MarconiError(
                f"unknown GPU {gpu!r}; known GPUs: {known} "
                f"(optionally prefixed with a tensor-parallel count, e.g. '4xA100-40GB')"
            )
        if n_gpus < 1:
            raise MarconiError(f"GPU count must be >= 1 in {gpu!r}")
        profile = by_lower[base.lower()]
        if n_gpus != 1:
            profile = replace(profile, name=f"{n_gpus}x{profile.name}", n_gpus=n_gpus)
    if mfu is not None:
        profile = replace(profile, mfu=mfu)
    if not (isinstance(profile.mfu, (int, float)) and 0.0 < profile.mfu <= 1.0):
        raise MarconiError(f"mfu must be in (0, 1], got {profile.mfu!r}")
    if not (isinstance(profile.n_gpus, int) and profile.n_gpus >= 1):
        raise MarconiError(f"n_gpus must be an integer >= 1, got {profile.n_gpus!r}")
    if not (math.isfinite(profile.peak_flops) and profile.peak_flops > 0):
        raise MarconiError(f"peak_flops must be positive, got {profile.peak_flops!r}")
    return profile


def modeled_ttft_seconds(
    flops: float | np.ndarray, gpu: str | GpuProfile, mfu: float | None = None
) -> float | np.ndarray:
    """MODELED prefill time (seconds) for `flops` prefill FLOPs on `gpu`; not a measurement.

    Returns ``flops / (n_gpus * peak_flops * mfu)``: a float for a scalar, an array for an array.
    Negative or non-finite FLOPs raise `MarconiError`.
    """
    profile = get_gpu_profile(gpu, mfu)
    arr = np.asarray(flops, dtype=np.float64)
    if arr.size and not (np.all(np.isfinite(arr)) and np.all(arr >= 0.0)):
        bad = arr[~(np.isfinite(arr) & (arr >= 0.0))].ravel()[0]
        raise MarconiError(f"flops must be finite and >= 0, got {float(bad)!r}")
    seconds = arr / profile.effective_flops
    if arr.ndim == 0:
        return float(seconds)
    return seconds

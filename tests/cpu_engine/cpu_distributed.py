"""Tensor parallelism on SGLang's CPU engine with a CUDA build of torch and no GPU.

SGLang 0.5.23 runs CPU tensor-parallel collectives through torch.distributed on the group's
gloo "device" group (`GroupCoordinator.all_reduce` / `all_gather`, `input_.is_cpu` branch), or
through sgl-kernel's shared-memory ops where the CPU has AMX (`utils.is_shm_available`). Only
one thing stands in the way here: `init_model_parallel_group` asks for a PyNccl communicator
on every non-NPU/XPU platform, and PyNccl disables itself only when the NCCL library fails to
load. On a CPU build of torch it does fail; a CUDA build ships libnccl, which loads, and the
communicator then binds `torch.cuda.device("cpu")`:

    ValueError: Expected a cuda device, but got: cpu

`guard_pynccl` makes the library unavailable to PyNccl where torch sees no GPU, which is what a
CPU build of torch gives: the communicator comes up disabled and the collectives take SGLang's
own CPU (gloo) path.
"""

from __future__ import annotations


class NcclUnavailableWithoutGpu(RuntimeError):
    pass


def guard_pynccl(module) -> None:
    """Patch `sglang.srt.distributed.device_communicators.pynccl` right after it runs: its
    `NCCLLibrary` raises (PyNccl then disables itself) when torch sees no GPU."""
    import torch

    original = module.NCCLLibrary
    if getattr(original, "_cpu_engine_guard", False):
        return

    def NCCLLibrary(*args, **kwargs):
        if not torch.cuda.is_available():
            raise NcclUnavailableWithoutGpu("cpu_engine: no GPU, NCCL is not used (as with a CPU build of torch)")
        return original(*args, **kwargs)

    NCCLLibrary._cpu_engine_guard = True
    NCCLLibrary.original = original
    module.NCCLLibrary = NCCLLibrary

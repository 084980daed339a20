"""Run SGLang's CPU engine on a CPU-only host with a CUDA build of torch: put this directory on
PYTHONPATH and set SGLANG_USE_CPU_ENGINE=1. Otherwise (the variable unset) it does nothing.

Installs `kernel_patches`: torch.get_device_module() answers torch.cpu without a GPU, and the
Triton-only kernels SGLang launches for hybrid models are swapped for the plain-torch stand-ins
in `torch_kernels` (the `sgl_kernel` package here stands in for sgl-kernel's CPU build).
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import kernel_patches
    import page_major_attention  # torch_native on the unified-memory (page-major) KV layout
    import snapshot_platform  # Mamba state snapshots: the extra_buffer radix strategy on CPU
    import speculative_attention  # EAGLE / NEXTN (a chain of drafts) on torch_native attention

    from torch_kernels import swa_attention  # SWA layers read the SWA pool through SWA slots

    kernel_patches.add(snapshot_platform.PATCHES)
    kernel_patches.add(page_major_attention.PATCHES)
    kernel_patches.add(speculative_attention.PATCHES)
    kernel_patches.add({swa_attention.BACKEND_MODULE: swa_attention.patch_backend})  # outside page-major's
    kernel_patches.install()

"""Test-only platform stand-in: SGLang's CPU platform with Mamba cache state snapshots, so the
CPU engine can run `--mamba-radix-cache-strategy extra_buffer` (the GPU default with overlap
scheduling), which SGLang 0.5.23 refuses on CPU (`arg_groups/mamba_hook.py`: "extra_buffer
requires platform support for Mamba cache state snapshots").

SGLang asks an out-of-tree platform `support_mamba_cache_extra_buffer()` and the in-tree ones
by name (CUDA, MUSA, NPU, HIP, XPU). Here the in-tree CPU platform answers the same question
(True), and the snapshots it then promises are provided in plain torch:

- decode-time snapshots: `torch_kernels.state_snapshot` replaces the Triton
  `track_mamba_states_if_needed` / `track_mamba_states_all_layers` (a masked slot-to-slot copy);
- prefill-time snapshots: the Mamba2 scan stand-in returns the tracked states off its chunk grid
  (`return_track_states`, `track_end_locs`) and the gated-delta-rule prefill stand-in returns its
  per-chunk states `h`, from which SGLang's backend copies the tracked one
  (`HybridLinearAttnBackend._track_mamba_state_extend`); the conv windows are copied by
  SGLang's own torch code.

Loaded by `sitecustomize` only with SGLANG_USE_CPU_ENGINE=1 (`kernel_patches.add` joins its `PATCHES` to
`kernel_patches.PATCHES`); checked by `tests/server/test_state_snapshots.py` against SGLang's
no_buffer path (a state copied with `MambaPool.copy_from`, and prefills that end where a
snapshot was taken).
"""

from __future__ import annotations

from kernel_patches import replace


def _cpu_platform_has_snapshots(module):
    """`CpuSRTPlatform.support_mamba_cache_extra_buffer()` -> True (the out-of-tree question)."""
    module.CpuSRTPlatform.support_mamba_cache_extra_buffer = lambda self: True


def _mamba_hook_asks_the_platform(module):
    """`_platform_supports_mamba_cache_extra_buffer` asks the CPU platform too, as it asks an
    out-of-tree one; every other platform gets SGLang's own answer."""
    original = module._platform_supports_mamba_cache_extra_buffer

    def platform_supports_mamba_cache_extra_buffer() -> bool:
        from sglang.srt.platforms import current_platform

        if current_platform.is_cpu():
            return current_platform.support_mamba_cache_extra_buffer()
        return original()

    module._platform_supports_mamba_cache_extra_buffer = platform_supports_mamba_cache_extra_buffer


def _pin_memory_is_a_no_op_without_a_gpu(torch_module):
    """The extra_buffer decode path pins its track mask unconditionally
    (`ScheduleBatch.prepare_for_decode`: `track_mask_cpu.pin_memory()`), which needs a CUDA
    driver; with no GPU, pinning a host tensor returns it as it is (there is no device to
    transfer to faster)."""
    original = torch_module.Tensor.pin_memory

    def pin_memory(self, *args, **kwargs):
        if not torch_module.cuda.is_available():
            return self
        return original(self, *args, **kwargs)

    torch_module.Tensor.pin_memory = pin_memory


PATCHES = {
    "torch": _pin_memory_is_a_no_op_without_a_gpu,
    "sglang.srt.platforms.cpu": _cpu_platform_has_snapshots,
    "sglang.srt.arg_groups.mamba_hook": _mamba_hook_asks_the_platform,
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton": replace(
        track_mamba_states_if_needed="state_snapshot.track_mamba_states_if_needed",
        track_mamba_states_all_layers="state_snapshot.track_mamba_states_all_layers"),
}

"""Post-import patches that let SGLang's CPU engine run hybrid models on a CPU without AMX.

`PATCHES` maps a module name to the function that patches it right after the module first
executes (before any importer binds its names), installed by `install()` as a meta-path
finder. Stand-ins are named "family.function" inside `torch_kernels` and imported only when
their module is patched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys


def _stand_in(dotted: str):
    family, function = dotted.split(".")
    return getattr(importlib.import_module(f"torch_kernels.{family}"), function)


def _patcher(stand_ins: dict, must_exist: bool):
    def patch(module):
        for attr, dotted in stand_ins.items():
            if must_exist and not hasattr(module, attr):
                # SGLang moved or renamed the kernel: fail loudly rather than run it.
                raise AttributeError(f"cpu_engine patch: {module.__name__}.{attr} not found")
            setattr(module, attr, _stand_in(dotted))

    return patch


def replace(**stand_ins):
    """Replace existing attributes (Triton launchers) by stand-ins."""
    return _patcher(stand_ins, must_exist=True)


def define(**stand_ins):
    """Define names a module binds only on GPU platforms."""
    return _patcher(stand_ins, must_exist=False)


def _cpu_device_module(torch_module):
    """A CUDA build of torch returns torch.cuda from get_device_module() even without a GPU
    (the current accelerator is cuda, available or not); SGLang's CPU path expects torch.cpu."""
    original = torch_module.get_device_module

    def get_device_module(device=None):
        if device is None and not torch_module.cuda.is_available():
            return torch_module.cpu
        return original(device)

    # torch.compile's tracer keys a handler on `torch.get_device_module.__wrapped__` (the
    # function under torch's decorator); keep that name pointing where it did.
    get_device_module.__wrapped__ = getattr(original, "__wrapped__", original)
    torch_module.get_device_module = get_device_module


_CONV = dict(causal_conv1d_fn="conv1d.causal_conv1d_fn", causal_conv1d_update="conv1d.causal_conv1d_update")


def _guard_pynccl(module):
    import cpu_distributed

    cpu_distributed.guard_pynccl(module)


PATCHES = {
    "torch": _cpu_device_module,
    # Tensor parallelism: PyNccl off without a GPU (collectives take SGLang's CPU/gloo path).
    "sglang.srt.distributed.device_communicators.pynccl": _guard_pynccl,
    # Mamba2 (Nemotron-H): conv, chunked scan, decode step.
    "sglang.kernels.ops.mamba.causal_conv1d_triton": replace(**_CONV),
    "sglang.srt.layers.attention.mamba.mamba": define(
        **_CONV, causal_conv1d_fn_triton=_CONV["causal_conv1d_fn"],
        causal_conv1d_update_triton=_CONV["causal_conv1d_update"]),
    "sglang.kernels.ops.mamba.triton_ops.ssd_combined": replace(
        mamba_chunk_scan_combined="mamba2_scan.mamba_chunk_scan_combined"),
    "sglang.kernels.ops.mamba.triton_ops.mamba_ssm": replace(
        selective_state_update="mamba2_scan.selective_state_update"),
    # Qwen3-Next: GDN output norm and the MoE shared-expert gate (the GDN kernels themselves
    # come from the sgl_kernel stand-in).
    "sglang.kernels.ops.attention.fla.fused_norm_gate": replace(rms_norm_gated="norms.rms_norm_gated"),
    "sglang.kernels.ops.elementwise.elementwise": replace(
        _launch_fused_gate_sigmoid_mul="norms.fused_gate_sigmoid_mul"),
    # Speculative decoding: committing the accepted draft step's Mamba states after verification.
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton": replace(
        fused_mamba_state_scatter_with_mask="speculative.fused_mamba_state_scatter_with_mask",
        fused_conv_window_scatter_with_mask="speculative.fused_conv_window_scatter_with_mask",
        fused_conv_window_scatter_multi="speculative.fused_conv_window_scatter_multi"),
}


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Finds a listed module through the other finders and wraps its loader's exec_module
    (on that loader instance, so the loader keeps its type) to patch it once it has run."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            if spec.loader is not None:
                original = spec.loader.exec_module

                def exec_module(module, original=original):
                    original(module)
                    if module.__name__ == name:  # the loader may serve other modules too
                        patch(module)

                spec.loader.exec_module = exec_module
            return spec
        return None


def add(patches: dict) -> None:
    """Join `patches` (module name -> patch) to PATCHES: a module patched there already gets both,
    the one already there first (each wraps what it finds, so a later one goes outside)."""
    for name, patch in patches.items():
        first = PATCHES.get(name)
        if first is None:
            PATCHES[name] = patch
        else:
            def both(module, first=first, second=patch):
                first(module)
                second(module)

            PATCHES[name] = both


def install() -> None:
    """Patch the listed modules already imported, and every other one when it is imported."""
    if any(isinstance(f, _PostImportPatcher) for f in sys.meta_path):
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PostImportPatcher())

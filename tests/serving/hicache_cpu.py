"""SGLang's real HiCache (host tier, write_back) on the CPU hybrid cache of `sglang_cpu.py`.

`init_hicache` builds SGLang's own host pools (`MHATokenToKVPoolHost`, `MambaPoolHost`), its
`HybridCacheController` and `L2TransferEngine`, exactly as the scheduler's factory does
(`create_unified_radix_cache` -> `cache.init_hicache`). Three things stand between that code and a
CPU-only host; the test-only stand-ins below replace them (nothing in `sglang_marconi` imports
this file):

| stand-in | replaces | why | checked against |
|---|---|---|---|
| `_no_host_register` | `pool_host.common._cuda_host_register` (pins the host pools with `cudaHostRegister`) | needs a CUDA driver; pinning only speeds DMA, the bytes are the same | nothing to check: a no-op on an ordinary CPU tensor |
| `transfer_kv_all_layer_direct_lf_pf`, `transfer_kv_per_layer_direct_pf_lf` | sgl-kernel's ops of those names (`--hicache-io-backend direct` with the `page_first_direct` host layout, device -> host all layers and host -> device one layer; bound in `pool_host/mha.py` and `pool_host/mamba.py` on CUDA/ROCm only) | no CPU build of sgl-kernel | `reference_lf_pf` / `reference_pf_lf` (token-by-token loops), `test_hicache_stand_ins_match_their_references` |
| `torch.cpu.Stream.synchronize` | (missing on `torch.cpu.Stream`) called by `L2TransferEngine._submission` only when a transfer raised | a CPU stream is synchronous | - |
| `pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES` = 0 | the 10 GiB of host RAM SGLang keeps free beside its host pools | these pools are kilobytes; on a loaded test machine the reserve alone fails their allocation | nothing to check: the pools' sizes are unchanged |

`--hicache-io-backend direct --hicache-mem-layout page_first_direct` are the arguments
`init_hicache` is given here (`MambaPoolHost` takes only the page-first layouts, and the `kernel`
backend's ops are CUDA JIT kernels).
"""

from __future__ import annotations

import torch

_INSTALLED = False


def reference_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """sgl-kernel's `transfer_kv_all_layer_direct_lf_pf`, one token at a time: device layer-first
    rows (`src_ptrs`: the layers of dst_ptrs[0], then those of dst_ptrs[1], ...) into host
    page-first buffers `[page, layer, offset in page, ...]`."""
    per_dst = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        for layer in range(per_dst):
            src = src_ptrs[j * per_dst + layer]
            for s, d in zip(src_indices.tolist(), dst_indices.tolist()):
                dst[d // page_size, layer, d % page_size] = src[s]


def reference_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """sgl-kernel's `transfer_kv_per_layer_direct_pf_lf`, one token at a time: one layer of host
    page-first buffers back into device layer-first rows."""
    for src, dst in zip(src_ptrs, dst_ptrs):
        for s, d in zip(src_indices.tolist(), dst_indices.tolist()):
            dst[d] = src[s // page_size, layer_id, s % page_size]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Stand-in for sgl-kernel's op of that name (`reference_lf_pf`), vectorized per layer."""
    assert len(src_ptrs) % len(dst_ptrs) == 0 and src_indices.numel() == dst_indices.numel()
    per_dst = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        d = dst_indices.to(dst.device).long()
        pages, offsets = d // page_size, d % page_size
        for layer in range(per_dst):
            src = src_ptrs[j * per_dst + layer]
            dst[pages, layer, offsets] = src.index_select(0, src_indices.to(src.device).long()).to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Stand-in for sgl-kernel's op of that name (`reference_pf_lf`), vectorized."""
    assert len(src_ptrs) == len(dst_ptrs) and src_indices.numel() == dst_indices.numel()
    for src, dst in zip(src_ptrs, dst_ptrs):
        s = src_indices.to(src.device).long()
        dst.index_copy_(0, dst_indices.to(dst.device).long(), src[s // page_size, layer_id, s % page_size].to(dst.device))


def _no_host_register(buffer, registration_granularity_bytes=None):
    return None


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    import sglang.srt.mem_cache.pool_host.base as host_base
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mamba as mamba_host
    import sglang.srt.mem_cache.pool_host.mha as mha_host

    common._cuda_host_register = _no_host_register
    host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    for module in (mha_host, mamba_host):
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
    _INSTALLED = True


def hicache_server_args(ratio: float = 2.0, host_size: int | None = None):
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(model_path="dummy", page_size=1, enable_hierarchical_cache=True,
                  hicache_write_policy="write_back", hicache_io_backend="direct",
                  hicache_mem_layout="page_first_direct")
    if host_size is not None:
        kwargs["hicache_size"] = host_size
    else:
        kwargs["hicache_ratio"] = ratio
    server_args = ServerArgs(**kwargs)
    server_args._mamba_cache_chunk_size = 64  # what the HF config would say (as `build_cache`)
    return server_args


def attach_hicache(cc, ratio: float = 2.0, **build_kwargs):
    """`cache.init_hicache` on a CpuCache (write_back, direct io, layer_first), as the factory does.
    `build_kwargs`: what `build_cache` was given (the params `init_hicache` reads are rebuilt)."""
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from sglang_cpu import build_cache

    install()
    params = build_cache(return_params=True, kv_size=cc.kv_size, mamba_size=cc.mamba_size,
                         max_num_reqs=cc.max_num_reqs, **build_kwargs)  # publishes plain args
    server_args = hicache_server_args(ratio)
    set_global_server_args_for_scheduler(server_args)
    params.req_to_token_pool, params.token_to_kv_pool_allocator = cc.req_to_token_pool, cc.allocator
    cc.cache.init_hicache(server_args, params)
    assert cc.cache.cache_controller is not None, "no controller"
    assert cc.cache.is_write_back, cc.cache.cache_controller.write_policy
    return cc

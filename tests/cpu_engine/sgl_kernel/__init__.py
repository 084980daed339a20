"""Stand-in for the CPU build of sgl-kernel, which the package registry does not carry (its
`sglang-kernel` wheel is a CUDA build). Provides, in plain torch (see `torch_kernels`), the ops
SGLang 0.5.23's CPU engine calls for hybrid models on a host without AMX:
`torch.ops.sgl_kernel.fused_gdn_gating_cpu`, `torch.ops.sgl_kernel.
fused_sigmoid_gating_delta_rule_update_cpu`, `sgl_kernel.mamba.*_cpu` and
`assign_req_to_token_pool_cpu`, and speculative decoding's bookkeeping ops
(`torch_kernels.speculative`: draft / verify cache slots, tree building, greedy verification,
the KV slot copy). The other names SGLang imports from it on CPU are stubs that
raise NotImplementedError naming the op when called, so imports succeed and a missing op is
reported where it is first needed.
"""

import torch

from torch_kernels.speculative import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)
from torch_kernels.token_pool import assign_req_to_token_pool as assign_req_to_token_pool_cpu

from . import mamba

__version__ = "0.0.0+torch.stand.in"

for _op in ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu"):
    setattr(torch.ops.sgl_kernel, _op, getattr(mamba, _op))


def _not_implemented(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented")

    stub.__name__ = stub.__qualname__ = name
    return stub


# Imported by SGLang modules under is_cpu(): multi-layer EAGLE's input rotation and the AMX
# attention backend's draft metadata (this engine runs torch_native attention instead).
_UNIMPLEMENTED = ("rotate_input_ids_cpu", "build_draft_decode_metadata_cpu")
globals().update({name: _not_implemented(name) for name in _UNIMPLEMENTED})

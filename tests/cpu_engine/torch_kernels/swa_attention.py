"""Sliding-window layers of SGLang's `torch_native` attention backend over the hybrid SWA KV pool.

SGLang 0.5.23's `TorchNativeAttnBackend` writes a sliding-window layer's K/V at the SWA pool's
slots (`full_to_swa_index_mapping` applied to `out_cache_loc`) but reads them back through
`req_to_token`, which holds *full*-pool slots: every SWA layer then attends to whatever the SWA
buffer holds at those unrelated slots. On GPUs the SWA-capable backends (FlashInfer, FA3, Triton)
translate the table; this stand-in does the same for `torch_native`: for an SWA layer, the
forward runs on a per-batch table of the batch's rows translated to SWA slots (`swa_rows`), with
the batch's rows renumbered 0..n-1. Positions before the window map to stale or sink slots and
are masked by the backend's own sliding-window mask.

Checked in `tests/server/test_live_swa.py` against SDPA over the contiguous K/V with the window
mask (and the untranslated read is shown to differ).
"""

from __future__ import annotations

from types import SimpleNamespace


def swa_rows(req_to_token, req_pool_indices, seq_lens, full_to_swa):
    """The batch's rows of the request -> slot table, truncated to the longest sequence and
    translated from full-pool to SWA-pool slots; row i belongs to the batch's i-th request."""
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    rows = req_to_token[req_pool_indices.long(), :longest].long()
    return full_to_swa[rows].to(req_to_token.dtype)


def _is_swa_layer(backend, layer) -> bool:
    return bool(backend.use_sliding_window_kv_pool
                and backend.token_to_kv_pool.layers_mapping[layer.layer_id][1])


def _on_swa_rows(method):
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not _is_swa_layer(self, layer) or layer.is_cross_attention:
            return method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        import torch

        table = swa_rows(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                         forward_batch.seq_lens, self.token_to_kv_pool.full_to_swa_index_mapping)
        pool, indices = self.req_to_token_pool, forward_batch.req_pool_indices
        self.req_to_token_pool = SimpleNamespace(req_to_token=table)
        forward_batch.req_pool_indices = torch.arange(len(indices), device=indices.device)
        try:
            return method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            self.req_to_token_pool, forward_batch.req_pool_indices = pool, indices

    return forward


def patch_backend(module) -> None:
    """Route TorchNativeAttnBackend's SWA-layer reads through the translated table."""
    cls = module.TorchNativeAttnBackend
    for name in ("forward_extend", "forward_decode"):
        if not hasattr(cls, name):
            raise AttributeError(f"cpu_engine patch: TorchNativeAttnBackend.{name} not found")
        setattr(cls, name, _on_swa_rows(getattr(cls, name)))


BACKEND_MODULE = "sglang.srt.layers.attention.torch_native_backend"

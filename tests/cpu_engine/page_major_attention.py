"""Test-only stand-in: SGLang's torch_native attention reading the page-major (unified-memory)
KV layout, so the CPU engine can serve `--enable-unified-memory`, which SGLang 0.5.23 refuses on
CPU (`arg_groups/kv_cache_hook.handle_page_major_kv_layout`: "the resolved attention backends
['torch_native'] are not in the allowed set ['fa3', 'fa4', 'flashinfer', 'triton', 'trtllm_mha']").

Under unified memory every KV slot has two ids: the *virtual* one `req_to_token` stores, and the
*physical* one the per-layer K/V views (rows strided by the whole page envelope) are indexed by.
The allowed backends read through the model runner's `KVIndexTranslator`; torch_native indexes
the views with `req_to_token` directly and writes with an unmarked (virtual) loc, which the
unified pool refuses. Here torch_native does what the allowed backends do, in plain torch:

- writes go through `KVWriteLoc.for_batch(forward_batch)` (the plan's physical write ids);
- reads gather each request's row through the translator's read source (`physical_rows`), so the
  strided views are indexed by physical ids; torch indexing honours the views' strides.

The gate then admits torch_native (on the CPU platform only) as one more backend that reads
through the translator. Sliding-window sub-pools are not handled (raise). Loaded by
`sitecustomize` with SGLANG_USE_CPU_ENGINE=1; checked by `tests/server/test_page_major_attention.py`:
attention over SGLang's own page-major views with a shuffled virtual->physical table is
bit-equal to the regular layout's, and the unpatched backend is not.
"""

from __future__ import annotations


def physical_rows(table, req_pool_indices, width: int, v2p_page_size: int):
    """Physical token ids [batch, width] of each request's first `width` positions, from a
    `KVIndexTable` (SGLang's description of where a gather reads: `ids[row_ids[b]]`, entries of
    `entry_page_size` tokens, then the page-granular `v2p` table when one is given)."""
    import torch

    positions = torch.arange(width, dtype=torch.int64, device=table.ids.device)
    rows = table.ids[table.row_ids[: req_pool_indices.shape[0]].to(torch.int64)].to(torch.int64)
    if table.entry_page_size == 1:
        ids = rows[:, :width]
    else:  # a page table: entry j covers tokens [j * P, (j + 1) * P)
        pages = rows[:, positions // table.entry_page_size]
        ids = pages * table.entry_page_size + positions % table.entry_page_size
    if table.v2p is not None:
        ids = table.v2p[ids // v2p_page_size].to(torch.int64) * v2p_page_size + ids % v2p_page_size
    return ids


def _read_rows(backend, forward_batch, width: int):
    """(req_to_token, req_pool_indices) for the sdpa loops: SGLang's own when reads need no
    translation, else the batch's physical rows with row b for request b."""
    import torch

    translator = backend.kv_index_translator
    if backend.use_sliding_window_kv_pool:
        raise NotImplementedError("page_major_attention: sliding-window sub-pools are not handled")
    bs = forward_batch.req_pool_indices.shape[0]
    table = translator.read_source(forward_batch.kv_loc_plan, req_pool_indices=forward_batch.req_pool_indices,
                                   bs=bs)
    rows = physical_rows(table, forward_batch.req_pool_indices, width, translator._capture_page_size)
    return rows, torch.arange(bs, dtype=torch.int64, device=rows.device)


def _write_loc(backend, forward_batch, layer):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.is_cross_attention:
        raise NotImplementedError("page_major_attention: cross attention is not handled")
    return KVWriteLoc.for_batch(forward_batch, swa_loc=backend.swa_out_cache_loc)


def _sliding_window(layer, causal: bool):
    size = layer.sliding_window_size
    return size if causal and size is not None and size > -1 else None


def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
    """`TorchNativeAttnBackend.forward_extend` with physical writes and reads (self-attention)."""
    import torch

    o = (q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
         if layer.qk_head_dim != layer.v_head_dim else torch.empty_like(q))
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(layer, _write_loc(self, forward_batch, layer), k, v)
    from sglang.srt.layers.radix_attention import AttentionType

    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    req_to_token, req_pool_indices = _read_rows(self, forward_batch, int(forward_batch.seq_lens.max()))
    self._run_sdpa_forward_extend(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        req_to_token, req_pool_indices, forward_batch.seq_lens, forward_batch.extend_prefix_lens,
        forward_batch.extend_seq_lens, forward_batch.encoder_lens, scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=causal, is_cross_attn=False,
        sliding_window_size=_sliding_window(layer, causal))
    return o


def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
    """`TorchNativeAttnBackend.forward_decode` with physical writes and reads (self-attention)."""
    import torch

    q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
    o = (q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
         if layer.qk_head_dim != layer.v_head_dim else torch.empty_like(q))
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(layer, _write_loc(self, forward_batch, layer), k, v)
    req_to_token, req_pool_indices = _read_rows(self, forward_batch, int(forward_batch.seq_lens.max()))
    self._run_sdpa_forward_decode(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        req_to_token, req_pool_indices, forward_batch.seq_lens, forward_batch.encoder_lens,
        scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=False,
        is_cross_attn=False, sliding_window_size=_sliding_window(layer, True))
    return o


def _translating(backend) -> bool:
    translator = backend.kv_index_translator
    return translator is not None and translator.reads_are_translated


def _torch_native_reads_page_major(module):
    """The stand-in runs only where reads are translated (a unified pool); elsewhere SGLang's."""
    cls = module.TorchNativeAttnBackend
    init = cls.__init__

    def __init__(self, model_runner):
        init(self, model_runner)
        # As the allowed backends do (triton_backend.py): the runner's translator, built first.
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)

    cls.__init__ = __init__
    for name, stand_in in (("forward_extend", forward_extend), ("forward_decode", forward_decode)):
        def method(self, *args, _original=getattr(cls, name), _stand_in=stand_in, **kwargs):
            return (_stand_in if _translating(self) else _original)(self, *args, **kwargs)

        setattr(cls, name, method)


def _gate_admits_torch_native_on_cpu(module):
    """`handle_page_major_kv_layout` on the CPU platform: torch_native (patched above) is checked
    as the allowed backends are; every other backend, and every other check, is SGLang's."""
    original = module.handle_page_major_kv_layout
    backends_of = module.attention_backends_of

    def reads_through_translator(cfg):
        return tuple("triton" if b == "torch_native" else b for b in backends_of(cfg))

    def handle_page_major_kv_layout(server_args):
        from sglang.srt.platforms import current_platform

        if not current_platform.is_cpu():
            return original(server_args)
        module.attention_backends_of = reads_through_translator
        try:
            return original(server_args)
        finally:
            module.attention_backends_of = backends_of

    module.handle_page_major_kv_layout = handle_page_major_kv_layout


PATCHES = {
    "sglang.srt.layers.attention.torch_native_backend": _torch_native_reads_page_major,
    "sglang.srt.arg_groups.kv_cache_hook": _gate_admits_torch_native_on_cpu,
}

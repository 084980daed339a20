"""Check of the test-only page-major stand-in (`tests/cpu_engine/page_major_attention.py`) against
the regular layout: torch_native's attention over SGLang's own page-major views (token-major entry
views with the whole `[K_0 | V_0 | K_1 | V_1]` entry as slot stride, `build_dense_views`, as
`UnifiedKVPool` builds them), read through a shuffled virtual->physical page table, is bit-equal
to the same attention over contiguous K/V buffers indexed by the virtual ids; and reading the
page-major views without the translation (what unpatched torch_native does) is not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu_engine"))

from page_major_attention import physical_rows  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 2, 16, 2


def page_major_views(slots: int):
    """SGLang's own per-layer K/V views of one unified buffer (token-major entries)."""
    from sglang.srt.mem_cache.layout.token_major import build_dense_views
    from sglang.srt.mem_cache.unified_memory_pool import MHASubPoolSpec

    spec = MHASubPoolSpec(name="full", layer_num=LAYERS, grow_direction="down", head_num=HEADS,
                          head_dim=HEAD_DIM, store_dtype=torch.float32)
    layout = spec.layout()
    raw = torch.zeros(slots * layout.entry_bytes, dtype=torch.uint8)
    k, v = (build_dense_views(raw, layout=layout, part_name=part, num_slots=slots) for part in ("k", "v"))
    return raw, k, v


def sdpa(kind: str, *args, **kwargs):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)  # the sdpa loops use no state
    run = backend._run_sdpa_forward_extend if kind == "extend" else backend._run_sdpa_forward_decode
    return run(*args, **kwargs)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_page_major_reads_equal_the_regular_layout(kind, page_size):
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTable

    gen = torch.Generator().manual_seed(page_size)
    per_request = 16 // page_size  # virtual pages per request (req_to_token rows hold 16 tokens)
    pages = 3 * per_request
    slots = pages * page_size
    v2p = torch.randperm(pages, generator=gen)  # virtual page -> physical page, shuffled
    seq_lens = torch.tensor([5, 9, 3]) if page_size == 1 else torch.tensor([7, 13, 10])
    bs = len(seq_lens)
    req_to_token = torch.zeros((6, 16), dtype=torch.int32)
    req_pool_indices = torch.tensor([4, 1, 2])
    virtual = torch.randperm(pages, generator=gen)  # each request its own virtual pages
    for b, r in enumerate(req_pool_indices.tolist()):
        n = int(seq_lens[b])
        own = virtual[per_request * b: per_request * (b + 1)]
        req_to_token[r, :n] = (own[torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size).to(torch.int32)

    raw, k_views, v_views = page_major_views(slots)
    k_regular = torch.randn((slots, HEADS, HEAD_DIM), generator=gen)
    v_regular = torch.randn((slots, HEADS, HEAD_DIM), generator=gen)
    # The same token's K/V, at its physical slot in the page-major buffer.
    virtual_slots = torch.arange(slots)
    physical_slots = v2p[virtual_slots // page_size] * page_size + virtual_slots % page_size
    for layer in range(LAYERS):
        k_views[layer][physical_slots] = k_regular
        v_views[layer][physical_slots] = v_regular
    assert k_views[0].stride(0) != HEADS * HEAD_DIM  # a slot stride of the whole entry, not one row

    table = KVIndexTable(ids=req_to_token, row_ids=req_pool_indices, row_stride=req_to_token.stride(0),
                         entry_page_size=1, is_translated=True, v2p=v2p)
    rows = physical_rows(table, req_pool_indices, int(seq_lens.max()), page_size)
    arange = torch.arange(bs)
    prefix = torch.tensor([2, 0, 1]) if kind == "extend" else None
    q_len = (seq_lens - prefix) if kind == "extend" else torch.ones(bs, dtype=torch.int64)
    q = torch.randn((int(q_len.sum()), HEADS, HEAD_DIM), generator=gen)

    def run(k_cache, v_cache, table_rows, rows_of):
        out = torch.zeros_like(q)
        if kind == "extend":
            return sdpa(kind, q, out, k_cache, v_cache, table_rows, rows_of, seq_lens, prefix, q_len,
                        causal=True)
        return sdpa(kind, q, out, k_cache, v_cache, table_rows, rows_of, seq_lens)

    regular = run(k_regular, v_regular, req_to_token, req_pool_indices)
    for layer in range(LAYERS):
        assert torch.equal(run(k_views[layer], v_views[layer], rows, arange), regular)
    untranslated = run(k_views[0], v_views[0], req_to_token, req_pool_indices)
    assert not torch.equal(untranslated, regular)  # the translation is what makes them equal


def test_physical_rows_expand_a_page_table():
    """A plan's page table (entries of P tokens, already physical) expands to token ids."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTable

    pages = torch.tensor([[3, 0, 2], [1, 5, 4]])
    table = KVIndexTable(ids=pages, row_ids=torch.tensor([1, 0]), row_stride=3, entry_page_size=4,
                         is_translated=True)
    rows = physical_rows(table, torch.tensor([1, 0]), 6, 4)
    assert rows.tolist() == [[4, 5, 6, 7, 20, 21], [12, 13, 14, 15, 0, 1]]


def test_the_gate_admits_torch_native_only_on_cpu(monkeypatch):
    """The stand-in's gate runs SGLang's own checks with torch_native read as a translating
    backend on the CPU platform; elsewhere (and for any other backend) SGLang's answer stands."""
    import page_major_attention

    calls = []
    module = SimpleNamespace(attention_backends_of=lambda cfg: ("torch_native", "torch_native"))

    def original(server_args):
        seen = module.attention_backends_of(None)
        calls.append(seen)
        assert set(seen) <= {"triton", "fa3"}, seen

    module.handle_page_major_kv_layout = original
    page_major_attention._gate_admits_torch_native_on_cpu(module)
    from sglang.srt.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    module.handle_page_major_kv_layout(None)
    assert calls == [("triton", "triton")]
    assert module.attention_backends_of(None) == ("torch_native", "torch_native")  # restored
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(AssertionError):
        module.handle_page_major_kv_layout(None)

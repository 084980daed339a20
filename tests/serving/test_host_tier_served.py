"""Issue 24.2 served, at the cache level: SGLang's real HiCache classes (host pools, cache
controller, transfer engine; `hicache_cpu.py`) under the `marconi` backend's cache, on CPU.

Why not live: SGLang's CPU engine would need, besides the two transfer ops stood in here, the
controller's per-layer load/forward overlap (`LayerDoneCounter` over device events, which
`torch.cpu.Event` only stubs) inside the model runner, and `--enable-hierarchical-cache` on the
CPU device path of `ServerArgs`; the cache level drives the same cache calls the scheduler makes
(`match_prefix`, `init_load_back`, `ready_to_load_host_cache`, `loading_check`,
`check_hicache_events`, allocation with eviction, `release_kv_cache`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from hicache_cpu import (  # noqa: E402
    attach_hicache, reference_lf_pf, reference_pf_lf, transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)
from sglang.srt.managers.schedule_batch import FINISH_LENGTH  # noqa: E402
from sglang.srt.mem_cache.allocation import alloc_token_slots  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang_cpu import FULL, MAMBA, _extend, build_cache, build_marconi_serving, make_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402

from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.host_tier import attach_host_tier  # noqa: E402
from sglang_marconi.serving.metrics import GAUGES  # noqa: E402


@pytest.fixture(autouse=True)
def _plain_server_args_after():
    """The HiCache arguments published here do not outlive the test (as `build_cache` publishes)."""
    yield
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    server_args = ServerArgs(model_path="dummy", page_size=1)
    server_args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(server_args)


@pytest.mark.parametrize("page_size", [1, 2])
def test_hicache_stand_ins_match_their_references(page_size):
    g = torch.Generator().manual_seed(page_size)
    layers, size, host_pages = 3, 12, 8
    src = [torch.randn(size, 2, 4, generator=g) for _ in range(2 * layers)]  # k layers, then v layers
    src_idx = torch.tensor([5, 6, 0, 1, 9, 10])
    dst_idx = torch.tensor([2, 3, 8, 9, 12, 13]) if page_size == 2 else torch.tensor([2, 3, 7, 0, 5, 6])
    ours = [torch.zeros(host_pages, layers, page_size, 2, 4) for _ in range(2)]
    ref = [t.clone() for t in ours]
    transfer_kv_all_layer_direct_lf_pf(src, ours, src_idx, dst_idx, page_size)
    reference_lf_pf(src, ref, src_idx, dst_idx, page_size)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref)) and ours[0].abs().sum() > 0
    back = [torch.zeros(size, 2, 4) for _ in range(2)]
    back_ref = [t.clone() for t in back]
    for layer in range(layers):
        transfer_kv_per_layer_direct_pf_lf(ours, back, dst_idx, src_idx, layer, page_size)
        reference_pf_lf(ours, back_ref, dst_idx, src_idx, layer, page_size)
        assert all(torch.equal(a, b) for a, b in zip(back, back_ref))
        assert torch.equal(back[0][src_idx], src[layer][src_idx])  # the round trip is exact


# -- driving the cache as the scheduler does, with load backs --------------------------------------
def serve(cc, tokens, n_out: int = 2, chunk_end=None):
    """One request: match; a host hit is loaded back (`init_load_back`, the H2D transfer, the ack)
    and matched again on the device; prefill; decode; release. Returns (req, host tokens loaded)."""
    cache, pool = cc.cache, cc.req_to_token_pool
    req = make_request(tokens, n_out)
    req.init_next_round_input(cache)
    host = 0
    if req.needs_host_load_back():
        loaded = cache.init_load_back(InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        cache.ready_to_load_host_cache()
        cache.loading_check()
        host = loaded[0]
        req.init_next_round_input(cache)
    req.cached_tokens = req.prefix_len
    n = len(req.full_untruncated_fill_ids)
    while True:  # prefill chunks: Marconi's two-pass rule may end one at a branch (`chunk_end`)
        end = n if chunk_end is None else chunk_end(req, n)
        _extend(cc, req, end)
        if end == n:
            break
        checkpoint_kv_cache(req, cache)
    for step in range(n_out):
        req.output_ids.append(10_000_000 + len(tokens) * 7 + step)
        req.update_finish_state()
        if req.finished():
            break
        if step == 0:
            checkpoint_kv_cache(req, cache)
        pos = req.kv.kv_committed_len
        pool.write((req.kv.req_pool_idx, slice(pos, pos + 1)), alloc_token_slots(cache, 1))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
    if req.finished_reason is None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, cache, checkpoint=True)
    cache.check_hicache_events()
    index = getattr(getattr(cache, "marconi", None), "index", None)
    if index is not None and index.bound:
        index.check()  # the eviction index agrees with the tree after every HiCache transition
    return req, host


def _state_tensors(cc):
    cache = cc.req_to_token_pool.mamba_pool.mamba_cache
    return [*cache.conv, cache.temporal]


def _randomize_device(cc):
    """Every KV row and state slot distinct, as a prefill would leave them."""
    g = torch.Generator().manual_seed(0)
    full = cc.allocator.get_kvcache().full_kv_pool
    for buf in [*full.k_buffer, *full.v_buffer, *_state_tensors(cc)]:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def _snapshot(cc, tokens):
    """What the device holds for `tokens` (its KV rows, the state at its end), by a plain match."""
    req = make_request(list(tokens) + [1], 1)
    req.init_next_round_input(cc.cache)
    assert req.prefix_len == len(tokens) and not req.needs_host_load_back()
    idx = cc.cache.prefix_device_indices(req)[:len(tokens)]
    full = cc.allocator.get_kvcache().full_kv_pool
    kv = [b[idx].clone() for b in [*full.k_buffer, *full.v_buffer]]
    node = cc.tree_core.node_by_id(req.last_node) if isinstance(req.last_node, int) else req.last_node
    slot = node.component_data[MAMBA].value.long()
    return kv, [t[:, slot].clone() for t in _state_tensors(cc)]


def marconi_hicache(kv_size=160, mamba_size=8, ratio=2.0, alpha=1.0):
    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=alpha, tune_workers=0), kv_size=kv_size,
                                        mamba_size=mamba_size)
    attach_hicache(cc, ratio=ratio)
    return cc, runtime, attach_host_tier(cc.cache, cc.settings.profile)


def upstream_hicache(kv_size=160, mamba_size=8, ratio=2.0):
    return attach_hicache(build_cache(kv_size=kv_size, mamba_size=mamba_size), ratio=ratio)


A = list(range(1, 41))


def _others(n, length=40, base=100):
    return [[base * (i + 1) + t for t in range(length)] for i in range(n)]


def test_a_prefix_evicted_from_the_device_hits_from_the_host_exactly():
    """warm == cold: the KV and the SSM state a host hit loads back are those the prefill left."""
    cc, runtime, _ = marconi_hicache()
    _randomize_device(cc)
    serve(cc, A)
    kv_cold, state_cold = _snapshot(cc, A)
    for seq in _others(5):  # device pressure: A leaves the device, demoted with its state
        serve(cc, seq)
    counters = cc.settings.counters
    assert counters.states_demoted >= 1 and counters.states_dropped == 0
    req, host = serve(cc, A + [7, 8])
    assert host == len(A) and req.cached_tokens == len(A)
    kv_warm, state_warm = _snapshot(cc, A)
    assert all(torch.equal(a, b) for a, b in zip(kv_warm, kv_cold))
    assert all(torch.equal(a, b) for a, b in zip(state_warm, state_cold))
    assert (counters.states_loaded_back, counters.kv_tokens_loaded_back, counters.host_hit_tokens) == (1, 40, 40)
    figures = runtime.metrics(cc.cache)  # what /server_info and the gauges show
    assert figures["marconi_host_hit_tokens"] == 40 and figures["marconi_host_states_loaded_back"] == 1
    assert figures["marconi_host_states_demoted"] == counters.states_demoted
    host_gauges = [k for k in figures if k.startswith(("marconi_host_", "marconi_device_hit"))]
    assert len(host_gauges) == 10 and all(k in GAUGES for k in host_gauges)


def _host_only_prefixes(cc, prefixes):
    """The first tokens of each host-only leaf's path (which prefixes the host still holds)."""
    held, stack = set(), [cc.tree_core.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        data = node.component_data[FULL]
        if node.parent is not None and data.value is None and data.host_value is not None:
            held.add(_first(node, cc))
    return [p for p in prefixes if p[0] in held]


def _fill_host(cc):
    """One long prefix demoted first (the oldest on the host), then short ones."""
    long_seq = [50_000 + t for t in range(96)]
    shorts = _others(6, length=12, base=1000)
    serve(cc, long_seq, n_out=1)
    for seq in shorts:
        serve(cc, seq, n_out=1)
    for seq in _others(4, length=40, base=300):  # push everything above to the host
        serve(cc, seq, n_out=1)
    return long_seq, shorts


def test_under_host_pressure_marconi_drops_the_cheapest_to_recompute_per_byte_and_lru_the_oldest():
    """Host pressure: Marconi evicts the host candidates of lowest recency + alpha x FLOPs saved per
    byte: the short prefixes (their state's bytes dominate what they free, for little prefill),
    oldest first, and keeps the long one; upstream's host LRU evicts the oldest, the long one."""
    cc, _, tier = marconi_hicache(kv_size=200, ratio=1.0, alpha=0.0)  # LRU on the device: the host rule alone
    long_seq, shorts = _fill_host(cc)
    prefixes = [long_seq, *shorts]
    before = _host_only_prefixes(cc, prefixes)
    assert long_seq in before and len(before) >= 4
    index, facts, kv_tokens, _ = tier.host_candidates()
    value = {_first(f.node, cc): index.efficiency[slot] for slot, (f, _) in enumerate(facts) if kv_tokens[slot]}
    assert value[long_seq[0]] > max(value[s[0]] for s in shorts if s[0] in value)
    freed = cc.cache.evict_host(24, FULL)
    assert freed >= 24 and cc.settings.counters.host_evictions >= 1
    after = _host_only_prefixes(cc, prefixes)
    dropped = [p for p in before if p not in after]
    assert long_seq in after, "the long prefix saves the most FLOPs per byte"
    assert dropped and dropped == [s for s in shorts if s in before][:len(dropped)]  # equal value: oldest first

    up = upstream_hicache(kv_size=200, ratio=1.0)
    long_up, shorts_up = _fill_host(up)
    before_up = _host_only_prefixes(up, [long_up, *shorts_up])
    up.cache.evict_host(24, FULL)
    after_up = _host_only_prefixes(up, [long_up, *shorts_up])
    assert long_up in before_up and long_up not in after_up, "upstream's host LRU drops the oldest, the long prefix"


def _first(node, cc):
    while node.parent is not cc.tree_core.root_node:
        node = node.parent
    return int(_key(node)[0])


def _hicache_context(policy: str):
    from types import SimpleNamespace

    from hicache_cpu import hicache_server_args, install
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.server_args import set_global_server_args_for_scheduler
    from transformers import NemotronHConfig

    install()
    params = build_cache(return_params=True, kv_size=256, mamba_size=8)
    server_args = hicache_server_args()
    server_args.hicache_write_policy = policy
    set_global_server_args_for_scheduler(server_args)
    worker = SimpleNamespace(register_hicache_layer_transfer_counter=lambda counter: None)
    return TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=worker,
        model_config=SimpleNamespace(hf_config=NemotronHConfig()), tp_size=1, tp_rank=0, tp_group=None)


def test_the_factory_serves_hicache_write_back_with_marconis_tiers_and_falls_back_honestly_otherwise(caplog):
    import logging

    from sglang_marconi.serving.plugin import marconi_radix_cache_factory

    cache = marconi_radix_cache_factory(_hicache_context("write_back"))
    assert type(cache).__name__ == "MarconiUnifiedRadixCache" and cache.cache_controller is not None
    assert cache.marconi.host_tier is not None and cache.marconi_runtime is not None
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        cache = marconi_radix_cache_factory(_hicache_context("write_through"))
    assert type(cache).__name__ == "UnifiedRadixCache"
    assert "--hicache-write-policy write_through" in cache.marconi_fallback


def _node_ending_at(cc, tokens):
    node, depth = cc.tree_core.root_node, 0
    while depth < len(tokens):
        node = next(c for c in node.children.values() if _key(c)[0] == tokens[depth])
        depth += len(_key(node))
    assert depth == len(tokens)
    return node


def _key(node):
    key = node.key
    return list(key.token_ids) if hasattr(key, "token_ids") else list(key)


def test_a_state_evicted_alone_is_demoted_and_loaded_back_exactly():
    """Mamba pressure takes the state of a node that keeps its KV (a single-child node): Marconi's
    rule demotes it (SGLang's internal state backup) instead of tombstoning it, and a hit on that
    prefix loads the state back bit for bit."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cc, _, _ = marconi_hicache(kv_size=400, mamba_size=10)
    _randomize_device(cc)
    first, _ = serve(cc, A)
    serve(cc, A + list(first.output_ids) + list(range(500, 530)))  # the next turn: A's node gets a child
    node = _node_ending_at(cc, A)
    slot = node.component_data[MAMBA].value.long()
    state_cold = [t[:, slot].clone() for t in _state_tensors(cc)]  # read without a match (no recency change)
    cc.cache.evict(EvictParams(num_tokens=0, mamba_num=2))
    counters = cc.settings.counters
    assert counters.states_demoted == 2 and counters.states_dropped == 0 and counters.evictions_leaf == 0
    req, host = serve(cc, A + [9, 9], n_out=1)
    assert req.cached_tokens == len(A) and counters.states_loaded_back == 1
    _, state_warm = _snapshot(cc, A)
    assert all(torch.equal(a, b) for a, b in zip(state_warm, state_cold))


@pytest.mark.parametrize("backend", ["marconi", "upstream"])
def test_a_branch_state_on_a_backed_up_path_is_demoted_not_lost(backend):
    """SGLang #40680's case: after a load back A's KV keeps its host copy; a branch at token 20
    splits A and puts a device-only state on a node whose KV is on the host. Upstream's write_back
    demotes that node in place and frees the state with no copy (a later request sharing the 20
    tokens misses); Marconi backs the state up first, and the request hits from the host."""
    if backend == "marconi":
        cc, chunk_end = marconi_hicache()[0], chunk_end_for_branch
    else:
        cc, chunk_end = upstream_hicache(), (lambda req, n: 20 if req.kv.kv_committed_len < 20 else n)
    serve(cc, A)
    for seq in _others(5):
        serve(cc, seq)
    assert serve(cc, A + [7, 8])[1] == len(A)  # loaded back: A's KV keeps its host copy
    serve(cc, A[:20] + list(range(900, 920)), chunk_end=chunk_end)
    branch = _node_ending_at(cc, A[:20])
    kv, state = branch.component_data[FULL], branch.component_data[MAMBA]
    assert kv.host_value is not None and state.value is not None and state.host_value is None
    for seq in _others(6, base=3000):
        serve(cc, seq)
    assert kv.value is None  # the branch node left the device
    req, host = serve(cc, A[:20] + [1, 2, 3], n_out=1)
    if backend == "marconi":
        assert state.host_value is not None and (req.cached_tokens, host) == (20, 20)
        assert cc.settings.counters.states_dropped == 0
    else:
        assert state.host_value is None and req.cached_tokens == 0

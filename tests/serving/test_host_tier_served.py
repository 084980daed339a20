"""The host tier served, at the cache level: SGLang's real HiCache classes (host pools, cache
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
from sglang_marconi.serving.host_tier import KV_POOL, STATE_POOL, attach_host_tier  # noqa: E402
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
def serve(cc, tokens, n_out: int = 2, chunk_end=None, check_device_index=True):
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
    marconi = getattr(cache, "marconi", None)
    index = getattr(marconi, "index", None)
    # after a fallback upstream's rules are in force and the index is no longer kept
    if check_device_index and index is not None and index.bound and marconi.faults.healthy:
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
    arena = cc.tree_core._node_arena
    value = {_first(arena[i], cc): e for i, (_, e, _, _) in tier.brute_force_entries()[KV_POOL].items()}
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


# -- the host candidates, kept incrementally -------------------------------------------------------
def _brute_room_below(tier, alpha, last_access, value, protect):
    """`HostCandidates.room_below` from scratch: fresh indexes over the whole tree, `protect` left out."""
    from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex, ranked_below_across

    arena, indexes = cc_arena(tier), []
    for rows in tier.brute_force_entries():
        index = HostCandidateIndex(tie_key=lambda node: node.id)
        for node_id, row in sorted(rows.items()):
            if node_id != protect.id:
                index.add(arena[node_id], *row)
        indexes.append(index)
    masks = ranked_below_across(indexes, alpha, last_access, value)
    return tuple(index.units_where(mask) for index, mask in zip(indexes, masks))


def cc_arena(tier):
    return tier.cache.tree_core._node_arena


class _Audit:
    """Checks every decision of the incremental host candidates against a from-scratch
    recomputation on the same tree, and every entry after each operation (`check`)."""

    def __init__(self, tier):
        self.tier, self.victims, self.admissions = tier, [], 0
        candidates = tier.candidates
        lowest, room_below = candidates.lowest, candidates.room_below

        def checked_lowest(pool, alpha):
            candidates.flush()
            expected = tier.brute_force_lowest(pool, alpha)
            got = lowest(pool, alpha)
            assert got is expected, (
                f"host victim {getattr(got, 'id', None)} != brute force {getattr(expected, 'id', None)}")
            if got is not None:
                self.victims.append((pool, _path_of(got)))
            return got

        def checked_room_below(alpha, last_access, value, protect):
            candidates.flush()
            expected = _brute_room_below(tier, alpha, last_access, value, protect)
            got = room_below(alpha, last_access, value, protect)
            assert got == expected, f"room below {got} != brute force {expected}"
            self.admissions += 1
            return got

        candidates.lowest, candidates.room_below = checked_lowest, checked_room_below


def _path_of(node):
    tokens = []
    while node.parent is not None:
        tokens[:0] = _key(node)
        node = node.parent
    return tuple(tokens)


def _workload(cc, rng, steps, after_each=lambda: None):
    """Random traffic on shared documents (branches, repeats, one-token tails), plus explicit host
    evictions of either pool and device evictions under either pressure."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    docs = [[int(t) for t in rng.integers(1, 5000, size=int(rng.integers(24, 64)))] for _ in range(6)]
    for _ in range(steps):
        op = rng.random()
        if op < 0.75:
            doc = docs[int(rng.integers(len(docs)))]
            cut = int(rng.integers(8, len(doc) + 1))
            tail = [int(t) for t in rng.integers(5000, 6000, size=int(rng.integers(0, 12)))]
            serve(cc, doc[:cut] + tail, n_out=int(rng.integers(1, 3)), chunk_end=chunk_end_for_branch)
        elif op < 0.85:
            cc.cache.evict_host(int(rng.integers(4, 40)), FULL)
        elif op < 0.92:
            cc.cache.evict_host(int(rng.integers(1, 4)), MAMBA)
        else:
            cc.cache.evict(EvictParams(num_tokens=int(rng.integers(0, 40)), mamba_num=int(rng.integers(0, 2))))
        after_each()


def _tree_signature(cc):
    """Every node by its token path, with its tiers (comparable across two caches)."""
    out, stack = [], [cc.tree_core.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is None:
            continue
        kv, st = node.component_data[FULL], node.component_data[MAMBA]
        out.append((_path_of(node), kv.value is not None, kv.host_value is not None, st.value is not None,
                    st.host_value is not None))
    return sorted(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_host_candidates_equal_a_recomputation_after_every_operation(seed):
    """After every operation of a random workload the incremental candidates (both pools) equal a
    from-scratch recomputation over the tree, entry by entry (recency, value, bytes, units), every
    host victim is the from-scratch minimum and every ranked admission counts the same room."""
    import numpy as np

    cc, _, tier = marconi_hicache(kv_size=200, mamba_size=10, ratio=1.0)
    tier.candidates.flush()  # bound from the start: every hook counts
    audit = _Audit(tier)
    _workload(cc, np.random.default_rng(seed), 160, tier.candidates.check)
    counters = cc.settings.counters
    assert len(audit.victims) >= 10 and audit.admissions >= 10, (len(audit.victims), audit.admissions)
    assert {pool for pool, _ in audit.victims} == {KV_POOL, STATE_POOL}
    assert counters.states_demoted and counters.host_evictions and counters.states_loaded_back
    assert tier.candidates.rebuilds == 1  # never rebuilt: kept by the hooks alone
    # the device index too: a load back re-evaluates the path it brought back, never the tree
    assert counters.kv_tokens_loaded_back and cc.cache.marconi.index.rebuilds <= 1
    assert cc.cache.marconi.faults.recovered_count == 0


@pytest.mark.parametrize("mutant", ["node hooks record nothing", "a moved anchor goes unnoticed"])
def test_the_check_catches_a_hook_that_forgets(mutant, monkeypatch):
    """Mutants of the upkeep: the node-level hooks (tiers, children, locks, recency of one node)
    record nothing (the path hooks of matches and locks still do); or a node that became or
    stopped being an anchor does not re-evaluate the nodes below it. The entry-by-entry check
    fails within the workload."""
    import numpy as np

    from sglang_marconi.serving import host_tier

    if mutant == "node hooks record nothing":
        monkeypatch.setattr(host_tier.HostCandidates, "changed", lambda self, node: None)
    cc, _, tier = marconi_hicache(kv_size=200, mamba_size=10, ratio=1.0)
    if mutant == "a moved anchor goes unnoticed":
        monkeypatch.setattr(tier, "anchors_below", lambda node: False)
    tier.candidates.flush()
    with pytest.raises(AssertionError, match="host .* candidates out of date"):
        _workload(cc, np.random.default_rng(0), 160, tier.candidates.check)


# -- faults on the host path -----------------------------------------------------------------------
def _traced(seed=3, steps=120, group_size=1, inject=None):
    """Run the workload on a fresh Marconi HiCache cache; `inject(cc, tier, progress)` installs a
    fault first. Returns (cc, tier, host victims in order, fired flags)."""
    import numpy as np

    cc, _, tier = marconi_hicache(kv_size=200, mamba_size=10, ratio=1.0)
    cc.cache.marconi.faults.group_size = group_size
    victims, progress = [], {"victims": 0}
    evict_host, evict_victim = tier.evict_host, tier._evict_host_victim

    def traced_evict_host(num_tokens, component_type):
        progress["victims"] = 0  # victims evicted so far in this call
        return evict_host(num_tokens, component_type)

    def traced_victim(victim, component_type):
        victims.append(_path_of(victim))
        got = evict_victim(victim, component_type)
        progress["victims"] += 1
        return got

    tier.evict_host, tier._evict_host_victim = traced_evict_host, traced_victim
    fired = inject(cc, tier, progress) if inject is not None else {}
    _workload(cc, np.random.default_rng(seed), steps)
    return cc, tier, victims, fired


def _fault_once(owner, name, when, after_change=False):
    """`owner.name` raises once, at the first call where `when()` holds; `after_change`: after
    the original ran (the tree changed, what it returned is lost)."""
    original, fired = getattr(owner, name), {"fired": False}

    def faulty(*args, **kwargs):
        if not fired["fired"] and when():
            fired["fired"] = True
            if after_change:
                original(*args, **kwargs)
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    setattr(owner, name, faulty)
    return fired


def _counters(cc):
    c = cc.settings.counters
    return {k: v for k, v in vars(c).items() if isinstance(v, (int, float))}


RECOVERABLE = {
    # the victim choice of a multi-victim host eviction, after its first victim left
    "host victim choice, mid-way": lambda cc, tier, p: _fault_once(
        tier.candidates, "lowest", lambda: p["victims"] >= 1),
    # a ranked admission's count of the room below an incoming node
    "ranked admission": lambda cc, tier, p: _fault_once(
        tier.candidates, "room_below", lambda: cc.settings.counters.host_evictions >= 3),
    # the upkeep, inside SGLang's own mutation (a hook's record)
    "upkeep hook": lambda cc, tier, p: _fault_once(
        tier.candidates, "path_changed", lambda: cc.settings.counters.host_evictions >= 3),
}


@pytest.mark.parametrize("where", sorted(RECOVERABLE))
def test_a_recoverable_fault_on_the_host_path_decides_as_an_unfaulted_twin(where):
    """A fault in the host candidates (derived state) on one rank of a group, at the worst offset:
    recovered by a rebuild from the tree, and every later decision is the unfaulted twin's (same
    host victims in the same order, same tree, same counters). The group does not stop."""
    twin, _, twin_victims, _ = _traced()
    cc, tier, victims, fired = _traced(group_size=2, inject=RECOVERABLE[where])
    assert fired["fired"]
    faults = cc.cache.marconi.faults
    assert faults.recovered_count == 1 and faults.fallen_back is None
    assert tier.candidates.rebuilds == 2  # the first bind, and the rebuild after the fault
    assert len(twin_victims) >= 10 and victims == twin_victims
    assert _tree_signature(cc) == _tree_signature(twin)
    assert _counters(cc) == _counters(twin)
    tier.candidates.check()


UNRECOVERABLE = {
    # the tree changed (a host leaf evicted), its frees lost: mid-way through a multi-victim eviction
    "host eviction, mid-way": lambda cc, tier, p: _fault_once(
        cc.tree_core, "_evict_host_leaf", lambda: p["victims"] >= 1, after_change=True),
    # a device leaf dropped on both tiers, the rest of the drop lost
    "device leaf drop": lambda cc, tier, p: _fault_once(
        cc.cache, "_drop_subtree_no_host", lambda: cc.settings.counters.host_evictions >= 1, after_change=True),
    # a decision that fails again after the rebuild
    "host victim choice, twice": lambda cc, tier, p: _fail_every_choice(tier, p),
}


def _fail_every_choice(tier, progress):
    lowest, fired = tier.candidates.lowest, {"fired": False}

    def failing(pool, alpha):
        if progress["victims"] >= 1:
            fired["fired"] = True
            raise RuntimeError("injected fault in lowest (every time)")
        return lowest(pool, alpha)

    tier.candidates.lowest = failing
    return fired


@pytest.mark.parametrize("where", sorted(UNRECOVERABLE))
@pytest.mark.parametrize("group_size", [1, 2])
def test_an_unrecoverable_fault_on_the_host_path(where, group_size):
    """A fault while Marconi's code changes the tree, or a decision failing again after the
    rebuild. A rank of a group raises `MarconiGroupFault` (its tree could part from its peers');
    a rank alone falls back to SGLang's own write_back and serves on: the rest of the workload
    runs, upstream's host eviction does what Marconi's would have."""
    import numpy as np

    from sglang_marconi.serving.faults import MarconiGroupFault
    from sglang_marconi.serving.host_tier import served_tiers

    if group_size > 1:
        with pytest.raises(MarconiGroupFault, match=r"rank 0 of a 2-rank .*host tier"):
            _traced(group_size=2, inject=UNRECOVERABLE[where])
        return
    cc, tier, victims, fired = _traced(inject=UNRECOVERABLE[where])
    assert fired["fired"]
    faults = cc.cache.marconi.faults
    assert faults.fallen_back is not None and "host tier" in faults.fallen_back
    assert not served_tiers(cc.cache)
    marconi_victims = len(victims)
    _workload(cc, np.random.default_rng(11), 60)  # serves on, upstream's rules
    assert len(victims) == marconi_victims  # no host victim of Marconi's after the fallback
    assert serve(cc, A + [5, 6], check_device_index=False)[0].finished()


# -- the continuation signal: one tier rule, simulator and served ----------------------------------
DEEP_FIRST = list(range(1, 13))  # a conversation's first turn; its second extends it (depth 1)
DEEP_SECOND_NEW = list(range(20, 28))
BLOCK = 4  # record blocks small enough for these short sequences


def _fillers(n=6, length=24):
    return [[1000 * (k + 1) + i for i in range(length)] for k in range(n)]


def _served_continued_turn_hit(rules, n_out=2):
    """SGLang's HiCache with Marconi's tier rule `rules`: a two-turn conversation, then first turns
    of others until the host must evict; the host tokens the conversation's third turn loads back
    and the depth the record gave its second turn's end."""
    from sglang_marconi.policy.rules.continuation import ContinuationRecord

    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=0.0, tune_workers=0), kv_size=80, mamba_size=6)
    attach_hicache(cc, ratio=1.0)
    cc.settings.continuation = ContinuationRecord(block_tokens=BLOCK)
    tier = attach_host_tier(cc.cache, cc.settings.profile, rules)
    first, _ = serve(cc, DEEP_FIRST, n_out=n_out)
    second_input = DEEP_FIRST + list(first.output_ids) + DEEP_SECOND_NEW
    second, _ = serve(cc, second_input, n_out=n_out)
    second_seq = second_input + list(second.output_ids)
    for seq in _fillers():
        serve(cc, seq, n_out=n_out)
    tier.candidates.check()
    _, host = serve(cc, second_seq + [70, 71, 72], n_out=1)
    record = cc.settings.continuation
    kept = len(second_seq) - 1  # the served cache keeps input + output[:-1]
    return host, record.depth_at(kept, second_seq[kept - 1]), cc.settings.counters.host_evictions


def _simulated_continued_turn_hit(rules, n_out=2):
    """The same stream through the simulator's `TieredPrefixCache` under `rules`: the host tokens
    the third turn loads back."""
    from toy_profile import ToyProfile

    from sglang_marconi.policy.rules.continuation import ContinuationRecord
    from sglang_marconi.policy.rules.eviction import FlopAwareEviction
    from sglang_marconi.policy.tree.tiered_cache import TieredPrefixCache

    cache = TieredPrefixCache(ToyProfile(), 80, 100, rules, FlopAwareEviction(0.0),
                              continuation=ContinuationRecord(block_tokens=BLOCK), verify=True)
    out = lambda n: [500 + n + i for i in range(n_out)]  # noqa: E731
    cache.serve(DEEP_FIRST, out(1))
    second = DEEP_FIRST + out(1) + DEEP_SECOND_NEW
    cache.serve(second, out(2))
    for seq in _fillers():
        cache.serve(seq, out(3))
    cache.check_invariants()
    lookup, _ = cache.serve(second + out(2) + [70, 71, 72], [1])
    return lookup.host_hit_tokens


@pytest.mark.parametrize("mutant", [None, "keep ignores depth", "depth never found"])
def test_the_tier_rule_with_depth_keeps_a_continued_conversation_on_the_host_in_sim_and_served(mutant, monkeypatch):
    """Host pressure with a conversation's second turn (depth 1) the oldest thing on the host:
    Marconi's tier rule ranking by depth (B = 4) keeps it over the newer first turns of others, so
    its third turn loads it back, in SGLang's HiCache and in the simulator alike; plain recency
    (B = 0, and the host's LRU-like order of the FLOP rule at alpha 0) evicts it first on both. A
    mutant of the one rule (`tier_rules`: the keep score without its depth term, or no depth
    looked up) changes both alike."""
    import numpy as np

    from sglang_marconi.policy.rules import tier_rules
    from sglang_marconi.policy.rules.tier_rules import MarconiTiering

    if mutant == "keep ignores depth":
        monkeypatch.setattr(tier_rules.DepthOrder, "keep",
                            lambda self, recency, depths, newest: -np.log(newest - np.asarray(recency, float) + 1.0))
    elif mutant == "depth never found":
        monkeypatch.setattr(tier_rules.MarconiTiering, "depth_of", staticmethod(lambda record, end, last: 0.0))
    deep = MarconiTiering(depth=4.0)
    served_host, served_depth, host_evictions = _served_continued_turn_hit(deep)
    simulated_host = _simulated_continued_turn_hit(deep)
    assert host_evictions >= 1, "the host never had to choose"
    assert served_depth == 1, "the served record of finished sequences saw the second turn continue the first"
    if mutant is None:
        assert served_host > 0 and simulated_host > 0, (served_host, simulated_host)
    else:
        assert served_host == 0 and simulated_host == 0, (served_host, simulated_host)
    for recency_only in (MarconiTiering(depth=0.0), MarconiTiering(0.0)):
        assert _served_continued_turn_hit(recency_only)[0] == 0
        assert _simulated_continued_turn_hit(recency_only) == 0


@pytest.mark.parametrize("flag, depth", [(None, None), ("off", None), ("2.5", 2.5), ("0", 0.0), ("auto", "auto")])
def test_marconi_host_depth_reaches_the_tier_rule_the_factory_builds(flag, depth, monkeypatch):
    """--marconi-host-depth, parsed by the launcher's flags and carried in the scheduler's
    environment, is the tier rule SGLang's HiCache write_back cache runs: `MarconiTiering(depth=B)`
    (or "auto") with a record of finished sequences for its depth order; off (the default): the
    FLOP rule's host order, no record."""
    import argparse

    from sglang_marconi.policy.rules.continuation import ContinuationRecord
    from sglang_marconi.policy.rules.tier_rules import DepthOrder
    from sglang_marconi.serving.config import ENV_VAR, add_marconi_args, config_from_args
    from sglang_marconi.serving.plugin import marconi_radix_cache_factory

    parser = argparse.ArgumentParser()
    add_marconi_args(parser)
    argv = [] if flag is None else ["--marconi-host-depth", flag]
    monkeypatch.setenv(ENV_VAR, config_from_args(parser.parse_args(argv)).to_env())
    cache = marconi_radix_cache_factory(_hicache_context("write_back"))
    tier = cache.marconi.host_tier
    assert tier is not None and tier.rules.depth == depth
    assert tier.rules.ranks_by_depth == (depth is not None)
    continuation = cache.marconi.settings.continuation
    if depth is None:
        assert not isinstance(tier.order, DepthOrder)
    else:
        assert isinstance(continuation, ContinuationRecord)
        assert tier.order == DepthOrder(0.0 if depth == "auto" else depth)  # auto: B = 0 until evidence


@pytest.mark.parametrize("value", ["-1", "x", "nan", "1e9", "", "on"])
def test_a_bad_marconi_host_depth_is_named_in_one_line(value):
    import argparse

    from sglang_marconi.policy.errors import MarconiError
    from sglang_marconi.serving.config import add_marconi_args, config_from_args

    parser = argparse.ArgumentParser()
    add_marconi_args(parser)
    with pytest.raises(MarconiError) as err:
        config_from_args(parser.parse_args(["--marconi-host-depth", value]))
    assert "--marconi-host-depth" in str(err.value) and repr(value) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MarconiError, match="needs --marconi-admission on"):
        config_from_args(parser.parse_args(["--marconi-host-depth", "2", "--marconi-admission", "off"]))

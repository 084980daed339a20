"""SGLang's real hybrid (FULL + MAMBA) prefix cache on CPU, built and driven as the scheduler does.

`build_cache` wires the same objects the scheduler builds for a Mamba-hybrid model (a tiny
one: 8 layers, 2 of them attention): `HybridReqToTokenPool` (request rows + `MambaPool`),
`HybridLinearKVPool`, `TokenToKVPoolAllocator`, `CacheInitParams` and `UnifiedRadixCache`.
`run_request` takes one request through the scheduler's calls: `Req.init_next_round_input`
(match + Mamba copy-on-write), `cache.lock`, `alloc_req_slots`, `alloc_token_slots` (which
evicts), `checkpoint_kv_cache` after each non-final prefill chunk and after the first token,
one KV slot per decoded token, `release_kv_cache(checkpoint=True)`.
"""

from __future__ import annotations

import itertools
import os
from array import array
from dataclasses import dataclass

# Upstream baselines use the Python tree core too (component overrides force it anyway);
# build_cache(tree_core_backend="rust") still builds an upstream cache on the Rust core.
os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"

import torch  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA
NUM_LAYERS = 8
ATTENTION_LAYERS = [3, 7]
MAMBA_LAYERS = [i for i in range(NUM_LAYERS) if i not in ATTENTION_LAYERS]


@dataclass
class CpuCache:
    cache: UnifiedRadixCache
    allocator: TokenToKVPoolAllocator
    req_to_token_pool: HybridReqToTokenPool
    kv_size: int
    mamba_size: int
    max_num_reqs: int
    settings: object = None  # MarconiEvictionSettings, when built with Marconi's components

    @property
    def tree_core(self):
        return self.cache.tree_core

    def kv_ledger(self) -> tuple[int, int, int]:
        c = self.cache
        return self.allocator.available_size(), c.full_evictable_size(), c.full_protected_size()

    def mamba_ledger(self) -> tuple[int, int, int]:
        c = self.cache
        return self.req_to_token_pool.mamba_allocator.available_size(), c.mamba_evictable_size(), c.mamba_protected_size()

    unified_memory: bool = False  # one byte buffer: the pools' sizes float, SGLang's own check counts

    def check_no_leak(self, idle: bool = True) -> None:
        """available + evictable + protected == pool size, for KV tokens and Mamba slots; when
        no request runs, every request row is free too. (One byte buffer: SGLang's own check.)"""
        if self.unified_memory:
            self.cache.sanity_check()
            if idle:
                assert self.req_to_token_pool.available_size() == self.max_num_reqs
            return
        assert sum(self.kv_ledger()) == self.kv_size, ("kv", self.kv_ledger(), self.kv_size)
        assert sum(self.mamba_ledger()) == self.mamba_size, ("mamba", self.mamba_ledger(), self.mamba_size)
        if idle:
            assert self.req_to_token_pool.available_size() == self.max_num_reqs

    def nodes(self):
        """Every node of the tree but the root (parents before children)."""
        out, stack = [], list(self.tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def node_depth(node) -> int:
    """Tokens from the root to the end of `node`'s edge."""
    n = 0
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


def build_cache(
    *,
    kv_size: int = 4096,
    mamba_size: int = 32,
    max_num_reqs: int = 4,
    component_registry_override=None,
    max_context_len: int = 16384,
    mamba_cache_chunk_size: int = 64,
    tree_core_backend: str | None = None,
    cache_class=None,
    extra_buffer: bool = False,
    unified_memory: bool = False,
    return_params: bool = False,
    chunked_prefill_size: int | None = None,
) -> CpuCache:
    """The scheduler's cache for a tiny Mamba2 hybrid (page size 1), in no-buffer mode or, with
    `extra_buffer`, in extra-buffer mode (ping-pong track slots, the GPU default with overlap).
    With `return_params`, the `CacheInitParams` a radix-cache factory receives, unbuilt.
    `chunked_prefill_size`: what the server args say (the runtime hands it to the tuner's shadows;
    `run_request`'s `chunk_size` is what this harness actually chunks by)."""
    server_args = ServerArgs(model_path="dummy", page_size=1, chunked_prefill_size=chunked_prefill_size)
    server_args._mamba_cache_chunk_size = mamba_cache_chunk_size  # the HF config would say
    set_global_server_args_for_scheduler(server_args)
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2, head_dim=16, state_size=16, conv_kernel=4
    )
    if unified_memory:  # SGLang's --enable-unified-memory pools: KV and states in one byte buffer
        from sglang.srt.mem_cache.unified_memory_pool import init_unified_mamba_pools

        pools = init_unified_mamba_pools(
            device="cpu", kv_cache_dtype=torch.bfloat16, head_num=1, head_dim=8, page_size=1, start_layer=0,
            end_layer=NUM_LAYERS, is_draft_worker=False, use_mla_backend=False, mamba_layer_ids=MAMBA_LAYERS,
            full_attention_layer_ids=ATTENTION_LAYERS, mamba2_cache_params=Mamba2CacheParams(shape=shape,
                                                                                              layers=MAMBA_LAYERS),
            model_context_len=max_context_len, extra_max_context_len=0, max_total_num_tokens=kv_size,
            max_mamba_cache_size=mamba_size, max_num_reqs=max_num_reqs, enable_memory_saver=False,
            enable_mamba_extra_buffer=extra_buffer, enable_mamba_extra_buffer_lazy=False,
            speculative_num_draft_tokens=None, disable_overlap_schedule=True, need_sort=False)
        req_to_token_pool, allocator = pools.req_to_token_pool, pools.token_to_kv_pool_allocator
    else:
        req_to_token_pool = allocator = None
    req_to_token_pool = req_to_token_pool or HybridReqToTokenPool(
        size=max_num_reqs, mamba_size=mamba_size, mamba_spec_state_size=max_num_reqs,
        max_context_len=max_context_len, device="cpu", enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS), mamba_layer_ids=MAMBA_LAYERS,
        enable_mamba_extra_buffer=extra_buffer, speculative_num_draft_tokens=None,
    )
    if allocator is None:
        kv_pool = HybridLinearKVPool(
            size=kv_size, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
            full_attention_layer_ids=ATTENTION_LAYERS, device="cpu", enable_memory_saver=False,
            mamba_pool=req_to_token_pool.mamba_pool,
        )
        allocator = TokenToKVPoolAllocator(
            size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
        )
    params = CacheInitParams(
        req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, page_size=1,
        disable=False, sliding_window_size=None, tree_components=(FULL, MAMBA),
        enable_mamba_extra_buffer=extra_buffer, enable_kv_cache_events=False, eviction_policy="lru",
        is_eagle=False, component_registry_override=component_registry_override,
        tree_core_backend=tree_core_backend,
    )
    if return_params:
        return params
    cache = (cache_class or UnifiedRadixCache)(params)
    cc = CpuCache(cache, allocator, req_to_token_pool, kv_size, mamba_size, max_num_reqs)
    cc.unified_memory = unified_memory
    return cc


_request_ids = itertools.count()


def make_request(tokens, n_out: int) -> Req:
    sampling = SamplingParams(temperature=0, max_new_tokens=n_out)
    sampling.normalize(None)  # the tokenizer manager does this before the scheduler sees it
    return Req(rid=f"req-{next(_request_ids)}", origin_input_text="",
               origin_input_ids=array("q", tokens), sampling_params=sampling)


def _extend(cc: CpuCache, req: Req, end: int) -> None:
    """One prefill chunk [req.prefix_len, end): PrefillAdder admission + alloc_for_extend."""
    cache, pool = cc.cache, cc.req_to_token_pool
    first_chunk = not req.kv.holds_kv
    req.extend_end = end
    if first_chunk:
        req.lock = cache.lock(req.last_node)
        prefix = cache.prefix_device_indices(req) if req.prefix_len else None
    alloc_req_slots(pool, [req], cache)
    locs = alloc_token_slots(cache, end - req.prefix_len)
    row = req.kv.req_pool_idx
    if first_chunk and prefix is not None:
        pool.write((row, slice(0, req.prefix_len)), prefix)
    pool.write((row, slice(req.prefix_len, end)), locs)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = end
    cache.maybe_hand_to_session(req)
    # The forward pass's deferred Mamba copy-on-write from the matched state.
    if req.kv.mamba_cow_src_index is not None:
        pool.copy_mamba_state(req.kv.mamba_cow_src_index.view(-1), req.kv.mamba_pool_idx.view(-1))
        req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False


def _chunk_end(cc: CpuCache, chunk_end, req, end: int) -> int:
    """Marconi's two-pass rule takes the mode's snapshot grid in extra_buffer mode, as the
    scheduler hooks pass it (`two_pass_prefill.py`)."""
    from sglang_marconi.serving.admission import chunk_end_for_branch

    if chunk_end is chunk_end_for_branch and cc.cache.enable_mamba_extra_buffer:
        return chunk_end(req, end, cc.cache.components[MAMBA].mamba_checkpoint_grid)
    return chunk_end(req, end)


def run_request(cc: CpuCache, tokens, n_out: int, chunk_size: int | None = None, out_tokens=None,
                chunk_end=None, decode_at_once: bool = False, session_id: str | None = None):
    """Serve one request end to end; returns (req, hit) with hit = cached prefix tokens reused.
    `chunk_end(req, proposed_end)` may end a prefill chunk earlier (Marconi's two-pass prefill,
    which the scheduler patch applies in PrefillAdder). `decode_at_once`: the decode's KV slots
    (and extra_buffer snapshots) in one allocation after the first token, rather than one per
    step: the same victims (decode touches nothing in the tree), far fewer calls. `session_id`:
    the session the client names (SGLang's `GenerateReqInput.session_id`)."""
    cache, pool = cc.cache, cc.req_to_token_pool
    req = make_request(tokens, n_out)
    req.session_id = session_id
    req.init_next_round_input(cache)  # match_prefix with Mamba copy-on-write
    hit = req.cached_tokens = req.prefix_len  # ScheduleBatch.prepare_for_extend's accounting
    n = len(req.full_untruncated_fill_ids)
    while True:
        end = n if chunk_size is None else min(req.prefix_len + chunk_size, n)
        if chunk_end is not None:
            end = _chunk_end(cc, chunk_end, req, end)
        _extend(cc, req, end)
        if cc.cache.enable_mamba_extra_buffer:
            _track_extend(cc, req)
        if end == n:
            break
        checkpoint_kv_cache(req, cache)  # stash_chunked_request
    if decode_at_once:
        return req, _decode_at_once(cc, req, n_out, out_tokens, hit)
    step = 0
    while True:
        token = out_tokens[step] if out_tokens is not None else 10_000_000 + next(_request_ids)
        req.output_ids.append(token)
        req.update_finish_state()
        step += 1
        if req.finished():
            break
        if step == 1:
            checkpoint_kv_cache(req, cache)  # after prefill, before the first decode step
        pos = req.kv.kv_committed_len
        loc = alloc_token_slots(cache, 1)
        pool.write((req.kv.req_pool_idx, slice(pos, pos + 1)), loc)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
        if cache.enable_mamba_extra_buffer:
            _track_decode(cc, req)
    if req.finished_reason is None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, cache, checkpoint=True)
    return req, hit


def _decode_at_once(cc: CpuCache, req: Req, n_out: int, out_tokens, hit: int) -> int:
    cache, pool = cc.cache, cc.req_to_token_pool
    outputs = list(out_tokens) if out_tokens is not None else [10_000_000 + next(_request_ids) for _ in range(n_out)]
    req.output_ids.append(outputs[0])
    req.update_finish_state()
    if not req.finished():
        checkpoint_kv_cache(req, cache)  # after prefill, before the first decode step
        pos, extra = req.kv.kv_committed_len, len(outputs) - 1
        loc = alloc_token_slots(cache, extra)
        pool.write((req.kv.req_pool_idx, slice(pos, pos + extra)), loc)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + extra
        if cache.enable_mamba_extra_buffer:
            track_decode_span(cc, req, pos, pos + extra)
        req.output_ids.extend(outputs[1:])
        req.update_finish_state()
    if req.finished_reason is None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, cache, checkpoint=True)
    return hit


def build_marconi_serving(config, profile="nemotron-h-8b", group=None, **kwargs):
    """The cache the `marconi` backend's factory builds (components, admission, cache class,
    runtime), on CPU; returns (CpuCache, MarconiRuntime). `group`: the runtime's `RankGroup`."""
    from sglang_marconi.serving.admission import admission_mixin
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.components import marconi_component_overrides
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings
    from sglang_marconi.serving.faults import MarconiFaults
    from sglang_marconi.serving.lockstep import RankGroup
    from sglang_marconi.serving.plugin import attach_runtime

    group = group if group is not None else RankGroup()
    settings = MarconiEvictionSettings(profile, choice=config.fixed_choice or 0.0, faults=MarconiFaults(group.size, group.rank))
    mixins = (admission_mixin(),) if config.admission else ()
    overrides = marconi_component_overrides(settings, mamba_mixins=mixins)
    cc = build_cache(component_registry_override=overrides, cache_class=kwargs.pop("cache_class", None)
                     or marconi_cache_class(), **kwargs)
    cc.settings = settings
    return cc, attach_runtime(cc.cache, config, group=group)


def _track_extend(cc: CpuCache, req: Req) -> None:
    """Extra-buffer mode: the real ScheduleBatch bookkeeping that picks which state of this
    extend the forward pass tracks (the chunk grid, or the branch point inside the extend)."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch

    batch = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(mamba_chunk_size=64)),
        tree_cache=cc.cache, req_to_token_pool=cc.req_to_token_pool,
    )
    ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(batch, req)


def _track_decode(cc: CpuCache, req: Req) -> None:
    """Extra-buffer mode: the decode track boundary (batch_result_processor) every grid tokens."""
    from sglang.srt.runtime_context import mamba_track_grid

    kv = req.kv
    if kv.kv_committed_len % mamba_track_grid(1) == 0:
        kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
        kv.mamba_last_track_seqlen = kv.kv_committed_len
        kv.mamba_last_track_idx = kv.mamba_next_track_idx
        kv.mamba_next_track_idx = cc.req_to_token_pool.get_mamba_ping_pong_other_idx(kv.mamba_last_track_idx)


def track_decode_span(cc: CpuCache, req: Req, start: int, end: int) -> None:
    """Extra-buffer mode: the decode snapshots of tokens [start, end) decoded in one go (what
    `_track_decode` does one token at a time, at each grid boundary crossed)."""
    from sglang.srt.runtime_context import mamba_track_grid

    grid = mamba_track_grid(1)
    kv = req.kv
    for boundary in range((start // grid + 1) * grid, end + 1, grid):
        kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
        kv.mamba_last_track_seqlen = boundary
        kv.mamba_last_track_idx = kv.mamba_next_track_idx
        kv.mamba_next_track_idx = cc.req_to_token_pool.get_mamba_ping_pong_other_idx(kv.mamba_last_track_idx)


def result_in_spawned_process(target, timeout: float = 120):
    """Run `target(queue)` in a fresh `spawn` process, as SGLang starts its schedulers, and
    return what it put on the queue."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue,))
    proc.start()
    result = queue.get(timeout=timeout)
    proc.join(timeout=60)
    return result


def tree_signature(cache):
    """Every node as (path, has a Mamba state), in a canonical order: two caches with the same
    signature hold the same prefixes and the same states (what a TP group needs of its ranks)."""
    out, stack = [], [(cache.tree_core.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + tuple(child.key.token_ids)
            out.append((child_path, child.component_data[MAMBA].value is not None))
            stack.append((child, child_path))
    return sorted(out)


# -- faults ------------------------------------------------------------------------------------
class Injected(RuntimeError):
    """A fault a test injects."""


class FakeGroup:
    """Rank 1 of a 2-rank group, for the fault protocol only (nothing here communicates)."""

    def __new__(cls):
        from sglang_marconi.serving.lockstep import RankGroup

        group = RankGroup()
        group.size, group.rank, group.is_leader = 2, 1, False
        return group


def fail_at(monkeypatch, owner, name, calls):
    """Make `owner.name` raise `Injected` at the calls numbered in `calls` (1-based; a range for
    a persistent fault); returns the call log."""
    original = getattr(owner, name)
    log = []

    def broken(*args, **kwargs):
        log.append(1)
        if len(log) in calls:
            raise Injected(f"injected into {name} at call {len(log)}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)
    return log

"""SGLang's real SWA hybrid prefix cache (FULL + SWA components) on CPU, upstream's or Marconi's.

`build_swa_cache` wires what the scheduler builds for a model with global and sliding-window
layers (page size 1): `SWAKVPool`, `SWATokenToKVPoolAllocator` (a full pool and a smaller SWA
pool), `CacheInitParams` with `sliding_window_size`, and `UnifiedRadixCache` with SGLang's SWA
component, or, with `marconi=True`, what the `marconi` backend's factory builds for such a model
(`serving/swa_component.py`: Marconi's SWA component and cache class).

`SWACpuCache` drives it as requests would, at the cache's API: `insert` (a request's KV, its SWA
KV before `evicted` already freed as SGLang's out-of-window freeing does), `match` (stamps the
matched path), `lock` / `release_swa` / `unlock` (a running request's hold), `evict_swa` (SWA pool pressure).
`run_swa_request` takes one request through the scheduler's calls instead (as `sglang_cpu.run_request`
does for Mamba hybrids): match, lock, request row and KV allocation (evicting), prefill chunks with
`checkpoint_kv_cache` between them and after the first token, decode with the scheduler's
out-of-window SWA freeing (`ScheduleBatch.maybe_evict_swa`), `release_kv_cache`.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass

os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

FULL, SWA = ComponentType.FULL, ComponentType.SWA


def tiny_swa_config(window: int) -> dict:
    """A tiny Mellum-shaped config (3 SWA layers, 1 global): the profile Marconi ranks with."""
    return dict(
        architectures=["MellumForCausalLM"], model_type="mellum", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] * 4,
        sliding_window=window, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        torch_dtype="bfloat16")


@dataclass
class SWACpuCache:
    cache: UnifiedRadixCache
    allocator: SWATokenToKVPoolAllocator
    kv_size: int
    swa_size: int
    settings: object = None  # SWASettings, for Marconi's cache

    @property
    def tree_core(self):
        return self.cache.tree_core

    @property
    def component(self):
        return self.tree_core.components_by_type[SWA]

    @property
    def plan(self):
        """Marconi's incremental plan (None before the first eviction, or upstream's cache)."""
        return getattr(self.component, "marconi_plan", None)

    def insert(self, tokens, evicted: int = 0, cached: int = 0):
        """Insert a request's KV for `tokens`, whose SWA KV before position `evicted` was already
        freed; with `cached`, the first `cached` tokens are the tree's own (a matched prefix, as
        the scheduler passes it: `prev_prefix_len`, no new slots), and must be in the tree.
        Returns SGLang's InsertResult, or None if the pools are full. Marconi's cache then brings
        its plan up to date, as it does when a request is released (`marconi_upkeep`)."""
        new = self.allocator.alloc(len(tokens) - cached)
        if new is None:
            return None
        evicted = max(evicted, cached)
        if evicted > cached:
            self.allocator.free_swa(new[: evicted - cached])
        value = torch.cat([torch.zeros(cached, dtype=new.dtype), new]) if cached else new
        params = InsertParams(key=RadixKey(array("q", tokens)), value=value, prev_prefix_len=cached)
        if evicted:
            params.set_evicted_seqlen(SWA, evicted)
        result = self.cache.insert(params)
        component = self.cache.tree_core.components_by_type[SWA]
        if hasattr(component, "marconi_upkeep"):
            component.marconi_upkeep()
        return result

    def match(self, tokens):
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))

    def lock(self, tokens):
        """Hold the matched prefix of `tokens` as a running request does (SGLang's `TreeLock`),
        or None when nothing matched."""
        return self.cache.lock(self.match(tokens).last_device_node)

    def release_swa(self, lock) -> None:
        """The request's window moved past its prefix: its SWA part is released early."""
        self.cache.release_swa(lock)

    def unlock(self, lock) -> None:
        self.cache.unlock(lock)

    def evict_swa(self, tokens: int = 1):
        return self.cache.evict(EvictParams(swa_num_tokens=tokens))

    def ledgers(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        c, a = self.cache, self.allocator
        return ((a.full_available_size(), c.full_evictable_size(), c.full_protected_size()),
                (a.swa_available_size(), c.swa_evictable_size(), c.swa_protected_size()))

    def check_no_leak(self) -> None:
        full, swa = self.ledgers()
        assert sum(full) == self.kv_size, ("full", full, self.kv_size)
        assert sum(swa) == self.swa_size, ("swa", swa, self.swa_size)

    def nodes(self):
        out, stack = [], list(self.tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def build_swa_cache(*, kv_size: int = 4096, swa_size: int = 1024, window: int = 8, marconi: bool = True,
                    alpha: float = 1.0, max_context_len: int = 8192, profile=None) -> SWACpuCache:
    """The scheduler's cache for a tiny SWA hybrid (page size 1): upstream's, or Marconi's.
    `profile`: what Marconi's eviction ranks by (default: the tiny model's own)."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
    pool = SWAKVPool(size=kv_size, size_swa=swa_size, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                     swa_attention_layer_ids=[0, 1, 2], full_attention_layer_ids=[3], device="cpu")
    allocator = SWATokenToKVPoolAllocator(size=kv_size, size_swa=swa_size, page_size=1, dtype=torch.bfloat16,
                                          device="cpu", kvcache=pool, need_sort=False)
    req_to_token_pool = ReqToTokenPool(size=4, max_context_len=max_context_len, device="cpu",
                                       enable_memory_saver=False)
    override, cache_class, settings = None, UnifiedRadixCache, None
    if marconi:
        from sglang_marconi.serving.swa_component import (
            SWAFigures,
            SWASettings,
            marconi_swa_cache_class,
            marconi_swa_component_class,
            profile_for_swa,
        )

        settings = SWASettings(profile=profile or profile_for_swa(tiny_swa_config(window)), alpha=alpha, window=window,
                               figures=SWAFigures())
        component = type("MarconiSWAComponent", (marconi_swa_component_class(),), {"marconi_swa_settings": settings})
        override, cache_class = {SWA: component}, marconi_swa_cache_class()
    params = CacheInitParams(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, page_size=1,
                             disable=False, sliding_window_size=window, tree_components=(FULL, SWA),
                             eviction_policy="lru", component_registry_override=override)
    cache = cache_class(params)
    if marconi:  # what the factory does after building the cache
        from sglang_marconi.serving.cache_state import MarconiCacheState

        cache.marconi = MarconiCacheState(settings)
        cache.tree_core.components_by_type[SWA].marconi_start()
    return SWACpuCache(cache, allocator, kv_size, swa_size, settings)


def build_marconi_swa_serving(config, profile, *, kv_size: int, swa_size: int, max_context_len: int = 8192):
    """What the `marconi` backend's factory builds for an SWA model (`swa_component.py`:
    component, cache class, cache state with the serving config, `SWARuntime`), on CPU, ranking
    by `profile` (its window is the cache's); returns (SWACpuCache, SWARuntime)."""
    from sglang_marconi.serving.cache_state import MarconiCacheState
    from sglang_marconi.serving.swa_runtime import SWARuntime

    cc = build_swa_cache(kv_size=kv_size, swa_size=swa_size, window=int(profile.sliding_window), marconi=True,
                         alpha=config.alpha or 0.0, max_context_len=max_context_len, profile=profile)
    cache = cc.cache
    cache.marconi = MarconiCacheState(cc.settings, config=config)
    cache.marconi.runtime = runtime = SWARuntime(cache, cc.settings, config)
    return cc, runtime


def run_swa_request(cc: SWACpuCache, tokens, out_tokens, chunk_size: int | None = None) -> int:
    """Serve one request end to end through the scheduler's calls; returns the hit (prefix reused).
    Decode steps between two of the scheduler's out-of-window SWA frees (every
    `SGLANG_SWA_EVICTION_INTERVAL` tokens past the window) allocate their KV at once: decode
    touches nothing in the tree, so the victims are the same as one step at a time."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang_cpu import make_request

    cache = cc.cache
    pool = cache.req_to_token_pool
    outputs = list(out_tokens)
    req = make_request(tokens, len(outputs))
    req.init_next_round_input(cache)  # match_prefix (SWA validator, branching seqlen)
    hit = req.cached_tokens = req.prefix_len
    n = len(req.full_untruncated_fill_ids)
    while True:  # prefill chunks: PrefillAdder + alloc_for_extend
        end = n if chunk_size is None else min(req.prefix_len + chunk_size, n)
        first = not req.kv.holds_kv
        req.extend_end = end
        if first:
            req.lock = cache.lock(req.last_node)
            prefix = cache.prefix_device_indices(req) if req.prefix_len else None
        alloc_req_slots(pool, [req], cache)
        locs = alloc_token_slots(cache, end - req.prefix_len)
        row = req.kv.req_pool_idx
        if first and prefix is not None:
            pool.write((row, slice(0, req.prefix_len)), prefix)
        pool.write((row, slice(req.prefix_len, end)), locs)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        cache.maybe_hand_to_session(req)
        if end == n:
            break
        checkpoint_kv_cache(req, cache)  # stash_chunked_request
    window = cache.swa_retain_window
    interval = max(1, envs.SGLANG_SWA_EVICTION_INTERVAL.get())
    req.output_ids.append(outputs[0])
    req.update_finish_state()
    done = 1
    if not req.finished():
        checkpoint_kv_cache(req, cache)  # after prefill, before the first decode step
    while not req.finished():
        # alloc_for_decode -> maybe_evict_swa: from the second decode step on, once the window
        # has moved `interval` tokens past what was freed
        if req.decode_batch_idx >= 1 and req.seqlen - 1 - window >= req.kv.get_evicted_seqlen(SWA) + interval:
            cache.evict_sliding_windows(req, req.seqlen - 1)
        fires_at = req.kv.get_evicted_seqlen(SWA) + interval + window + 1  # seqlen of the next free
        k = 1 if req.decode_batch_idx == 0 else max(1, min(len(outputs) - done, fires_at - req.seqlen))
        pos = req.kv.kv_committed_len
        pool.write((req.kv.req_pool_idx, slice(pos, pos + k)), alloc_token_slots(cache, k))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + k
        req.decode_batch_idx += k
        req.output_ids.extend(outputs[done: done + k])
        done += k
        req.update_finish_state()
    if req.finished_reason is None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, cache, checkpoint=True)
    return hit


def session_requests(window: int, seed: int = 0, prompts: int = 8, live_sessions: int = 64):
    """Multi-turn chat sessions over shared system prompts, as (tokens, evicted, cached) inserts
    without end: each request extends one of `live_sessions` sessions by a user turn and a reply
    (1 in 10 forks off the session's previous prompt instead: a regenerated reply), a new session
    replaces an old one 1 time in 10; each keeps the SWA KV of its last window only, so a session's
    earlier windows go stale as it grows. Token ids are unique per position written: prefixes are
    shared only where the sessions share them."""
    import random

    rng = random.Random(seed)
    counter = iter(range(1, 1 << 62))

    def fresh(n):
        return [next(counter) for _ in range(n)]

    systems = [fresh(3 * window) for _ in range(prompts)]
    sessions: list[tuple[list, int]] = []  # (tokens so far, where its last prompt ended)
    inserted: set[int] = set()  # system prompts already in the tree
    while True:
        if len(sessions) < live_sessions or rng.random() < 0.1:
            k = rng.randrange(prompts)
            prompt, cached = systems[k] + fresh(rng.randrange(8, 64)), len(systems[k]) if k in inserted else 0
            inserted.add(k)
            if len(sessions) >= live_sessions:
                sessions.pop(rng.randrange(len(sessions)))
        else:
            history, prompt_end = sessions.pop(rng.randrange(len(sessions)))
            if rng.random() < 0.1:
                history = history[:prompt_end]
            prompt, cached = history + fresh(rng.randrange(8, 64)), len(history)
        tokens = prompt + fresh(rng.randrange(4, 16))  # the reply
        sessions.append((tokens, len(prompt)))
        yield tokens, len(tokens) - window, cached


def branch_requests(window: int, seed: int = 0, prompts: int = 64):
    """Single-turn requests over shared prompts, as (tokens, evicted, cached) inserts without end:
    a prompt's first request keeps the SWA KV of its last window only; its second keeps the window
    before the prompt's end too (SGLang's branch insertion: the full KV matched past the SWA-valid
    prefix), so every branch point holds a live window; no SWA KV goes stale."""
    import random

    rng = random.Random(seed)
    counter = iter(range(1, 1 << 62))

    def fresh(n):
        return [next(counter) for _ in range(n)]

    systems = [fresh(3 * window) for _ in range(prompts)]
    users = [0] * prompts
    while True:
        k = rng.randrange(prompts)
        system = systems[k]
        if users[k] == 1:
            yield system, len(system) - window, len(system) - window
        tokens = system + fresh(rng.randrange(8, 64)) + fresh(rng.randrange(4, 16))
        yield tokens, len(tokens) - window, len(system) if users[k] else 0
        users[k] += 1


def grow_tree(cc: SWACpuCache, target_nodes: int, requests) -> int:
    """Insert `requests` ((tokens, evicted, cached) triples) until the tree has `target_nodes`
    nodes; returns the inserts made. The pools must be large enough for no eviction, and for 512
    inserts' new tokens on top (frees are batched per 512 inserts: SGLang's CPU allocator copies
    its whole free list per free)."""
    arena, n = cc.tree_core._node_arena, 0
    cc.allocator.free_group_begin()
    try:
        for n, (tokens, evicted, cached) in enumerate(requests, 1):
            if cc.insert(tokens, evicted=evicted, cached=cached) is None:
                raise MemoryError(f"pools full after {n} inserts, {len(arena) - 1} nodes")
            if n % 512 == 0:
                cc.allocator.free_group_end()
                cc.allocator.free_group_begin()
            if len(arena) - 1 >= target_nodes:
                return n
    finally:
        cc.allocator.free_group_end()
    return n

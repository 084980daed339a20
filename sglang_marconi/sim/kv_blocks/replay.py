"""Replay a hash-id view through a block cache: prefix hits, then every block accessed in order.

Checked on every run (a violation raises RuntimeError: a bug, not bad input): the overall hit
rate is total hit tokens over total prompt tokens, the per-request sums equal the totals, the
cache never holds more than its capacity, and a request whose first hash id was never seen
before hits nothing.
"""

from __future__ import annotations

import time

import numpy as np

from sglang_marconi.sim.kv_blocks.base import BlockCache
from sglang_marconi.sim.kv_blocks.view import BlockTrace
from sglang_marconi.sim.policy_api import PolicyStats
from sglang_marconi.sim.replay import Progress, RunResult, summarize


def replay_blocks(trace: BlockTrace, cache: BlockCache, profile, *, name: str | None = None,
                  capacity_bytes: int | None = None, gpu: str = "A100-80GB", progress: bool = True) -> RunResult:
    """Replay `trace` through `cache`. `name`: the policy as listed (e.g. with its parameters);
    `capacity_bytes`: what the run reports (default: the blocks' KV bytes on `profile`)."""
    block, n = trace.block_size, len(trace.requests)
    block_bytes = profile.kv_bytes_per_token * block
    if capacity_bytes is None:
        capacity_bytes = cache.capacity * block_bytes
    name = name or cache.name
    hit_blocks = [0] * n
    hit_tokens = [0] * n
    prompt_tokens = [0] * n
    resident, access, seen = cache.resident, cache.access, set()
    bar = Progress(n, f"{name} @ {cache.capacity} blocks", progress)
    started = time.perf_counter()
    for i, (ids, length) in enumerate(trace.requests):
        k = 0
        for h in ids:
            if h not in resident:
                break
            k += 1
        if k and ids[0] not in seen:
            raise RuntimeError(f"{name}: request {i} hit {k} blocks although its first hash {ids[0]} was never seen")
        for h in ids:
            access(h)
        seen.update(ids)
        hit_blocks[i], hit_tokens[i], prompt_tokens[i] = k, min(k * block, length), length
        bar.update()
    wall = time.perf_counter() - started
    final_blocks = len(cache)
    total_hit, total_prompt = sum(hit_tokens), sum(prompt_tokens)
    hits, inputs = np.array(hit_tokens, dtype=np.int64), np.array(prompt_tokens, dtype=np.int64)
    overall = total_hit / total_prompt if total_prompt else 0.0
    if final_blocks > cache.capacity:
        raise RuntimeError(f"{name}: {final_blocks} blocks cached, capacity {cache.capacity}")
    if int(hits.sum()) != total_hit or int(inputs.sum()) != total_prompt:
        raise RuntimeError(f"{name}: per-request sums differ from the totals")
    stats = PolicyStats(kv_tokens_cached=final_blocks * block, bytes_used=final_blocks * block_bytes,
                        evictions_leaf=cache.evictions)
    run = summarize(name, trace.name, profile, capacity_bytes, inputs, hits, stats, wall, gpu,
                    {"prompt_tokens": prompt_tokens, "hit_blocks": hit_blocks},
                    block_cache={
                        "capacity_blocks": cache.capacity, "block_size": block, "hashes_derived": trace.derived,
                        "total_hit_tokens": total_hit, "total_prompt_tokens": total_prompt,
                        "overall_hit_rate": overall, "final_cache_blocks": final_blocks,
                        "evictions": cache.evictions,
                    })
    if run.token_hit_rate != overall or run.hit_tokens != total_hit or run.input_tokens != total_prompt:
        raise RuntimeError(f"{name}: overall hit rate {overall} != {run.token_hit_rate}")
    bar.finish(run)
    return run

"""Lockstep: every decision that changes the tree is a function of the request stream alone.

Ranks of a TP / PP group each run the same scheduling on their own tree; SGLang requires the trees
to stay identical (`@rank_consensus(same_results)` on match, insert, evict). Here: replicas of
SGLang's real cache with our backend, fed the same stream with different timings (a tuner process
paused at random, a scheduler that sleeps), end with identical trees, identical eviction sequences
and identical switches; and two real processes joined by a gloo group (one tuner, on rank 0) stay
identical, and fall back together when one rank faults.
"""

import os
import random
import signal
import threading
import time

import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving, result_in_spawned_process, run_request  # noqa: E402

from sglang_marconi.policy.shadow_tuner import LRU  # noqa: E402
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

CONFIG = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), seglen_weights=(50.0,), tune_sync_every=8)
LONG = list(range(200_000, 201_200))


def workload(n, seed=0):
    """A long, valuable prefix revisited now and then among short one-offs (LRU loses it; FLOP-aware
    eviction keeps it), and from the middle on, a second phase where the one-offs share prefixes."""
    rng = random.Random(seed)
    for i in range(n):
        if i % 8 == 0:
            yield LONG + list(range(50_000 + 40 * i, 50_000 + 40 * i + 30))
        elif i > n // 2 and i % 3 == 0:
            base = 300_000 + 1000 * rng.randrange(6)
            yield list(range(base, base + 300)) + [400_000 + i]
        else:
            yield list(range(100_000 + 700 * i, 100_000 + 700 * i + 100 + 7 * (i % 20)))


def outputs(i):
    """Request i's decoded tokens: the same in every replica (the stream is the requests and replies)."""
    return [9_000_000 + 10 * i + j for j in range(6)]


def tree_signature(cache):
    """Every node as (path, has a Mamba state), in a canonical order."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    out, stack = [], [(cache.tree_core.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + tuple(child.key.token_ids)
            out.append((child_path, child.component_data[ComponentType.MAMBA].value is not None))
            stack.append((child, child_path))
    return sorted(out)


def serve_stream(runtime_cc, n, *, pause=None, seed=0):
    """Run the stream; returns (evictions, adoptions). `pause(i)` runs before request i."""
    cc, runtime = runtime_cc
    evictions = []
    on_evict = runtime.on_evict

    def record(tokens, states):
        evictions.append((runtime.figures.requests, tokens, states))
        on_evict(tokens, states)

    runtime.on_evict = record
    for i, tokens in enumerate(workload(n, seed)):
        if pause is not None:
            pause(i)
        run_request(cc, tokens, 6, out_tokens=outputs(i), chunk_end=chunk_end_for_branch)
    return evictions, list(runtime.adoptions)


def wait_ready(runtime, timeout=60):
    deadline = time.monotonic() + timeout
    while not runtime.tuner.ready:
        assert time.monotonic() < deadline, "the tuner process did not start"
        time.sleep(0.02)


def test_replicas_with_different_timings_make_identical_trees_and_evictions():
    fast = build_marconi_serving(CONFIG, kv_size=2500, mamba_size=8)
    slow = build_marconi_serving(CONFIG, kv_size=2500, mamba_size=8)
    wait_ready(fast[1])
    wait_ready(slow[1])
    rng = random.Random(1)
    child = slow[1].tuner._proc.pid

    def jitter(i):
        """The slow replica: its tuner process paused for a while every few requests (the
        scheduler runs ahead of it), its scheduler sleeping at random."""
        if i % 10 == 3:
            os.kill(child, signal.SIGSTOP)
            threading.Timer(rng.uniform(0.05, 0.3), os.kill, (child, signal.SIGCONT)).start()
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0, 0.02))

    try:
        ev_fast, ad_fast = serve_stream(fast, 200)
        ev_slow, ad_slow = serve_stream(slow, 200, pause=jitter)
    finally:
        os.kill(child, signal.SIGCONT)
    assert fast[1].tuner.failed is None and slow[1].tuner.failed is None
    assert len(ad_fast) >= 1, "the tuner never switched: the test would prove nothing"
    assert ad_fast == ad_slow
    assert ev_fast == ev_slow and len(ev_fast) > 10
    assert tree_signature(fast[0].cache) == tree_signature(slow[0].cache)
    # Different streams do make different trees (the signature can tell them apart).
    other = build_marconi_serving(MarconiServingConfig(alpha=0.0), kv_size=2500, mamba_size=8)
    serve_stream(other, 200, seed=7)
    assert tree_signature(other[0].cache) != tree_signature(fast[0].cache)
    for _, runtime in (fast, slow, other):
        runtime.close()


def test_a_switch_takes_effect_at_the_sync_point_after_the_tuner_decided():
    cc, runtime = build_marconi_serving(MarconiServingConfig(**{**CONFIG.__dict__, "tune_workers": 0}),
                                        kv_size=2500, mamba_size=8)
    serve_stream((cc, runtime), 200)
    decisions = runtime.tuner.tuner.log.decisions
    assert len(runtime.adoptions) >= 1
    for released, choice in runtime.adoptions:
        assert released % 8 == 0  # only at sync points
        as_of = released - 8  # the tuner's choice as of the previous sync point
        assert choice == [c for at, c in decisions if at <= as_of][-1]


# -- two ranks, one gloo group ----------------------------------------------------------------

def _rank(rank, init_file, fault_at, queue):
    import torch.distributed as dist

    import sglang_cpu

    from sglang_marconi.serving.lockstep import RankGroup

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = RankGroup([dist.group.WORLD])
        cc, runtime = sglang_cpu.build_marconi_serving(CONFIG, kv_size=2500, mamba_size=8, group=group)
        for i, tokens in enumerate(workload(200)):
            if rank == 1 and i == fault_at:
                runtime.settings.fault("test", RuntimeError("injected on rank 1")) if hasattr(
                    runtime.settings, "fault") else runtime._fault("test", RuntimeError("injected on rank 1"))
            if rank == 1 and i % 10 == 3:
                time.sleep(0.05)  # rank 1 runs late
            sglang_cpu.run_request(cc, tokens, 6, out_tokens=outputs(i), chunk_end=chunk_end_for_branch)
        figures = runtime.metrics(cc.cache)
        queue.put((rank, group.is_leader, runtime.tuner is not None, tree_signature(cc.cache),
                   list(runtime.adoptions), figures["marconi_eviction_policy"], runtime.faulted is not None))
        runtime.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, fault_at):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init_file = tmp_path / "gloo-init"
    procs = [ctx.Process(target=_rank, args=(r, str(init_file), fault_at, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict()
    for _ in procs:
        item = queue.get(timeout=300)
        results[item[0]] = item
    for p in procs:
        p.join(timeout=60)
    for item in results.values():
        assert len(item) > 2, f"rank {item[0]} failed: {item[1]}"
    return results[0], results[1]


def test_two_ranks_in_a_gloo_group_keep_identical_trees_with_one_tuner(tmp_path):
    r0, r1 = _two_ranks(tmp_path, fault_at=None)
    assert r0[1] and r0[2]  # rank 0 leads and runs the tuner
    assert not r1[1] and not r1[2]  # rank 1 runs none
    assert r0[4] == r1[4] and len(r0[4]) >= 1  # the same switches at the same requests
    assert r0[3] == r1[3]  # identical trees


def test_a_fault_on_one_rank_makes_the_group_fall_back_together(tmp_path):
    r0, r1 = _two_ranks(tmp_path, fault_at=60)
    assert r0[6] and r1[6]  # both faulted: rank 0 learned it at the next sync point
    assert r0[5] == r1[5] == "upstream"
    assert r0[4] == r1[4]
    assert r0[3] == r1[3]

"""Lockstep: every decision that changes the tree is a function of what every rank sees in the same
order (the requests and the leader's directives), so the ranks of a TP / PP group keep identical
trees whatever fails where.

Two real processes joined by a gloo group play two ranks of one scheduling. Each "iteration" the
leader's pending directives are broadcast to both ranks before the next request, exactly as
SGLang's scheduler broadcasts each iteration's requests from its first rank (the directives ride
that broadcast in a server: `serving/group_channel.py`). Both ranks run SGLang's real cache with
our backend under eviction pressure, rank 1 runs late, and after *every* request the two trees
are compared. Faults are injected on one rank only:
- an index fault (recovered by a rebuild from the tree) at every offset of a sync interval,
  right after a sync point included, for several seeds and index methods;
- a raising metrics exporter on the stats rank (rank 0) only;
- a raising tuner feed on the leader only;
- an unrecoverable fault on rank 1: the group stops with one clear error instead of parting.
Also: ranks given different Marconi settings refuse to start, all of them, in one line.
"""

import os
import random
import signal
import threading
import time

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_marconi_serving, run_request, tree_signature  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

SYNC_EVERY = 8
CONFIG = MarconiServingConfig(alpha=None, alpha_grid=(0.0, 2.0, 20.0), seglen_weights=(50.0,),
                              tune_sync_every=SYNC_EVERY)
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
            yield list(range(base, base + 300)) + [400_000 + i + seed]
        else:
            yield list(range(100_000 + 700 * i, 100_000 + 700 * i + 100 + 7 * ((i + seed) % 20)))


def outputs(i):
    """Request i's decoded tokens: the same on every rank (the stream is the requests and replies)."""
    return [9_000_000 + 10 * i + j for j in range(6)]


def serve_stream(runtime_cc, n, *, pause=None, seed=0):
    """Run the stream on one cache; returns (evictions, adoptions). `pause(i)` runs before request i."""
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


def test_replicas_whose_tuners_keep_pace_make_identical_trees_and_evictions():
    """Two independent servers fed the same stream switch at the same requests as long as each
    tuner answers within the sync wait (raised here to 60 s so that the paused tuner always does);
    a tuner that does not is counted late and its verdict taken at a later sync point."""
    config = MarconiServingConfig(**{**CONFIG.__dict__, "tune_sync_wait_s": 60.0})
    fast = build_marconi_serving(config, kv_size=2500, mamba_size=8)
    slow = build_marconi_serving(config, kv_size=2500, mamba_size=8)
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
    other = build_marconi_serving(MarconiServingConfig(alpha=0.0), kv_size=2500, mamba_size=8)
    serve_stream(other, 200, seed=7)
    assert tree_signature(other[0].cache) != tree_signature(fast[0].cache)  # the signature tells
    for _, runtime in (fast, slow, other):
        runtime.close()


def test_a_switch_takes_effect_at_the_sync_point_after_the_tuner_decided():
    cc, runtime = build_marconi_serving(MarconiServingConfig(**{**CONFIG.__dict__, "tune_workers": 0}),
                                        kv_size=2500, mamba_size=8)
    serve_stream((cc, runtime), 200)
    decisions = runtime.tuner.tuner.log.decisions
    assert len(runtime.adoptions) >= 1
    for released, choice in runtime.adoptions:
        assert released % SYNC_EVERY == 0  # only at sync points
        as_of = released - SYNC_EVERY  # the tuner's choice as of the previous sync point
        assert choice == [c for at, c in decisions if at <= as_of][-1]


# -- two ranks, one gloo group ----------------------------------------------------------------------

class Injected(RuntimeError):
    pass


def _inject_once(obj, name, when):
    """Make `obj.name` (an instance's method) raise once, at its first call for which `when()`."""
    original = getattr(obj, name)
    fired = []

    def broken(*args, **kwargs):
        if not fired and when():
            fired.append(1)
            raise Injected(f"injected into {name}")
        return original(*args, **kwargs)

    setattr(obj, name, broken)
    return fired


def _scenario(rank, group, scenario):
    """One run of both ranks over one stream; returns what the parent compares."""
    import torch
    import torch.distributed as dist

    from sglang_marconi.serving.faults import MarconiGroupFault

    kind, offset, seed, method, n = scenario
    config = MarconiServingConfig(**{**CONFIG.__dict__, "tune_workers": 1 if kind == "timing" else 0})
    cc, runtime = build_marconi_serving(config, kv_size=2500, mamba_size=8, group=group)
    if kind == "timing" and group.is_leader:
        wait_ready(runtime)
    position = {"i": -1}
    fired = []
    fault_at = SYNC_EVERY * (1 + seed % 3) + offset  # an offset into the 2nd to 4th interval
    if kind == "index" and rank == 1:
        fired = _inject_once(cc.cache.marconi.index, method, lambda: position["i"] >= fault_at)
    elif kind == "exporter" and rank == 0:  # the stats rank only has an exporter
        class RaisingExporter:
            def maybe_publish(self, figures_fn, idle=False):
                if position["i"] >= fault_at:
                    fired.append(1)
                    raise Injected("exporter")
                figures_fn()
        runtime.exporter = RaisingExporter()
    elif kind == "feed" and rank == 0:  # the leader only has a tuner
        fired = _inject_once(runtime.tuner, "observe", lambda: position["i"] >= fault_at)
    elif kind == "unrecoverable" and rank == 1:
        fired = _inject_once(cc.cache.components[MAMBA], "_marconi_admits", lambda: position["i"] >= fault_at)
    trees, error = [], None
    for i, tokens in enumerate(workload(n, seed)):
        position["i"] = i
        # A rank that raised takes its whole server down (SGLang stops every process when a
        # scheduler dies); here the other rank just stops at the same iteration.
        stopped = torch.tensor([int(error is not None)])
        dist.all_reduce(stopped, op=dist.ReduceOp.MAX)
        if stopped.item():
            break
        box = [runtime.channel.drain() if group.is_leader else None]  # this iteration's directives
        dist.broadcast_object_list(box, src=0)
        for directive in box[0]:
            runtime.channel.receive(directive)
        if kind == "timing" and rank == 1 and i % 10 == 3:
            time.sleep(0.05)  # rank 1 runs late
        try:
            run_request(cc, tokens, 6, out_tokens=outputs(i), chunk_end=chunk_end_for_branch)
        except MarconiGroupFault as exc:
            error = str(exc)
            continue
        trees.append(hash(tuple(tree_signature(cc.cache))))
    figures = runtime.metrics(cc.cache)
    result = dict(trees=trees, adoptions=list(runtime.adoptions), policy=figures["marconi_eviction_policy"],
                  tuning=runtime.tuning, recovered=runtime.faults.recovered_count, fired=len(fired),
                  rank_local=dict(runtime.faults.rank_local_failures), error=error, leader=group.is_leader,
                  has_tuner=runtime.tuner is not None, late=runtime.sync_waits_late)
    runtime.close()
    return result


def _rank(rank, init_file, scenarios, digest, queue):
    import torch.distributed as dist

    import sglang_cpu  # noqa: F401 - the CPU-cache environment (the Python tree core)

    from sglang_marconi.serving.lockstep import RankGroup

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = RankGroup([dist.group.WORLD])
        try:
            group.agree_on_settings(digest[rank])
            agreed = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            agreed = str(exc)
        results = [_scenario(rank, group, s) for s in scenarios] if agreed is None else []
        queue.put((rank, agreed, results))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, "crashed", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, scenarios, digest=("same", "same")):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init_file = tmp_path / "gloo-init"
    procs = [ctx.Process(target=_rank, args=(r, str(init_file), scenarios, digest, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, agreed, items = queue.get(timeout=600)
            assert agreed != "crashed", f"rank {rank} crashed:\n{items}"
            results[rank] = (agreed, items)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results[0], results[1]


def _identical_after_every_request(r0, r1):
    assert len(r0["trees"]) == len(r1["trees"]) > 0
    first = next((i for i, (a, b) in enumerate(zip(r0["trees"], r1["trees"])) if a != b), None)
    assert first is None, f"the ranks' trees differ from request {first} on"
    assert r0["adoptions"] == r1["adoptions"]


def test_two_ranks_keep_identical_trees_after_every_request_with_one_tuner(tmp_path):
    (_, (r0,)), (_, (r1,)) = _two_ranks(tmp_path, [("timing", 0, 0, None, 200)])
    assert r0["leader"] and r0["has_tuner"] and not r1["leader"] and not r1["has_tuner"]
    assert len(r0["adoptions"]) >= 1  # the tuner switched: the test proves something
    _identical_after_every_request(r0, r1)
    assert r0["trees"][-1] != r0["trees"][len(r0["trees"]) // 2]  # the trees did change


def test_faults_on_one_rank_at_every_offset_leave_the_trees_identical(tmp_path):
    """Rank 1's index fails once, at every offset of a sync interval (offset 1 is right after a
    sync point), for three seeds and three of the index's methods: it rebuilds from the tree and
    goes on deciding exactly what rank 0 decides; nothing falls back, tuning goes on."""
    methods = ("choose", "changed", "flush")
    scenarios = [("index", offset, seed, methods[(offset + seed) % 3], 100)
                 for seed in range(3) for offset in range(SYNC_EVERY)]
    (_, res0), (_, res1) = _two_ranks(tmp_path, scenarios)
    for scenario, r0, r1 in zip(scenarios, res0, res1):
        assert r1["fired"] == 1 and r1["recovered"] == 1, scenario  # the fault happened, on rank 1 only
        assert r0["recovered"] == 0
        _identical_after_every_request(r0, r1)
        assert r0["policy"] == r1["policy"] != "upstream" and r0["tuning"] and r1["tuning"]
    assert any(r["adoptions"] for r in res0)  # switches happened in these streams


def test_rank_local_failures_stop_only_their_feature(tmp_path):
    """A raising exporter on the stats rank stops its metrics; a raising tuner feed on the leader
    stops tuning on both ranks at the same point (the leader's directive). The trees stay
    identical and Marconi's eviction stays in force."""
    scenarios = [("exporter", 1, 0, None, 64), ("feed", 1, 1, None, 64)]
    (_, (e0, f0)), (_, (e1, f1)) = _two_ranks(tmp_path, scenarios)
    assert e0["fired"] >= 1 and "metrics" in e0["rank_local"] and not e1["rank_local"]
    _identical_after_every_request(e0, e1)
    assert e0["tuning"] and e1["tuning"] and e0["policy"] == e1["policy"] != "upstream"
    assert f0["fired"] == 1 and "tuning" in f0["rank_local"]
    _identical_after_every_request(f0, f1)
    assert not f0["tuning"] and not f1["tuning"]  # stopped on both, by the leader's directive
    assert f0["policy"] == f1["policy"] != "upstream"


def test_an_unrecoverable_fault_on_one_rank_stops_the_group_loudly(tmp_path):
    (_, (r0,)), (_, (r1,)) = _two_ranks(tmp_path, [("unrecoverable", 1, 0, None, 40)])
    assert r1["fired"] == 1 and r1["error"] is not None and "\n" not in r1["error"]
    assert "rank 1 of a 2-rank TP/PP group" in r1["error"] and "group stops here" in r1["error"]
    assert r1["policy"] != "upstream"  # it never went on alone with upstream's rules
    assert len(r1["trees"]) < 40 and len(r0["trees"]) == len(r1["trees"]) + 1  # stopped at that request


def test_ranks_given_different_settings_all_refuse_to_start(tmp_path):
    (a0, _), (a1, _) = _two_ranks(tmp_path, [], digest=("aaa", "bbb"))
    assert a0 is not None and a0 == a1 and "\n" not in a0
    assert "rank 0: aaa" in a0 and "rank 1: bbb" in a0

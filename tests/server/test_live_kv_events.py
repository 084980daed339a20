"""KV events that tell the truth, through a real SGLang server on this CPU: a `--dp-size 2` server
with the `marconi` backend and `--kv-events-config` (ZMQ on 127.0.0.1, one port per DP rank),
small pools so leaves are evicted and states tombstoned. A subscriber (`serving/kv_event_view.py`)
rebuilds each rank's reusable points from the stream alone; after every request they must equal
the tree's (`/server_info` -> `marconi_kv_events.reusable_points`, a whole-tree walk on the
scheduler, with SGLANG_MARCONI_KV_EVENTS_DEBUG=1), and the reuse the view predicts for each
request must be what the server then reports (`cached_tokens`)."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
import requests

pytest.importorskip("sglang")
pytest.importorskip("zmq")

from http_api import flush_cache  # noqa: E402

from sglang_marconi.serving.kv_event_view import KvEventSubscriber, KvEventView  # noqa: E402

REQUEST_TIMEOUT_S = 120
CONVERGE_S = 15  # the scheduler publishes when it goes idle; allow a loaded 2-core CI machine
MAX_NEW = 4
SERVER_ARGS = ("--dp-size", "2", "--max-total-tokens", "1400", "--max-mamba-cache-size", "10",
               "--chunked-prefill-size", "256", "--marconi-alpha", "1")


def two_free_ports() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (SGLang offsets rank r's publisher by r)."""
    from live_server import free_port

    for _ in range(50):
        port = free_port()
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.fixture(scope="module")
def events_server(tiny_model, tmp_path_factory):
    from live_server import start_server

    port = two_free_ports()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": ""}
    log = tmp_path_factory.mktemp("server-logs") / "kv-events-dp2.log"
    server = start_server(tiny_model("mamba2"), extra_args=(*SERVER_ARGS, "--kv-events-config", json.dumps(config)),
                          log_path=log, hard_limit_s=600, env={"SGLANG_MARCONI_KV_EVENTS_DEBUG": "1"})
    try:
        yield server, [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    finally:
        server.stop()


def tree_points(url: str) -> dict[int, dict[int, int]]:
    """dp rank -> {block_hash: num_tokens}: each replica's reusable points, from its tree."""
    r = requests.get(url + "/server_info", timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    out = {}
    for state in r.json()["internal_states"]:
        entry = state["marconi_kv_events"]
        assert entry.get("fault") is None, entry
        out[entry["dp_rank"]] = {h: n for h, n in entry["reusable_points"]}
    return out


def generate_on(url: str, input_ids: list[int], dp_rank: int) -> int:
    """Greedy generation on one replica; returns its cached_tokens."""
    r = requests.post(url + "/generate", timeout=REQUEST_TIMEOUT_S, json={
        "input_ids": input_ids, "routed_dp_rank": dp_rank,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    })
    r.raise_for_status()
    meta = r.json()["meta_info"]
    assert meta["dp_rank"] == dp_rank, meta
    return meta["cached_tokens"]


def workload(n: int, seed: int = 7):
    """(dp rank, prompt): multi-turn sessions pinned to a rank, and one-offs behind a shared system
    prompt, on both ranks; long enough to fill 1400 KV tokens and 10 Mamba slots per rank."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 500) for _ in range(120)]
    histories: dict[int, list[int] | None] = {}
    for i in range(n):
        if i % 3 != 2:
            sid = rng.randrange(4)
            history = histories.get(sid) or list(system)
            prompt = history + [rng.randrange(2, 500) for _ in range(rng.randrange(20, 80))]
            histories[sid] = prompt if len(prompt) < 450 else None
            yield sid % 2, prompt
        else:
            yield i % 2, system + [rng.randrange(2, 500) for _ in range(rng.randrange(40, 160))]


def converge(sub: KvEventSubscriber, view: KvEventView, url: str) -> dict:
    """Drain events until every rank's view equals its tree (or CONVERGE_S passes); the trees."""
    deadline = time.monotonic() + CONVERGE_S
    while True:
        sub.drain(view, quiet_s=0.2, max_s=CONVERGE_S)
        trees = tree_points(url)
        views = {rank: view.rank(rank).reusable_points() for rank in trees}
        if views == trees or time.monotonic() > deadline:
            return trees


JOIN_S = 120  # a loaded 2-core CI machine may take long to connect a subscription


def join(sub: KvEventSubscriber, view: KvEventView, url: str, ranks=(0, 1)) -> None:
    """Start both sides empty, with the subscription live: PUB/SUB drops whatever is published
    before a subscription reaches the publisher (start-up's /health_generate, and on a loaded
    machine more), so flush the cache until each rank's `AllBlocksCleared` arrives. From then on
    every event reaches the view. Fails only if no rank's flush arrives within JOIN_S."""
    deadline = time.monotonic() + JOIN_S
    while not all(view.rank(r).counts.get("AllBlocksCleared") for r in ranks):
        assert time.monotonic() < deadline, f"no AllBlocksCleared within {JOIN_S} s: {view.ranks}"
        flush_cache(url)
        sub.drain(view, quiet_s=0.5, max_s=5)


def test_view_from_zmq_events_equals_each_ranks_tree_after_every_request(events_server):
    server, endpoints = events_server
    view = KvEventView()
    with KvEventSubscriber(endpoints) as sub:
        join(sub, view, server.url)
        assert converge(sub, view, server.url) == {0: {}, 1: {}}
        mispredicted, hits = [], 0
        for i, (rank, prompt) in enumerate(workload(24)):
            predicted = view.rank(rank).reusable_prefix_length(prompt[:-1])  # SGLang matches at most len - 1
            cached = generate_on(server.url, prompt, rank)
            hits += cached
            if cached != predicted:
                mispredicted.append((i, rank, len(prompt), predicted, cached))
            trees = converge(sub, view, server.url)
            for r, points in trees.items():
                assert view.rank(r).reusable_points() == points, (
                    f"request {i}, rank {r}: view-only {sorted(set(view.rank(r).reusable_points().items()) - set(points.items()))}, "
                    f"tree-only {sorted(set(points.items()) - set(view.rank(r).reusable_points().items()))}")
            assert all(view.rank(r).gaps == 0 for r in trees)
    assert sorted(view.ranks) == [0, 1]
    for r in (0, 1):
        counts = view.rank(r).counts
        # Both replicas published, evicted KV and lost states on the way.
        assert counts.get("MarconiStateStored", 0) > 0 and counts.get("MarconiStateRemoved", 0) > 0, counts
        assert counts.get("BlockRemoved", 0) > 0, counts
    assert hits > 0 and not mispredicted, mispredicted

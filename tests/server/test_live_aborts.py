"""Exact reuse under aborted streams, through a real SGLang server on this CPU (the tiny gated-delta
hybrid), ours (`--radix-cache-backend marconi` through our launcher) and upstream's (SGLang's own
cache, `python -m sglang.launch_server`) under the same traffic:

- four multi-turn clients share a 300-token system prompt, run concurrently beside unrelated
  traffic that evicts (small KV and Mamba pools);
- two of them start with a streamed reply that they drop mid-stream (the client closes the
  connection; SGLang aborts the request, which leaves its KV and final state in the tree as a
  finished one does), then carry on with the reply's greedy continuation (known beforehand: the
  same input asked once, then `/flush_cache`), so their next turn matches the aborted request's
  whole path and reads the state it left at the point it was cut;
- afterwards every request that hit is replayed alone on an empty cache (`/flush_cache`).

Warm and cold are compared by `http_api.same_up_to_numeric_ties` at the gap measured for this
engine and model under this traffic on upstream's server (`BATCH_GAP`): 0, since SGLang's CPU
engine gives this model the same bits whatever the batch around a request and whether its KV and
states were written by a prefill or by decode steps, so every hit must be identical. A wrong state
(a state of another position, a slot freed while still in use) changes the output and fails.
Upstream's server is the control: the same comparison holds there.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytest.importorskip("sglang")
requests = pytest.importorskip("requests")

from http_api import flush_cache, generate, metric_samples, same_up_to_numeric_ties  # noqa: E402

FLAGS = ("--chunked-prefill-size", "128", "--max-total-tokens", "3000", "--max-mamba-cache-size", "10")
SYSTEM_LEN, CLIENTS, TURNS, REPLY = 300, 4, 2, 8
DROPPING = (0, 1)  # clients that start with a stream they drop
STREAM_MAX_NEW, STREAM_KEEP = 400, 3  # a stream long enough to be running when its abort lands
CONTINUATION = 64  # of a dropped stream's input, that its client's follow-up carries on with
# Twice the largest |warm - cold| logprob of this traffic on upstream's server: 0 (`numeric_gap.py
# --traffic aborts`, every request replayed: 20 requests, 12 of them hits; and every hit of this
# test on upstream's server, 2026-11-28).
BATCH_GAP = 0.0


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def dropped_stream(url: str, input_ids: list[int]) -> list[int]:
    """Stream a long greedy reply, close the connection after STREAM_KEEP chunks with output;
    returns the output tokens received."""
    received: list[int] = []
    chunks = 0
    with requests.post(url + "/generate", stream=True, timeout=300, json={
        "input_ids": list(input_ids), "stream": True,
        "sampling_params": {"max_new_tokens": STREAM_MAX_NEW, "temperature": 0, "ignore_eos": True},
    }) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            out = json.loads(line[len(b"data:"):])
            received = list(out["output_ids"])  # cumulative
            chunks += 1
            if chunks >= STREAM_KEEP and received:
                break  # leaving the `with` closes the connection mid-stream
    assert 0 < len(received) < STREAM_MAX_NEW, len(received)
    return received


def aborted_requests(url: str) -> float:
    return sum(s.value for s in metric_samples(url) if s.name == "sglang:num_aborted_requests_total")


def run_traffic(url: str):
    """The traffic above; returns every non-streamed generation, in completion order, and the
    number of streams dropped."""
    system = tokens(1, SYSTEM_LEN)
    done, lock, errors = [], threading.Lock(), []

    def record(g):
        with lock:
            done.append(g)

    def first_input(c: int) -> list[int]:
        return system + tokens(100 + c, 20)

    # Greedy decoding is deterministic: a dropping client's follow-up can carry on with what the
    # aborted stream went on to generate after the client left (asked once, before the traffic),
    # so it matches the aborted request's whole inserted path and reads the final state it left.
    continuation = {c: generate(url, first_input(c), max_new_tokens=CONTINUATION).output_ids for c in DROPPING}
    flush_cache(url)
    before = aborted_requests(url)
    all_dropped = threading.Barrier(len(DROPPING))

    def client(c: int):
        try:
            history = first_input(c)
            if c in DROPPING:
                dropped_stream(url, history)
                all_dropped.wait(120)
                deadline = time.monotonic() + 60  # counted once SGLang has released the request
                while aborted_requests(url) - before < len(DROPPING) and time.monotonic() < deadline:
                    time.sleep(0.2)
                history = history + continuation[c] + tokens(300 + c, 15)
            for turn in range(TURNS):
                g = generate(url, history, max_new_tokens=REPLY)
                record(g)
                history = history + g.output_ids + tokens(200 + 10 * c + turn, 15)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def evictor():
        try:
            for i in range(4):
                record(generate(url, tokens(5000 + i, 250), max_new_tokens=4))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    threads.append(threading.Thread(target=evictor))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return done, aborted_requests(url) - before


def replay_cold(url: str, generations):
    """(warm, cold) for every generation, each cold one alone on an empty cache."""
    pairs = []
    for g in generations:
        flush_cache(url)
        cold = generate(url, g.input_ids, max_new_tokens=len(g.output_ids))
        assert cold.cached_tokens == 0
        pairs.append((g, cold))
    return pairs


def check(url: str, label: str):
    done, dropped = run_traffic(url)
    assert dropped == len(DROPPING), f"{label}: {dropped} streams aborted, expected {len(DROPPING)}"
    hits = [g for g in done if g.cached_tokens > 0]
    assert len(hits) >= 2, f"{label}: {[g.cached_tokens for g in done]}"
    assert any(g.cached_tokens > SYSTEM_LEN + 20 for g in hits), f"{label}: no hit beyond the system prompt"
    # How far the hits reached (a follow-up of a dropped stream past SYSTEM_LEN + 20 + STREAM_KEEP
    # read KV its aborted request decoded); printed for the record, not a guarantee (eviction).
    print(f"{label}: hits {sorted(g.cached_tokens for g in hits)}")
    failures = []
    for warm, cold in replay_cold(url, hits):
        result = same_up_to_numeric_ties(warm, cold, BATCH_GAP)
        if not result:
            failures.append(f"hit of {warm.cached_tokens} of {len(warm.input_ids)} tokens: {result.detail}")
    assert not failures, f"{label}: " + "; ".join(failures)
    # The comparison can fail: different conversations gave different replies.
    assert len({tuple(g.output_ids) for g in done}) > len(done) // 2
    return done


def test_hits_after_dropped_streams_equal_cold_on_ours_and_upstream(tiny_model, tmp_path):
    """Ours and upstream's serve the same traffic side by side: the two servers share nothing, and
    each comparison is between requests of one server (`BATCH_GAP`: the bits do not depend on the
    load around a request)."""
    import concurrent.futures

    from live_server import start_server

    model = tiny_model("gated-delta")
    launchers = {"marconi": "marconi", "upstream": "sglang"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = {label: pool.submit(start_server, model, launcher=launcher, extra_args=FLAGS,
                                      log_path=tmp_path / f"{label}.log")
                   for label, launcher in launchers.items()}
        try:
            servers = {label: future.result() for label, future in started.items()}
            checks = [pool.submit(check, server.url, label) for label, server in servers.items()]
            for future in checks:
                future.result()
        finally:
            concurrent.futures.wait(started.values())
            for future in started.values():
                if future.exception() is None:
                    future.result().stop()

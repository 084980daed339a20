"""The shared-memory ring that feeds the shadow tuner: records come out whole and in order across
wrap-arounds, a full ring refuses a record instead of blocking, and a child process reads it."""

import multiprocessing

import numpy as np

from sglang_marconi.serving.shared_ring import SharedRing

CTX = multiprocessing.get_context("spawn")


def records(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes() for _ in range(n)]


def test_records_round_trip_in_order_across_wraparounds():
    ring = SharedRing(CTX, 2048)
    out, pending = [], []
    for rec in records(500):
        assert ring.put((rec[:3], rec[3:]))  # parts are concatenated
        pending.append(rec)
        if len(pending) == 2:  # consume with a lag, so the producer wraps around a busy ring
            out.append(ring.get())
            pending.pop(0)
    while (rec := ring.get()) is not None:
        out.append(rec)
    assert out == records(500) and ring.tail.value == ring.head.value > 20 * 2048


def test_a_full_ring_refuses_and_recovers():
    ring = SharedRing(CTX, 1024)
    accepted = 0
    while ring.put((b"x" * 100,)):
        accepted += 1
    assert 0 < accepted < 1024 // 100
    assert not ring.put((b"x" * 600,))  # more than half the ring never fits
    assert ring.get() == b"x" * 100
    assert ring.put((b"y" * 100,))


def _read_all(ring, out):
    got = []
    while True:
        rec = ring.get()
        if rec is None:
            continue
        if rec == b"end":
            break
        got.append(rec)
    out.send(got)


def test_a_child_process_reads_what_the_parent_puts():
    ring = SharedRing(CTX, 4096)
    recv, send = CTX.Pipe(duplex=False)
    child = CTX.Process(target=_read_all, args=(ring, send), daemon=True)
    child.start()
    sent = []
    for rec in records(300, seed=1) + [b"end"]:
        while not ring.put((rec,)):  # the child keeps up: the ring frees as it reads
            pass
        sent.append(rec)
    assert recv.poll(60) and recv.recv() == sent[:-1]
    child.join(10)

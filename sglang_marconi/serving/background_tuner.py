"""The shadow tuner (`policy/tuning/shadow_tuner.py`) off the scheduler thread: a child process fed
through a shared-memory ring, whose decisions take effect at fixed points of the request stream.

- Channel: a byte ring in shared memory (`shared_ring.py`): the scheduler copies each sampled
  request's (`shadow_tuner.tuner_reads`) token buffers into it (a few microseconds: no system call,
  no lock, no helper thread to contend for the GIL). Requests are handed over 16 at a time, and a
  partial batch as soon as the scheduler goes idle (`flush_idle`) or its oldest request has waited
  `_HANDOVER_S`.
- Sync points: the child records its choice *as of* every `sync_every`-th request of the stream
  (`choice_at(k)`: after exactly `k * sync_every` requests). The runtime asks for `choice_at(k - 1)`
  at release `k * sync_every` (`shadow_tuner.record_adopted_at`), so while the child keeps within
  one interval of the scheduler, which choice is in force at every point of the stream is a function
  of the requests alone (two runs fed the same stream switch at the same requests). The scheduler
  never waits for the child longer than `wait_s` there (a late verdict is None: the runtime keeps
  its choice and asks again at the next sync point), and a full ring waits at most `put_wait_s`
  before the request is dropped from the shadows' sample (counted): the batch path never waits on
  the child unboundedly.
- Child: polls the ring (every 2 ms while requests come, every 50 ms when idle), runs the shadow
  caches at the lowest CPU priority (nice 19), and writes back through shared memory (`RawArray`,
  read without a lock): its current choice, requests read and observed, each candidate's score and
  the table of choices at sync points.
- Failure: a child that has exited, or that has left the oldest request it was handed unread for
  `stall_s` (idle periods never count: nothing is waiting then), is given up with one warning;
  the runtime then stops tuning on every rank at the next sync point and keeps its choice.

Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import struct
import sys
import time
import types
import weakref
from array import array

import numpy as np

from sglang_marconi.policy.tuning.shadow_tuner import Choice, ShadowTuner, SyncRecorder, TunerLog, choice_label, tuner_reads
from sglang_marconi.policy.tuning.tuner_spec import TunerSpec
from sglang_marconi.serving.shared_ring import SharedRing, fence

log = logging.getLogger("sglang_marconi")

_META = struct.Struct("<IIQQ")  # requests since the previous record, key bytes, input tokens, output tokens
_MARKER = (1 << 64) - 1  # input-token count of a record that only advances the request count
# Shared state slots; then one score per choice, then the sync table.
_CHOICE, _OBSERVED, _READY, _CLOSED, _SYNCED, _SCORES = range(6)
_SYNC_SLOTS = 256  # choices at the latest sync points (the scheduler is never more than one behind)
RING_BYTES = 64 << 20  # ~8M tokens of requests in flight to the tuner
_CHECK_EVERY_S = 1.0  # how often the scheduler side checks the child's health
_BATCH = 16  # finished requests handed to the child at once
_HANDOVER_S = 1.0  # a partial batch waits at most this long (checked at each release and when idle)
_WAIT_S = 0.0005  # sleep between looks while the scheduler waits for the child
_POLL_S, _IDLE_POLL_S, _IDLE_S = 0.002, 0.05, 0.5
_NICE = 19


class BackgroundShadowTuner:
    """Scheduler side: `observe` each finished request (never blocks but for backpressure),
    `mark_sync()` at each sync point, `choice_at(k)` for the decision to adopt there. `close()`
    stops the child and returns its log (None if it failed)."""

    def __init__(self, spec: TunerSpec, *, stall_s: float = 60.0, sync_every: int = 32, put_wait_s: float = 0.05):
        self.config = config = spec.config
        self.choices = spec.choices
        self.current: Choice = spec.start
        self.stall_s = stall_s
        self.put_wait_s = put_wait_s
        self.sync_every = sync_every
        self.fed = self.dropped = 0  # dropped: too large for the ring, or the ring stayed full put_wait_s
        self.failed: str | None = None  # why the child was given up, if it was
        self._closed = False  # nothing more is sent once the ring is closed
        self._since_sent = 0  # requests counted but not yet sent (not sampled, or batched)
        self._batch: list = []
        self._batch_since = 0.0  # when the oldest request of the batch was released
        self._pending: collections.deque = collections.deque()  # (requests sent in total, when sent)
        self._sent = 0  # requests accounted for in the ring (sampled or not)
        ctx = multiprocessing.get_context("spawn")
        self._ring = SharedRing(ctx, RING_BYTES)
        self._state = ctx.RawArray("d", _SCORES + len(self.choices) + _SYNC_SLOTS)
        self._table = _SCORES + len(self.choices)
        self._state[_CHOICE] = self.choices.index(self.current)
        self._state[_SYNCED] = -1.0
        self._result_recv, result_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_shadow_tuner, name="marconi-shadow-tuner", daemon=True,
            args=(self._ring, result_send, self._state, os.getpid(), spec, sync_every),
        )
        _start_without_main(self._proc)
        result_send.close()
        # The shared memory must outlive the child: were this object dropped without close(), its
        # blocks would go back to multiprocessing's heap and be handed to the next tuner while this
        # child still wrote into them. The finalizer keeps them until the child is gone.
        weakref.finalize(self, _reap_child, os.getpid(), self._proc, self._state, self._ring)
        self._next_check = time.monotonic() + _CHECK_EVERY_S

    # -- scheduler thread ----------------------------------------------------------------------
    def observe(self, session_key: str, input_ids, output_ids) -> None:
        """One finished request, handed over in batches of `_BATCH` (or when the oldest has waited
        `_HANDOVER_S`)."""
        batch = self._batch
        if not batch:
            self._batch_since = time.monotonic()
        batch.append((session_key, input_ids, output_ids))
        if len(batch) >= _BATCH or time.monotonic() - self._batch_since >= _HANDOVER_S:
            self._flush()

    def flush_idle(self) -> None:
        """The scheduler is idle: hand over what is batched, and look at the child's health."""
        self._flush()
        self._maybe_check_health()

    def mark_sync(self) -> None:
        """A sync point of the stream: everything released so far goes to the child, with a marker
        so that it counts requests up to exactly here even if none of them was sampled."""
        self._flush()
        if self._since_sent and not self._closed and self._put(_META.pack(self._since_sent, 0, _MARKER, 0), b"", b""):
            self._since_sent = 0  # (a full ring: counted with the next record that gets in)

    def choice_at(self, k: int, wait_s: float | None = None) -> Choice | None:
        """The child's choice as of request `k * sync_every`, waiting at most `wait_s` (None: until
        it gets there or fails) for the child to get there; None if it did not in time or failed
        (`failed` says which)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while self.failed is None:
            if self._state[_SYNCED] >= k:
                fence()
                index = int(self._state[self._table + k % _SYNC_SLOTS])
                self.current = self.choices[index]
                return self.current
            now = time.monotonic()
            self._check_health(now)
            if deadline is not None and now >= deadline:
                return None
            time.sleep(_WAIT_S)
        return None

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        if self._closed:
            return
        for session_key, input_ids, output_ids in batch:
            self._since_sent += 1
            if not tuner_reads(self.config, session_key):
                continue
            key = session_key.encode("utf-8", "backslashreplace")  # a client's rid need not be valid UTF-8
            inp, out = _int64_buffer(input_ids), _int64_buffer(output_ids)
            record = (_META.pack(self._since_sent, len(key), len(inp) // 8, len(out) // 8) + key, inp, out)
            if self._put(*record):
                self.fed += 1
                self._since_sent = 0
            elif not self._closed:  # larger than the ring can ever hold: counted with the next record
                self.dropped += 1
        self._maybe_check_health()

    def _put(self, head: bytes, inp, out) -> bool:
        """Append one record, waiting at most `put_wait_s` while the ring is full. False if it can
        never fit, did not fit in time, or the child failed (the request is then counted with the
        next record, outside the shadows' sample)."""
        since = _META.unpack_from(head)[0]
        deadline = time.monotonic() + self.put_wait_s
        while not self._ring.put((head, inp, out)):
            now = time.monotonic()
            if not self._ring.fits(len(head) + len(inp) + len(out)) or self._closed or now >= deadline:
                return False
            self._check_health(now)
            time.sleep(_WAIT_S)
        self._sent += since
        self._pending.append((self._sent, time.monotonic()))
        return True

    def _maybe_check_health(self) -> None:
        now = time.monotonic()
        if now >= self._next_check:  # at most once a second
            self._next_check = now + _CHECK_EVERY_S
            self._check_health(now)

    def _check_health(self, now: float) -> None:
        if self._closed:
            return
        code = self._proc.exitcode
        if code is not None:
            return self._give_up(f"the shadow tuner process exited (code {code})")
        read = self._state[_OBSERVED]
        pending = self._pending
        while pending and pending[0][0] <= read:
            pending.popleft()
        if pending and now - pending[0][1] > self.stall_s:  # the oldest unread request's wait
            self._give_up(f"the shadow tuner left a request unread for {self.stall_s:g} s")

    def _give_up(self, why: str) -> None:
        self.failed = why
        log.warning("Marconi tuning stopped: %s; keeping eviction choice %s", why, choice_label(self.current))
        self._close_ring()

    # -- figures -------------------------------------------------------------------------------
    @property
    def observed(self) -> int:
        return int(self._state[_OBSERVED])

    @property
    def ready(self) -> bool:
        return bool(self._state[_READY])

    @property
    def leading(self) -> Choice:
        """The child's current choice (not yet in force: that waits for a sync point)."""
        return self.choices[int(self._state[_CHOICE])]

    def scores(self) -> dict[str, float]:
        return {choice_label(c): float(self._state[_SCORES + i]) for i, c in enumerate(self.choices)}

    def stop(self) -> None:
        """Stop feeding; the child finishes what it has and exits. Never waits."""
        self._flush()
        self._close_ring()

    def _close_ring(self) -> None:
        self._closed = True
        fence()  # the last record is published before the close is
        self._state[_CLOSED] = 1.0

    def close(self, timeout: float = 30.0) -> TunerLog | None:
        """Stop the child after it has observed what was sent; its log, or None if it failed."""
        self.mark_sync() if self.failed is None else None
        self._close_ring()  # end of stream: the child observes what it has, then reports
        result = None
        if self._result_recv.poll(timeout if self.failed is None else 0):
            try:
                result = self._result_recv.recv()
            except (EOFError, OSError):
                result = None
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self.failed is None and result is None:
            self._give_up("the shadow tuner process did not report at shutdown")
        return result


def _reap_child(owner_pid, proc, state, ring) -> None:
    """Stop a child whose tuner object was dropped (`ring` is only held until then)."""
    if os.getpid() != owner_pid:  # a forked copy of the owner: the child is not ours to stop
        return
    state[_CLOSED] = 1.0
    if proc.is_alive():
        proc.terminate()
    proc.join(timeout=5)


def _start_without_main(proc) -> None:
    """Start `proc` (spawn) without re-importing the parent's `__main__` in it: the child needs only
    the policy core, and a scheduler's main module (a launcher) would pull SGLang and torch in."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        proc.start()
    finally:
        sys.modules["__main__"] = main


def _int64_buffer(tokens) -> memoryview:
    """The tokens as a flat byte view of int64 (no copy for SGLang's array('q') or an int64 array)."""
    if isinstance(tokens, np.ndarray):
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    elif not (isinstance(tokens, array) and tokens.typecode == "q"):
        tokens = array("q", tokens)
    return memoryview(tokens).cast("B")


# -- the child process ----------------------------------------------------------------------------

def run_shadow_tuner(ring: SharedRing, result_send, state, parent_pid, spec: TunerSpec, sync_every: int) -> None:
    """Observe requests from `ring` until the parent closes it (or exits); publish the choice,
    scores and sync table in `state`; send the final `TunerLog` on `result_send`."""
    _yield_to_the_scheduler()
    tuner = spec.build()
    config = spec.config
    table = _SCORES + len(tuner.choices)

    def record(k: int, index: int) -> None:
        state[table + k % _SYNC_SLOTS] = index
        fence()
        state[_SYNCED] = k

    recorder = SyncRecorder(tuner, sync_every, record)
    recorder.advance(0)
    state[_READY] = 1.0
    scores_at = -1
    idle_since = time.monotonic()
    while True:
        payload = ring.get()
        if payload is None:
            if state[_CLOSED]:  # closed after its last record: drain, then stop
                fence()
                payload = ring.get()
                if payload is None:
                    break
            elif os.getppid() != parent_pid:
                break
            else:
                time.sleep(_POLL_S if time.monotonic() - idle_since < _IDLE_S else _IDLE_POLL_S)
                continue
        idle_since = time.monotonic()
        _observe(tuner, recorder, memoryview(payload))
        state[_CHOICE] = tuner.choices.index(tuner.current)
        state[_OBSERVED] = tuner.log.requests
        if tuner.log.sampled - scores_at >= config.epoch:  # scores change slowly: publish per epoch
            scores_at = tuner.log.sampled
            for i, s in enumerate(tuner.scores):
                state[_SCORES + i] = s
    for i, s in enumerate(tuner.scores):
        state[_SCORES + i] = s
    result_send.send(tuner.log)
    result_send.close()


def _yield_to_the_scheduler() -> None:
    """The lowest nice level: the tuner runs on cores the serving engine leaves free (most of a GPU
    host's), and gives way where the engine needs them all (a CPU engine's forward passes): at
    nice 5 it took back most of the TTFT that the extra hits saved on a 2-core CPU server
    (docs/benchmarks.md). When it falls a whole sync interval behind, the scheduler waits for it."""
    try:
        os.nice(_NICE)
    except OSError:
        pass


def _observe(tuner: ShadowTuner, recorder: SyncRecorder, payload: memoryview) -> None:
    since, key_len, n_in, n_out = _META.unpack_from(payload)
    if n_in == _MARKER:  # requests that were not sent (not sampled, or batched before a sync point)
        tuner.log.requests += since
        recorder.advance(tuner.log.requests)
        return
    start = _META.size
    key = bytes(payload[start:start + key_len]).decode("utf-8", "replace")
    start += key_len
    tokens = np.frombuffer(payload[start:start + 8 * (n_in + n_out)], dtype=np.int64).copy()
    tuner.log.requests += since - 1  # requests the scheduler did not send (not sampled, or too large)
    recorder.advance(tuner.log.requests)  # sync points among them: the choice before this request
    if n_in == 0:
        tuner.log.requests += 1
    else:
        tuner.observe(key, tokens[:n_in], tokens[n_in:n_in + n_out])
    recorder.advance(tuner.log.requests)

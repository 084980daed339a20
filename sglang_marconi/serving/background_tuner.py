"""The shadow tuner (`policy/shadow_tuner.py`) off the scheduler thread: a child process fed
through a bounded channel that never blocks, so the scheduler never waits on tuning.

- Channel: a byte ring in shared memory (`shared_ring.py`): the scheduler copies each sampled
  request's token buffers into it (a few microseconds: no system call, no lock, no helper thread
  to contend for the GIL); when the ring is full the request is dropped and counted.
- Child: polls the ring (every 2 ms while requests come, every 50 ms when idle), runs the shadow
  caches at the lowest CPU priority (nice 19), and writes back through shared memory (`RawArray`,
  read without a lock): the current choice, requests observed (a heartbeat), each candidate's score.
- Failure: a child that has exited, or that observed nothing for `stall_s` while requests were
  waiting, is given up with one warning; the cache keeps its current choice.

Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

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

from sglang_marconi.policy.sampling import session_in_sample
from sglang_marconi.policy.shadow_tuner import Choice, ShadowConfig, ShadowTuner, TunerLog, choice_label
from sglang_marconi.serving.shared_ring import SharedRing, fence

log = logging.getLogger("sglang_marconi")

_META = struct.Struct("<IIQQ")  # requests since the previous record, key bytes, input tokens, output tokens
_CHOICE, _OBSERVED, _READY, _CLOSED, _SCORES = range(5)  # shared state slots; scores from _SCORES on
RING_BYTES = 64 << 20  # ~8M tokens of requests in flight to the tuner
_CHECK_EVERY_S = 1.0  # how often the scheduler side checks the child's health
_BATCH = 16  # finished requests handed to the child at once
_POLL_S, _IDLE_POLL_S, _IDLE_S = 0.002, 0.05, 0.5
_NICE = 19


class BackgroundShadowTuner:
    """Scheduler side: `observe` each finished request (never blocks; returns a new choice when
    the child has adopted one). `close()` stops the child and returns its log (None if it failed)."""

    def __init__(self, profile, capacity_bytes: int, config: ShadowConfig, *, state_slots: int | None = None,
                 checkpoint_grid: int = 1, page_size: int = 1, stall_s: float = 60.0):
        self.config = config
        self.choices = config.choices
        self.current: Choice = config.start
        self.stall_s = stall_s
        self.fed = self.dropped = 0
        self.failed: str | None = None  # why the child was given up, if it was
        self._closed = False  # nothing more is sent once the ring is closed
        self._since_sent = 0
        self._batch: list = []
        ctx = multiprocessing.get_context("spawn")
        self._ring = SharedRing(ctx, RING_BYTES)
        self._state = ctx.RawArray("d", _SCORES + len(self.choices))
        self._index = self.choices.index(self.current)
        self._state[_CHOICE] = self._index
        self._result_recv, result_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_shadow_tuner, name="marconi-shadow-tuner", daemon=True,
            args=(self._ring, result_send, self._state, os.getpid(), profile, capacity_bytes, state_slots, config,
                  checkpoint_grid, page_size),
        )
        _start_without_main(self._proc)
        result_send.close()
        # The shared memory must outlive the child: were this object dropped without close(), its
        # blocks would go back to multiprocessing's heap and be handed to the next tuner while this
        # child still wrote into them. The finalizer keeps them until the child is gone.
        weakref.finalize(self, _reap_child, os.getpid(), self._proc, self._state, self._ring)
        self._observed_at = (0.0, time.monotonic())  # (observed count, when it last changed)
        self._next_check = time.monotonic() + _CHECK_EVERY_S

    # -- scheduler thread ----------------------------------------------------------------------
    def observe(self, session_key: str, input_ids, output_ids) -> Choice | None:
        """One finished request. Requests are handed to the child in batches of `_BATCH` (a hot loop
        costs the scheduler a fraction of one call per request); the child's choice is read every
        time (one shared-memory read): returns it if it changed, else None."""
        batch = self._batch
        batch.append((session_key, input_ids, output_ids))
        if len(batch) >= _BATCH:
            self._flush()
        return self.poll()

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        if self._closed:
            return
        rate, ring = self.config.sample_rate, self._ring
        for session_key, input_ids, output_ids in batch:
            self._since_sent += 1
            if rate < 1 and not session_in_sample(session_key, rate):
                continue
            key = session_key.encode()
            inp, out = _int64_buffer(input_ids), _int64_buffer(output_ids)
            if ring.put((_META.pack(self._since_sent, len(key), len(inp) // 8, len(out) // 8) + key, inp, out)):
                self.fed += 1
                self._since_sent = 0
            else:
                self.dropped += 1
        now = time.monotonic()
        if now >= self._next_check:  # the child's health, checked at most once a second
            self._next_check = now + _CHECK_EVERY_S
            self._check_health(now)

    def poll(self) -> Choice | None:
        """The child's current choice if it changed since the last poll, else None."""
        if self._closed:
            return None
        index = int(self._state[_CHOICE])
        if index == self._index:
            return None
        self._index = index
        self.current = self.choices[index]
        return self.current

    def _check_health(self, now: float) -> None:
        code = self._proc.exitcode
        if code is not None:
            return self._give_up(f"the shadow tuner process exited (code {code})")
        observed = self._state[_OBSERVED]
        if observed != self._observed_at[0]:
            self._observed_at = (observed, now)
        elif self.fed > observed and now - self._observed_at[1] > self.stall_s:
            self._give_up(f"the shadow tuner observed nothing for {self.stall_s:g} s with requests waiting")

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
        self._flush()
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

def run_shadow_tuner(ring: SharedRing, result_send, state, parent_pid, profile, capacity_bytes, state_slots, config,
                     checkpoint_grid, page_size) -> None:
    """Observe requests from `ring` until the parent closes it (or exits); publish the choice and
    scores in `state`; send the final `TunerLog` on `result_send`."""
    _yield_to_the_scheduler()
    tuner = ShadowTuner(profile, capacity_bytes, config, checkpoint_grid=checkpoint_grid, page_size=page_size,
                        state_slots=state_slots)
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
        _observe(tuner, memoryview(payload))
        state[_OBSERVED] = tuner.log.requests
        state[_CHOICE] = tuner.choices.index(tuner.current)
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
    (docs/benchmarks.md). Decisions come later there, never the scheduler."""
    try:
        os.nice(_NICE)
    except OSError:
        pass


def _observe(tuner: ShadowTuner, payload: memoryview) -> None:
    since, key_len, n_in, n_out = _META.unpack_from(payload)
    start = _META.size
    key = bytes(payload[start:start + key_len]).decode()
    start += key_len
    tokens = np.frombuffer(payload[start:start + 8 * (n_in + n_out)], dtype=np.int64).copy()
    tuner.log.requests += since - 1  # requests the scheduler did not send (not sampled, or dropped)
    if n_in == 0:
        tuner.log.requests += 1
        return
    tuner.observe(key, tokens[:n_in], tokens[n_in:n_in + n_out])

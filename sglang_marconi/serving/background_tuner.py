"""The shadow tuner (`policy/shadow_tuner.py`) off the scheduler thread: a child process fed
through a bounded, non-blocking channel, so the scheduler never waits on tuning.

- Channel: a Unix SEQPACKET socket pair (message boundaries kept, ordered). The scheduler sends
  each sampled request with one non-blocking `sendmsg` of the token buffers themselves (no
  copies in Python, no feeder thread to contend for the GIL); when the socket's buffer is full
  the request is dropped and counted. Requests longer than a part are split into parts; a part
  that does not fit drops the rest and the child discards the incomplete message.
- Back channel: shared memory (`RawArray`) the child writes and the scheduler reads without a
  lock: the current choice, requests observed (a heartbeat), each candidate's score.
- Failure: a child that has exited, or that observed nothing for `stall_s` while requests were
  waiting, is given up with one warning; the cache keeps its current choice.

Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import struct
import sys
import time
import types
from array import array

import numpy as np

from sglang_marconi.policy.sampling import session_in_sample
from sglang_marconi.policy.shadow_tuner import Choice, ShadowConfig, ShadowTuner, TunerLog, choice_label

log = logging.getLogger("sglang_marconi")

_PART = struct.Struct("<QII")  # message id, part index, number of parts
_META = struct.Struct("<IIQQ")  # requests since the previous message, key bytes, input tokens, output tokens
_CHOICE, _OBSERVED, _READY, _SCORES = 0, 1, 2, 3  # shared state slots; scores from _SCORES on
_SOCKET_BUFFER = 8 << 20  # asked for; the kernel may grant less (net.core.wmem_max)
_CHECK_EVERY_S = 1.0  # how often the scheduler side checks the child's health


class BackgroundShadowTuner:
    """Scheduler side. `feed` after each finished request, `poll` for a new choice; neither
    blocks. `close()` stops the child and returns its log (or None if it had failed)."""

    def __init__(self, profile, capacity_bytes: int, config: ShadowConfig, *, state_slots: int | None = None,
                 checkpoint_grid: int = 1, page_size: int = 1, stall_s: float = 60.0):
        self.config = config
        self.choices = config.choices
        self.current: Choice = config.start
        self.stall_s = stall_s
        self.fed = self.dropped = 0
        self.failed: str | None = None  # why the child was given up, if it was
        self._since_sent = 0
        self._next_id = 0
        ctx = multiprocessing.get_context("spawn")
        family = getattr(socket, "SOCK_SEQPACKET", socket.SOCK_DGRAM)
        self._sock, child_sock = socket.socketpair(socket.AF_UNIX, family)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        self._sock.setblocking(False)
        # A message must fit the send buffer whole; the kernel's own overhead per message is small.
        self._part_bytes = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
        self._state = ctx.RawArray("d", _SCORES + len(self.choices))
        self._state[_CHOICE] = self.choices.index(self.current)
        self._result_recv, result_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_shadow_tuner, name="marconi-shadow-tuner", daemon=True,
            args=(child_sock, result_send, self._state, profile, capacity_bytes, state_slots, config,
                  checkpoint_grid, page_size, self._part_bytes),
        )
        _start_without_main(self._proc)
        child_sock.close()
        result_send.close()
        self._observed_at = (0.0, time.monotonic())  # (observed count, when it last changed)
        self._next_check = time.monotonic() + _CHECK_EVERY_S

    # -- scheduler thread ----------------------------------------------------------------------
    def feed(self, session_key: str, input_ids, output_ids) -> None:
        """Queue one finished request for the shadows (dropped, and counted, if the channel is full)."""
        self._since_sent += 1
        if self.failed is not None or not session_in_sample(session_key, self.config.sample_rate):
            return
        key = session_key.encode()
        inp, out = _int64_buffer(input_ids), _int64_buffer(output_ids)
        meta = _META.pack(self._since_sent, len(key), len(inp) // 8, len(out) // 8)
        size = len(meta) + len(key) + len(inp) + len(out)
        msg_id = self._next_id
        self._next_id += 1
        try:
            if size <= self._part_bytes:
                self._sock.sendmsg([_PART.pack(msg_id, 0, 1), meta, key, inp, out])
            else:  # long requests travel in parts (rare: hundreds of thousands of tokens)
                payload = b"".join((meta, key, inp, out))
                parts = range(0, size, self._part_bytes)
                for i, start in enumerate(parts):
                    self._sock.sendmsg([_PART.pack(msg_id, i, len(parts)), payload[start:start + self._part_bytes]])
        except (BlockingIOError, OSError):
            self.dropped += 1
            return
        self.fed += 1
        self._since_sent = 0

    def poll(self) -> Choice | None:
        """The child's current choice if it changed since the last poll, else None."""
        if self.failed is not None:
            return None
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _CHECK_EVERY_S
            self._check_health(now)
            if self.failed is not None:
                return None
        choice = self.choices[int(self._state[_CHOICE])]
        if choice == self.current:
            return None
        self.current = choice
        return choice

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
        self._sock.close()

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
        self._sock.close()

    def close(self, timeout: float = 30.0) -> TunerLog | None:
        """Stop the child after it has observed what was sent; its log, or None if it failed."""
        if self.failed is None:
            self._sock.close()  # end of stream: the child finishes what it has and reports
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

def run_shadow_tuner(sock, result_send, state, profile, capacity_bytes, state_slots, config, checkpoint_grid,
                     page_size, part_bytes) -> None:
    """Observe requests from `sock` until it closes; publish the choice and scores in `state`;
    send the final `TunerLog` on `result_send`."""
    tuner = ShadowTuner(profile, capacity_bytes, config, checkpoint_grid=checkpoint_grid, page_size=page_size,
                        state_slots=state_slots)
    buf = bytearray(part_bytes + _PART.size + 64)
    pending: tuple[int, int, list[bytes]] | None = None  # (message id, parts expected, parts so far)
    state[_READY] = 1.0
    scores_at = -1
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            break
        msg_id, part, nparts = _PART.unpack_from(buf)
        if nparts == 1:
            payload = memoryview(buf)[_PART.size:n]
            pending = None
        else:
            if part == 0:
                pending = (msg_id, nparts, [])
            if pending is None or pending[0] != msg_id or len(pending[2]) != part:
                pending = None  # a part was dropped: discard the message
                continue
            pending[2].append(bytes(buf[_PART.size:n]))
            if len(pending[2]) < nparts:
                continue
            payload = memoryview(b"".join(pending[2]))
            pending = None
        _observe(tuner, payload)
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
    # SGLang caches input + output[:-1]: the last decoded token was never fed back, so it has no KV.
    tuner.observe(key, tokens[:n_in], tokens[n_in:n_in + max(0, n_out - 1)])

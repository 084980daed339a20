"""A single-producer, single-consumer byte ring in shared memory: the scheduler thread puts
records with plain memory copies (no system call, no lock it could wait on, no helper thread to
contend for the GIL) and a full ring refuses the record instead of blocking.

Layout: records of [u64 sequence][u64 length][payload][u64 sequence], 16-byte aligned; a record
of length 0 means "continue at the start of the ring". `head` (bytes ever written) is written by
the producer only, `tail` (bytes ever consumed) by the consumer only, each one aligned 8-byte
store. Ordering: `fence()` sits between the payload and the `head` that publishes it (producer),
between reading `head` and reading the payload, and between reading a payload and the `tail`
that frees it (consumer). x86 keeps loads and stores in program order, so there it is a no-op;
on weakly ordered CPUs it is two lock round trips, whose acquire/release atomics order what comes
before them before what comes after. The trailing sequence number is checked as a last guard.
"""

from __future__ import annotations

import platform
import struct
import threading

_RECORD = struct.Struct("<QQ")  # sequence, payload length
_TRAILER = struct.Struct("<Q")
_ALIGN = 16
_fence_lock = threading.Lock()


def _lock_fence() -> None:
    for _ in range(2):
        _fence_lock.acquire()
        _fence_lock.release()


def _no_fence() -> None:
    pass


fence = _no_fence if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else _lock_fence


def _record_bytes(payload_len: int) -> int:
    n = _RECORD.size + payload_len + _TRAILER.size
    return -(-n // _ALIGN) * _ALIGN


class SharedRing:
    """Create with `SharedRing(ctx, size)` in the parent; pass it to the child process (spawn)."""

    def __init__(self, ctx, size: int):
        self.size = size - size % _ALIGN
        self.data = ctx.RawArray("B", self.size)
        self.head = ctx.RawValue("Q", 0)
        self.tail = ctx.RawValue("Q", 0)
        self._written = self._read = 0  # the producer's and the consumer's own copies of their index
        self._seq = 0

    def __getstate__(self):
        return {"size": self.size, "data": self.data, "head": self.head, "tail": self.tail}

    def __setstate__(self, state):
        self.__dict__.update(state, _written=state["head"].value, _read=state["tail"].value, _seq=0)

    def _view(self) -> memoryview:
        view = self.__dict__.get("_mv")
        if view is None:
            view = self._mv = memoryview(self.data).cast("B")
        return view

    # -- producer ------------------------------------------------------------------------------
    def fits(self, payload_len: int) -> bool:
        """Whether a record of `payload_len` bytes can ever be put (at most half the ring)."""
        return _record_bytes(payload_len) <= self.size // 2

    def put(self, parts) -> bool:
        """Append one record made of `parts` (bytes-like); False (nothing written) if it does not fit."""
        n = sum(len(p) for p in parts)
        total = _record_bytes(n)
        if not self.fits(n):
            return False
        head, tail = self._written, self.tail.value
        at = head % self.size
        skip = self.size - at if at + total > self.size else 0
        if head + skip + total - tail > self.size:
            return False
        mv = self._view()
        if skip:  # not enough room before the end: a length-0 record sends the reader back to 0
            _RECORD.pack_into(mv, at, self._seq, 0)
            head += skip
            at = 0
        _RECORD.pack_into(mv, at, self._seq, n)
        off = at + _RECORD.size
        for p in parts:
            mv[off:off + len(p)] = p
            off += len(p)
        _TRAILER.pack_into(mv, at + total - _TRAILER.size, self._seq)
        fence()
        self._written = head + total
        self.head.value = self._written
        self._seq += 1
        return True

    # -- consumer ------------------------------------------------------------------------------
    def get(self) -> bytes | None:
        """The next record's payload (copied out), or None if the ring is empty."""
        mv = self._view()
        while self._read < self.head.value:
            fence()
            at = self._read % self.size
            seq, n = _RECORD.unpack_from(mv, at)
            if n == 0:
                self._advance(self.size - at)
                continue
            total = _record_bytes(n)
            if _TRAILER.unpack_from(mv, at + total - _TRAILER.size)[0] != seq:
                return None  # not wholly visible yet: try again later
            payload = bytes(mv[at + _RECORD.size:at + _RECORD.size + n])
            self._advance(total)
            return payload
        return None

    def _advance(self, n: int) -> None:
        fence()
        self._read += n
        self.tail.value = self._read

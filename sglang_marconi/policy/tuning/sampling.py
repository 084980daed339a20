"""Deterministic spatial sampling of sessions (SHARDS-style), shared by alpha tuning and the
simulator: every request of a session is kept or dropped together, identically in every process."""

from __future__ import annotations

import functools
import hashlib

from sglang_marconi.policy.errors import MarconiError


def check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
        raise MarconiError(f"sampling rate must be in (0, 1], got {rate!r}")
    return float(rate)


@functools.lru_cache(maxsize=1 << 14, typed=True)  # a session asks once per request; a bad rate is never cached
def session_in_sample(session_id: str, rate: float, salt: int = 0) -> bool:
    """Keep a session when the first 8 bytes of blake2b(f"{salt}\\0{session_id}") fall below
    rate * 2**64 (never Python's per-process salted hash())."""
    if check_rate(rate) >= 1.0:
        return True
    digest = hashlib.blake2b(f"{salt}\0{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2.0**64

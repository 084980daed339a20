"""The paper's vLLM+ baseline: fine-grained SSM checkpointing with LRU block eviction.

Every full block of `block_size` tokens (32 by default, as in the paper) of a served sequence
(input + output) is cached as one unit: the KV of its tokens for every attention layer plus an
SSM checkpoint taken at its last token, so a block costs
``block_size * kv_bytes_per_token + ssm_state_bytes`` bytes. A request reuses the longest run of
leading full blocks of its input that are all cached, capped so at least one input token is
prefilled (``(input_len - 1) // block_size`` blocks).

Block identity is a content-derived prefix hash, as in vLLM: block i's key depends on every token
of ``sequence[: (i + 1) * block_size]``, so a block's key is a function of its parent's key and its
own tokens. The keys are computed for a whole sequence in one vectorized pass: each token is mixed
with its position (murmur3's 64-bit finalizer over ``token + salt(position)``), the mixed values
are summed per block (mod 2**64) and the block sums are prefix-summed. Two different prefixes get
the same key with probability about 2**-64 per pair (~3e-6 over 10 million distinct blocks); like
vLLM, a collision is not detected. Keys are deterministic across processes (no PYTHONHASHSEED).

Eviction mirrors vLLM's free-block queue: after a request is served its blocks are touched
deepest first, so within one sequence the tail block is the least recently used and is evicted
first. Because every touch of a block also touches all its ancestors afterwards, an ancestor is
always more recent than its cached descendants: LRU only ever evicts blocks with no cached
descendant, so the cached set stays closed under prefixes (a hit stops at the first missing block
either way). The blocks of the request being admitted are never evicted to admit it; when only its
own blocks are left to evict, admission of that request stops and the blocks not admitted are
counted in ``admissions_skipped`` (one per block, i.e. per SSM state).
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POS_SEED = np.uint64(0x2545F4914F6CDD1D)


def _fmix64_(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


class _PositionSalt:
    """A pseudo-random uint64 per token position, grown on demand and shared by all caches."""

    def __init__(self) -> None:
        self._salt = np.empty(0, dtype=np.uint64)

    def get(self, n: int) -> np.ndarray:
        if n > self._salt.size:
            size = max(n, 2 * self._salt.size, 4096)
            salt = np.arange(size, dtype=np.uint64)
            salt *= _GOLDEN
            salt += _POS_SEED
            self._salt = _fmix64_(salt)
        return self._salt[:n]


_POSITION_SALT = _PositionSalt()


def block_keys(tokens: np.ndarray, block_size: int, partial_tail: bool = False) -> list[int]:
    """Content-derived prefix keys of the full blocks of `tokens` (and, with `partial_tail`, of
    the partial last block too: its key identifies the whole of `tokens`).

    Key i identifies ``tokens[: (i + 1) * block_size]``; equal prefixes give equal keys.
    """
    n = int(tokens.shape[0])
    n_blocks = n // block_size
    full = n_blocks * block_size
    m = n if partial_tail else full
    if m == 0:
        return []
    head = np.ascontiguousarray(tokens[:m], dtype=np.int64).view(np.uint64)
    mixed = head + _POSITION_SALT.get(m)  # new array: the caller's tokens stay untouched
    _fmix64_(mixed)
    sums = mixed[:full].reshape(n_blocks, block_size).sum(axis=1, dtype=np.uint64)
    if m > full:
        sums = np.append(sums, mixed[full:].sum(dtype=np.uint64))
    return np.cumsum(sums, dtype=np.uint64).tolist()


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise MarconiError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # int or numpy integer; rejects floats and strings
    except TypeError:
        raise MarconiError(f"{what} must be an integer, got {value!r}") from None


class VllmPlusCache:
    """vLLM+ (paper §5): a KV block + SSM checkpoint per full `block_size`-token block, LRU.

    `profile` needs `kv_bytes_per_token` and `ssm_state_bytes` (a `ModelProfile`).
    """

    name = "vllm+"

    def __init__(self, profile, capacity_bytes: int, block_size: int = 32):
        block_size = _as_int(block_size, "block_size")
        if block_size < 1:
            raise MarconiError(f"block_size must be >= 1, got {block_size}")
        capacity_bytes = _as_int(capacity_bytes, "capacity_bytes")
        if capacity_bytes <= 0:
            raise MarconiError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        kv = _as_int(profile.kv_bytes_per_token, "profile.kv_bytes_per_token")
        ssm = _as_int(profile.ssm_state_bytes, "profile.ssm_state_bytes")
        if kv < 0 or ssm < 0 or block_size * kv + ssm <= 0:
            raise MarconiError(
                f"profile gives a non-positive block size in bytes: kv_bytes_per_token={kv}, "
                f"ssm_state_bytes={ssm}, block_size={block_size}"
            )
        self.profile = profile
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_size * kv + ssm
        if capacity_bytes < self.block_bytes:
            raise MarconiError(
                f"capacity_bytes={capacity_bytes} is smaller than one {block_size}-token block "
                f"({self.block_bytes} bytes: {block_size} x {kv} KV bytes + {ssm} SSM bytes)"
            )
        self.capacity_blocks = capacity_bytes // self.block_bytes
        # key -> None; first = least recently used. Uniform block size: capacity is a block count.
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._evictions = 0
        self._skipped = 0

    def block_keys(self, tokens: np.ndarray) -> list[int]:
        """Prefix keys of the full blocks of `tokens` under this cache's block size."""
        return block_keys(np.asarray(tokens), self.block_size)

    def cached_blocks(self) -> int:
        return len(self._blocks)

    def serve(self, request: Request) -> Outcome:
        bs = self.block_size
        input_len = int(request.input_len)
        keys = block_keys(request.full_sequence(), bs)
        blocks = self._blocks

        # Lookup: leading cached full blocks of the input (its blocks are a prefix of `keys`).
        n_input_blocks = input_len // bs
        overlap = 0
        for k in keys:
            if overlap >= n_input_blocks or k not in blocks:
                break
            overlap += 1
        hit = min(overlap, max(0, (input_len - 1) // bs))

        admitted = self._admit(keys)
        return Outcome(
            input_tokens=input_len,
            hit_tokens=hit * bs,
            overlap_tokens=overlap * bs,
            states_admitted=admitted,
        )

    def _admit(self, keys: list[int]) -> int:
        blocks = self._blocks
        touch = blocks.move_to_end
        # Pass 1: move this request's cached blocks to the MRU end, so that evicting from the
        # LRU end can never take one of them while the rest are admitted.
        protected = 0
        for k in keys:
            if k in blocks:
                touch(k)
                protected += 1
        # Pass 2: admit the missing blocks in order, evicting LRU blocks of other sequences.
        admitted = 0
        if protected < len(keys):
            capacity = self.capacity_blocks
            pop_lru = blocks.popitem
            for i, k in enumerate(keys):
                if k in blocks:
                    continue
                if len(blocks) >= capacity:
                    if len(blocks) <= protected:  # only this request's blocks are left
                        self._skipped += sum(1 for k2 in keys[i:] if k2 not in blocks)
                        break
                    pop_lru(last=False)
                    self._evictions += 1
                blocks[k] = None
                protected += 1
                admitted += 1
        # Pass 3: touch deepest first, so the tail block is the next of this sequence to go.
        for k in reversed(keys):
            if k in blocks:
                touch(k)
        return admitted

    def stats(self) -> PolicyStats:
        n = len(self._blocks)
        return PolicyStats(
            kv_tokens_cached=n * self.block_size,
            ssm_states_cached=n,
            bytes_used=n * self.block_bytes,
            evictions_leaf=self._evictions,
            admissions_skipped=self._skipped,
        )

    def __repr__(self) -> str:
        return (
            f"<VllmPlusCache block_size={self.block_size} blocks={len(self._blocks)}/"
            f"{self.capacity_blocks} ({self.block_bytes} B each)>"
        )

"""vLLM+ baseline (one KV block + SSM checkpoint per full block, LRU) and the no-cache baseline."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.baselines.no_cache import NoCache
from sglang_marconi.sim.baselines.vllm_plus import VllmPlusCache, block_keys
from sglang_marconi.sim.workload import Request

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test extra
    given = None


@dataclass(frozen=True)
class _Profile:
    """Stand-in for ModelProfile: only the two sizes vLLM+ reads."""

    kv_bytes_per_token: int
    ssm_state_bytes: int


UNIT = _Profile(kv_bytes_per_token=1, ssm_state_bytes=0)  # block of 4 tokens = 4 bytes
HYBRID = _Profile(kv_bytes_per_token=10, ssm_state_bytes=1000)


def req(inp, out=(), session="s", turn=0) -> Request:
    return Request(session, turn, 0.0, np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64))


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- hand-checked cases -------------------------------------------------------------------------


def test_shared_70_tokens_block_32_hits_64():
    cache = VllmPlusCache(HYBRID, capacity_bytes=10**9)
    shared = toks(0, 70)
    first = cache.serve(req(shared + toks(1000, 10), toks(2000, 5)))
    assert (first.input_tokens, first.hit_tokens, first.overlap_tokens) == (80, 0, 0)
    assert first.states_admitted == 2  # 85 tokens -> 2 full blocks
    second = cache.serve(req(shared + toks(5000, 30)))
    assert second.hit_tokens == 64
    assert second.overlap_tokens == 64
    assert second.input_tokens == 100
    s = cache.stats()
    assert s.ssm_states_cached == 2 + 1  # second request: 100 tokens -> 3 blocks, 2 shared
    assert s.kv_tokens_cached == 3 * 32
    assert s.bytes_used == 3 * (32 * 10 + 1000)


def test_output_tokens_are_cached_for_the_next_turn():
    cache = VllmPlusCache(UNIT, capacity_bytes=1000, block_size=4)
    inp, out = toks(0, 6), toks(100, 7)  # 13 tokens -> 3 full blocks (12 tokens)
    assert cache.serve(req(inp, out)).states_admitted == 3
    nxt = cache.serve(req(inp + out + toks(200, 5), turn=1))
    assert nxt.hit_tokens == 12


def test_hit_capped_at_input_len_minus_one():
    cache = VllmPlusCache(UNIT, capacity_bytes=1000, block_size=4)
    cache.serve(req(toks(0, 8)))
    again = cache.serve(req(toks(0, 8)))  # whole input cached, but one token must be prefilled
    assert again.hit_tokens == 4
    assert again.overlap_tokens == 8
    longer = cache.serve(req(toks(0, 9)))
    assert longer.hit_tokens == 8
    tiny = cache.serve(req(toks(0, 1)))
    assert tiny.hit_tokens == 0 and tiny.overlap_tokens == 0


def test_lru_evicts_the_tail_block_of_a_sequence_first():
    cache = VllmPlusCache(UNIT, capacity_bytes=12, block_size=4)  # room for 3 blocks
    assert cache.capacity_blocks == 3
    cache.serve(req(toks(0, 12)))  # blocks a0 a1 a2
    out = cache.serve(req(toks(500, 5)))  # one new block: evicts a2, the deepest
    assert out.states_admitted == 1
    s = cache.stats()
    assert s.evictions_leaf == 1 and s.ssm_states_cached == 3 and s.bytes_used == 12
    back = cache.serve(req(toks(0, 13)))
    assert back.hit_tokens == 8  # a0 a1 still cached, a2 gone


def test_lru_evicts_the_older_sequence_first():
    cache = VllmPlusCache(UNIT, capacity_bytes=16, block_size=4)  # 4 blocks
    cache.serve(req(toks(0, 8)))  # A: a0 a1
    cache.serve(req(toks(100, 8)))  # C: c0 c1
    cache.serve(req(toks(0, 4) + [7]))  # touches a0 only: LRU order is now a1 c1 c0 a0
    cache.serve(req(toks(200, 8)))  # D: evicts a1 then c1
    assert cache.stats().evictions_leaf == 2
    a, c = cache.block_keys(np.asarray(toks(0, 8))), cache.block_keys(np.asarray(toks(100, 8)))
    assert [k in cache._blocks for k in a + c] == [True, False, True, False]


def test_request_never_evicts_its_own_blocks():
    cache = VllmPlusCache(UNIT, capacity_bytes=12, block_size=4)  # 3 blocks
    cache.serve(req(toks(0, 8)))  # a0 a1 (LRU order: a1 a0)
    cache.serve(req(toks(100, 4)))  # c0; order a1 a0 c0
    out = cache.serve(req(toks(0, 16)))  # a0..a3: a0 a1 must survive, c0 goes, a3 skipped
    assert out.hit_tokens == 8
    assert out.states_admitted == 1
    s = cache.stats()
    assert s.evictions_leaf == 1
    assert s.admissions_skipped == 1
    assert s.bytes_used == 12
    assert cache.serve(req(toks(0, 13))).hit_tokens == 12


def test_sequence_longer_than_the_cache_keeps_its_head():
    cache = VllmPlusCache(UNIT, capacity_bytes=12, block_size=4)
    out = cache.serve(req(toks(0, 10), toks(50, 10)))  # 5 blocks, room for 3
    assert out.states_admitted == 3
    assert cache.stats().admissions_skipped == 2
    assert cache.serve(req(toks(0, 10) + toks(50, 10))).hit_tokens == 12


def test_missing_middle_block_breaks_the_chain():
    cache = VllmPlusCache(UNIT, capacity_bytes=1000, block_size=4)
    seq = toks(0, 16)
    cache.serve(req(seq))
    keys = cache.block_keys(np.asarray(seq))
    # LRU with deepest-first touching never evicts an ancestor before its descendants, so force
    # the situation the way a hash collision or an external free would leave it.
    del cache._blocks[keys[1]]
    assert cache.stats().ssm_states_cached == 3  # descendants stay cached
    out = cache.serve(req(seq + [99]))
    assert out.hit_tokens == 4 and out.overlap_tokens == 4
    assert out.states_admitted == 1  # only the missing block is re-admitted
    assert cache.serve(req(seq + [99])).hit_tokens == 16


def test_block_keys_are_prefix_keys():
    a = np.arange(100, dtype=np.int64)
    b = a.copy()
    b[50] = -7
    ka, kb = block_keys(a, 8), block_keys(b, 8)
    assert len(ka) == 12
    assert ka[:6] == kb[:6]  # blocks 0..5 end at token 48
    assert all(x != y for x, y in zip(ka[6:], kb[6:]))  # everything after the change differs
    assert len(set(ka)) == len(ka)
    assert block_keys(a[:40], 8) == ka[:5]
    assert block_keys(a[:7], 8) == []
    assert np.array_equal(a, np.arange(100))  # input untouched
    # Same tokens at different offsets are different blocks.
    assert block_keys(np.tile(np.arange(8), 2), 8)[1] != block_keys(np.arange(8), 8)[0]


# --- randomized: bytes never exceed capacity; hits match a naive reference model -------------------


class _Reference:
    """Independent, slow vLLM+ model: blocks keyed by the full token prefix as a tuple."""

    def __init__(self, bs: int, cap_blocks: int):
        self.bs, self.cap = bs, cap_blocks
        self.blocks: OrderedDict[tuple, None] = OrderedDict()
        self.evictions = self.skipped = 0

    def serve(self, inp: list[int], out: list[int]) -> int:
        bs = self.bs
        n_in = len(inp) // bs
        hit = 0
        while hit < n_in and tuple(inp[: (hit + 1) * bs]) in self.blocks:
            hit += 1
        hit = min(hit, (len(inp) - 1) // bs)
        seq = inp + out
        keys = [tuple(seq[: (i + 1) * bs]) for i in range(len(seq) // bs)]
        mine = set(keys)
        for k in keys:
            if k in self.blocks:
                self.blocks.move_to_end(k)
        for i, k in enumerate(keys):
            if k in self.blocks:
                continue
            if len(self.blocks) >= self.cap:
                victim = next(iter(self.blocks))
                if victim in mine:
                    self.skipped += sum(1 for k2 in keys[i:] if k2 not in self.blocks)
                    break
                del self.blocks[victim]
                self.evictions += 1
            self.blocks[k] = None
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)
        return hit * bs


def _random_trace(rng: np.random.Generator, n: int) -> list[tuple[list[int], list[int]]]:
    prefixes = [rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist() for _ in range(4)]
    history: list[list[int]] = []
    trace = []
    for _ in range(n):
        choice = rng.random()
        if history and choice < 0.4:  # next turn of an earlier conversation
            base = history[int(rng.integers(len(history)))]
        elif choice < 0.8:  # shared system prompt
            base = prefixes[int(rng.integers(len(prefixes)))]
        else:
            base = []
        inp = base + rng.integers(0, 3, size=int(rng.integers(1, 25))).tolist()
        out = rng.integers(0, 3, size=int(rng.integers(0, 15))).tolist()
        trace.append((inp, out))
        history.append(inp + out)
    return trace


def _check_against_reference(seed: int, bs: int, cap_blocks: int, n: int = 60) -> None:
    rng = np.random.default_rng(seed)
    profile = _Profile(kv_bytes_per_token=3, ssm_state_bytes=5)
    block_bytes = 3 * bs + 5
    capacity = cap_blocks * block_bytes + int(rng.integers(0, block_bytes))  # slack never used
    cache = VllmPlusCache(profile, capacity_bytes=capacity, block_size=bs)
    ref = _Reference(bs, cap_blocks)
    for inp, out in _random_trace(rng, n):
        o = cache.serve(req(inp, out))
        expected = ref.serve(inp, out)
        assert o.hit_tokens == expected
        assert 0 <= o.hit_tokens <= len(inp) - 1 and o.hit_tokens % bs == 0
        s = cache.stats()
        assert s.bytes_used <= capacity
        assert s.bytes_used == s.ssm_states_cached * block_bytes
        assert s.ssm_states_cached == len(ref.blocks)
        assert (s.evictions_leaf, s.admissions_skipped) == (ref.evictions, ref.skipped)
    # LRU with deepest-first touching keeps the cached set closed under prefixes.
    cached = set(ref.blocks)
    assert all(k[:-bs] in cached for k in cached if len(k) > bs)


if given is not None:

    @settings(max_examples=60, deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        bs=st.integers(1, 6),
        cap_blocks=st.integers(1, 25),
    )
    def test_random_requests_match_reference_and_respect_capacity(seed, bs, cap_blocks):
        _check_against_reference(seed, bs, cap_blocks)

else:  # pragma: no cover

    def test_random_requests_match_reference_and_respect_capacity():
        rng = np.random.default_rng(1234)
        for _ in range(60):
            _check_against_reference(
                int(rng.integers(2**32)), int(rng.integers(1, 7)), int(rng.integers(1, 26))
            )


# --- construction errors -------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -5])
def test_non_positive_capacity_rejected(capacity):
    with pytest.raises(MarconiError, match=str(capacity)):
        VllmPlusCache(UNIT, capacity_bytes=capacity, block_size=4)


def test_capacity_below_one_block_rejected():
    with pytest.raises(MarconiError, match="1319"):
        VllmPlusCache(HYBRID, capacity_bytes=1319)  # one block is 32*10 + 1000 = 1320 bytes
    VllmPlusCache(HYBRID, capacity_bytes=1320)


@pytest.mark.parametrize("bs", [0, -1])
def test_bad_block_size_rejected(bs):
    with pytest.raises(MarconiError, match=f"block_size.*{bs}"):
        VllmPlusCache(UNIT, capacity_bytes=100, block_size=bs)


@pytest.mark.parametrize("kwargs", [{"capacity_bytes": 1.5e9}, {"capacity_bytes": 100, "block_size": 2.0}])
def test_non_integer_sizes_rejected(kwargs):
    with pytest.raises(MarconiError):
        VllmPlusCache(UNIT, **kwargs)


def test_zero_size_profile_rejected():
    with pytest.raises(MarconiError):
        VllmPlusCache(_Profile(0, 0), capacity_bytes=100)


def test_real_profile_block_bytes():
    mp = pytest.importorskip("sglang_marconi.policy.cost.model_profile")
    profile = mp.load_profile("paper-7b")
    cache = VllmPlusCache(profile, capacity_bytes=50 * 10**9)
    assert cache.block_bytes == 32 * profile.kv_bytes_per_token + profile.ssm_state_bytes
    assert cache.name == "vllm+"


# --- no cache ------------------------------------------------------------------------------------


def test_no_cache_never_hits():
    cache = NoCache()
    assert cache.name == "none"
    for _ in range(3):
        o = cache.serve(req(toks(0, 100), toks(0, 10)))
        assert o.input_tokens == 100 and o.hit_tokens == 0 and o.states_admitted == 0
    s = cache.stats()
    assert (s.kv_tokens_cached, s.ssm_states_cached, s.bytes_used, s.evictions_leaf) == (0, 0, 0, 0)
    assert s.admissions_skipped == 0

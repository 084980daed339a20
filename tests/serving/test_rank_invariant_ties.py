"""Exact ties are decided the same on every rank, also on a rank that rebuilt its index.

Two of SGLang's real caches (`sglang_cpu`, Marconi's components) play two ranks of one group:
they serve the same stream, and one of them drops its eviction index (`MarconiTreeIndex`) and
rebuilds it from the tree right before some of its victim choices, as a recovered fault does.
A rebuild fills the index's slots depth-first, while the other rank's slots come from flushes
and swap-removes: any choice among equals that followed the slots would part the trees. After
every request both trees must be identical, and so must every victim.

The stream forces exact ties: a few prompts made of equal-length pieces, repeated (so hits,
branch points and values repeat), and SGLang's clock coarsened so that every stamp of a few
consecutive requests is the same time. (SGLang's own clock gives every stamp a distinct value,
which makes exact ties rare; a guarantee is checked at its worst case.) Covered: Mamba and KV
pressure under Marconi's rule (alpha > 0) and under LRU (alpha 0), the coverage rule, and the
cross-kind choice of one byte budget (`--enable-unified-memory`). The SWA plan ranks by node id
already (`RankedCandidates`) and uses no `CandidateIndex`.

The mutant (ties to the first slot among equals, the rule before tie keys) parts the trees on
this same stream: the check can fail.
"""

from __future__ import annotations

import random
import zlib
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang")

from sglang_cpu import build_cache, run_request, tree_signature  # noqa: E402

from sglang_marconi.policy.tree.candidate_index import CandidateIndex  # noqa: E402

KINDS = ("marconi", "lru", "coverage", "bytes")
CHOICE = {"marconi": 2.0, "lru": 0.0, "coverage": "coverage", "bytes": 1.0}
PIECE = 32  # every prompt is made of pieces of this many tokens
PREFIXES = [[], [10_000 + j for j in range(2 * PIECE)], [20_000 + j for j in range(2 * PIECE)]]
SUFFIXES = [[50_000 + 100 * s + j for j in range(PIECE)] for s in range(6)]
OUTPUT = 8


def tied_stream(seed: int, n: int):
    """n (prompt, output) pairs: a shared prefix or an earlier turn, then one of six suffixes; a
    repeated prompt decodes the same output (a function of the prompt)."""
    rng = random.Random(seed)
    turns: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(turns) if turns and rng.random() < 0.3 else rng.choice(PREFIXES)
        prompt = base + rng.choice(SUFFIXES)
        digest = zlib.crc32(array("q", prompt).tobytes())
        output = [3_000_000 + (digest + j) % 1_000_000 for j in range(OUTPUT)]
        turns = (turns + [prompt + output[:-1]])[-6:]
        yield prompt, output


class CoarseClock:
    """SGLang's time counter, replaced: every stamp reads `now`, which the stream sets."""

    now = 0.0


@pytest.fixture
def coarse_clock(monkeypatch):
    """Every caller of SGLang's `get_and_increase_time_counter` (module attributes and Marconi's
    component closures alike) reads `CoarseClock.now`: the function's code is swapped for one that
    reads it from the function's own module globals."""
    from sglang.srt.mem_cache.unified_cache.components import base

    def coarse():
        return _COARSE_CLOCK.now  # noqa: F821 - resolved in `base`'s globals, set below

    monkeypatch.setattr(base, "_COARSE_CLOCK", CoarseClock, raising=False)
    monkeypatch.setattr(base.get_and_increase_time_counter, "__code__", coarse.__code__)
    return CoarseClock


def build(kind: str):
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.components import marconi_component_overrides
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings
    from sglang_marconi.serving.unified_memory import one_budget_cache_class

    victims = []
    settings = MarconiEvictionSettings("nemotron-h-8b", choice=CHOICE[kind], observer=victims.append)
    if kind == "bytes":
        extra = dict(unified_memory=True, cache_class=one_budget_cache_class())
    else:
        extra = dict(cache_class=marconi_cache_class())
    cc = build_cache(component_registry_override=marconi_component_overrides(settings), kv_size=1200,
                     mamba_size=6, max_num_reqs=2, **extra)
    cc.settings = settings
    return cc, victims


def path_of(node) -> int:
    tokens = []
    while node.parent is not None:
        tokens[:0] = node.key.token_ids
        node = node.parent
    return zlib.crc32(array("q", tokens).tobytes())


class Rank:
    """One rank's cache; `rebuild_before(k)` says whether its index is dropped right before its
    k-th victim choice (counted from 0 over the stream)."""

    def __init__(self, kind, rebuild_before=lambda k: False):
        self.cc, self._victims = build(kind)
        self.index = self.cc.cache.marconi.index
        self.choices = 0
        self.rebuilt = 0
        for name in ("choose", "choose_across"):
            self._wrap(name, rebuild_before)

    def _wrap(self, name, rebuild_before):
        choose = getattr(self.index, name)

        def choose_after_a_rebuild(*args, **kwargs):
            if rebuild_before(self.choices):
                self.index.invalidate()  # what a recovered fault does: rebuilt from the tree at this use
                self.rebuilt += 1
            self.choices += 1
            return choose(*args, **kwargs)

        setattr(self.index, name, choose_after_a_rebuild)

    def serve(self, clock, i, prompt, output, period):
        clock.now = float(i // period) if period else 0.0
        run_request(self.cc, prompt, len(output), out_tokens=output)
        victims = [(v.pressure, v.kind, path_of(v.node)) for v in self._victims]
        self._victims.clear()
        return hash(tuple(tree_signature(self.cc.cache))), victims


def serve_side_by_side(clock, kind, seed, n, period, rebuild_before):
    """Both ranks serve the stream; returns (first request after which they differ or None,
    choices made, rebuilds on the rebuilding rank, exact ties met)."""
    ties = {"n": 0}
    least_key = CandidateIndex.least_key

    def counted(index, slots):
        ties["n"] += 1
        return least_key(index, slots)

    CandidateIndex.least_key = counted
    try:
        steady, rebuilding = Rank(kind), Rank(kind, rebuild_before)
        for i, (prompt, output) in enumerate(tied_stream(seed, n)):
            if steady.serve(clock, i, prompt, output, period) != rebuilding.serve(clock, i, prompt, output, period):
                return i, steady.choices, rebuilding.rebuilt, ties["n"]
        return None, steady.choices, rebuilding.rebuilt, ties["n"]
    finally:
        CandidateIndex.least_key = least_key


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mutant", [False, True], ids=["tie-keys", "mutant-first-slot"])
def test_a_rank_rebuilding_before_every_choice_decides_as_its_peer(coarse_clock, monkeypatch, kind, mutant):
    """A rebuild right before every victim choice (a recovery at every offset): after every
    request the two trees, and the victims, are the same. Mutant: ties to the first slot among
    equals; the trees part."""
    if mutant:
        monkeypatch.setattr(CandidateIndex, "least_key", lambda self, slots: int(slots[0]))
    parted, choices, rebuilt, ties = serve_side_by_side(coarse_clock, kind, seed=0, n=40, period=3,
                                                        rebuild_before=lambda k: True)
    if mutant:
        assert parted is not None, "the slot rule never parted the trees: the stream forces no tie that matters"
        return
    assert parted is None, f"the trees differ from request {parted} on"
    assert choices > 40 and rebuilt == choices, (choices, rebuilt)  # evicting all along, each on a rebuilt index
    assert ties > 10, ties  # exact ties were decided by key, many times


_offsets = st.one_of(st.sets(st.integers(0, 150), min_size=1, max_size=3),
                     st.sets(st.integers(0, 150), min_size=20, max_size=80))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 1000), period=st.sampled_from([1, 2, 4, 0]),
       offsets=_offsets)
def test_rebuilds_at_any_offsets_leave_the_trees_identical(coarse_clock, kind, seed, period, offsets):
    """Rebuilds right before the drawn victim choices (one, a few, or many): the rebuilt slots
    then live on through later flushes and swap-removes. Period 0: one clock value all along."""
    parted, choices, rebuilt, _ = serve_side_by_side(coarse_clock, kind, seed, n=30, period=period,
                                                     rebuild_before=offsets.__contains__)
    assert parted is None, f"the trees differ from request {parted} on ({rebuilt} rebuilds of {choices} choices)"

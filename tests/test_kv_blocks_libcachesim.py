"""Cross-check of the KV block caches with libCacheSim (the `libcachesim` 0.3.5 Python bindings).

libcachesim is GPL-3.0-or-later: only tests and benchmarks import it (a test-only dependency, in
the `test` extra); the package never does. Prefix semantics on libCacheSim: a request's hit is the
run of leading blocks `cache.find(req, False)` finds (no state change), then every block goes
through `cache.get(req)` (hit: update; miss: admit, evicting as needed), objects of size 1.

Results:
- LRU, FIFO, LFU: identical to kv-lru, kv-fifo, kv-lfu, request by request, with the same
  resident blocks. (libCacheSim's LFU.c says it breaks frequency ties FIFO, but an access moves a
  block to the tail of its new count's list, so within a count the order is by last access: LRU,
  as kv-lfu. Both start a block at count 1 and forget the count on eviction.)
- S3FIFO: libCacheSim's S3FIFO.c is another variant of S3-FIFO than kv-s3fifo (the rules of the
  block-hash replay tools). `LcsS3FIFO` below restates libCacheSim's rules plainly and matches
  libcachesim exactly; kv-s3fifo matches its own plain restatement (`tests/test_kv_blocks.py`).
  The differences, libCacheSim first:
  1. sizes are truncated (S = int(C * small_size_ratio), G = int(C * ghost_size_ratio), default
     0.9), not rounded half-to-even with G = C - S;
  2. S and M share one capacity: it evicts only when S + M is full, from M when M is over its
     share or S is empty, else from S; kv-s3fifo keeps S and M to their own sizes;
  3. evicting from S moves heads to M until one block really leaves (to G) and never evicts from M
     on the way; kv-s3fifo drains one head per admission, and a move into a full M evicts from M;
  4. a block moves from S to M at freq >= move_to_main_threshold (default 2) and restarts at freq
     0 in M; kv-s3fifo moves it at freq >= 1 and keeps its freq;
  5. hits count without bound (the cap of 3 applies only when M's second chance decrements:
     min(freq, 3) - 1); kv-s3fifo saturates at max_freq on every hit;
  6. M's victims leave no ghost; kv-s3fifo records them in G;
  7. until its first eviction, a miss goes to M once S is full; kv-s3fifo always admits to S;
  8. with S of 1 object nothing is ever cached (an object as large as S is refused), and S or M of
     0 is a fatal error; kv-s3fifo runs with S = 1 and refuses S or M of 0 with a clear message.
"""

import random

import pytest
from toy_profile import ToyProfile

from sglang_marconi.sim.kv_blocks.registry import build_block_cache
from sglang_marconi.sim.kv_blocks.replay import replay_blocks
from sglang_marconi.sim.kv_blocks.view import BlockTrace, block_trace
from sglang_marconi.sim.traces import load_trace

lcs = pytest.importorskip("libcachesim", reason="libcachesim (GPL, test-only) is not installed: pip install libcachesim==0.3.5")


def lcs_replay(cache, requests):
    """Per-request prefix hit blocks of `requests` replayed through a libcachesim cache."""
    req = lcs.Request()
    req.obj_size = 1
    hits = []

    def find(h):
        req.obj_id = h
        return cache.find(req, False) is not None

    for ids, _ in requests:
        k = 0
        while k < len(ids) and find(ids[k]):
            k += 1
        hits.append(k)
        for h in ids:
            req.obj_id = h
            cache.get(req)
    return hits


def ours(spec, capacity, requests):
    cache = build_block_cache(spec, capacity)
    run = replay_blocks(BlockTrace("x", 4, requests, derived=False), cache, ToyProfile(), progress=False)
    return run.per_request["hit_blocks"], cache


def random_requests(seed, n=600, sessions=40, system=3):
    """Conversations over a shared system prompt: each turn extends a prefix of its session's last
    input with new blocks; now and then a request repeats an old one or starts a new session."""
    rng = random.Random(seed)
    fresh = iter(range(1000, 10**9))
    last, out = {}, []
    prompt = [next(fresh) for _ in range(system)]
    for _ in range(n):
        s = rng.randrange(sessions)
        if rng.random() < 0.1 and out:
            ids = list(rng.choice(out)[0])
        else:
            base = last.get(s, prompt)
            ids = base[: rng.randint(max(1, len(base) - 2), len(base))] + [next(fresh) for _ in range(rng.randint(1, 4))]
        last[s] = ids
        out.append((ids, 4 * len(ids) - rng.randint(0, 3)))
    return out


CLASSES = {"kv-lru": "LRU", "kv-fifo": "FIFO", "kv-lfu": "LFU"}


@pytest.mark.parametrize("spec", list(CLASSES))
@pytest.mark.parametrize("seed, capacity", [(0, 8), (1, 30), (2, 100), (3, 250)])
def test_same_hits_and_contents_as_libcachesim(spec, seed, capacity):
    requests = random_requests(seed)
    theirs = getattr(lcs, CLASSES[spec])(cache_size=capacity)
    mine, cache = ours(spec, capacity, requests)
    assert mine == lcs_replay(theirs, requests)
    assert theirs.get_n_obj() == len(cache)
    probe = lcs.Request()
    probe.obj_size = 1
    for h in cache.blocks():
        probe.obj_id = h
        assert theirs.find(probe, False) is not None


@pytest.mark.parametrize("spec", list(CLASSES))
def test_same_hits_as_libcachesim_on_mooncake(mooncake_path, spec):
    requests = block_trace(load_trace(mooncake_path, "blocks"), 32).requests
    mine, cache = ours(spec, 3000, requests)  # ~100 GB of paper-7b KV
    theirs = getattr(lcs, CLASSES[spec])(cache_size=3000)
    assert mine == lcs_replay(theirs, requests)
    assert theirs.get_n_obj() == len(cache) == 3000


class LcsS3FIFO:
    """libCacheSim 0.3.5's S3FIFO.c rules, restated on plain lists (see the module docstring)."""

    def __init__(self, capacity, small_ratio=0.1, ghost_ratio=0.9, threshold=2):
        self.capacity = capacity
        self.small_size, self.ghost_size = int(capacity * small_ratio), int(capacity * ghost_ratio)
        self.main_size = capacity - self.small_size
        self.threshold, self.has_evicted = threshold, False
        self.S, self.M, self.G, self.freq = [], [], [], {}

    def contains(self, h):
        return h in self.S or h in self.M

    def get(self, h):
        ghost_hit = h in self.G and not self.contains(h)
        if self.contains(h):
            self.freq[h] += 1  # no cap on a hit
            return
        if ghost_hit:
            self.G.remove(h)
        if self.small_size <= 1:  # an object as large as S is never admitted
            return
        while len(self.S) + len(self.M) >= self.capacity:
            self.has_evicted = True
            if len(self.M) > self.main_size or not self.S:
                self.evict_main()
            else:
                self.evict_small()
        if ghost_hit or (not self.has_evicted and len(self.S) >= self.small_size):
            self.M.append(h)
        else:
            self.S.append(h)
        self.freq[h] = 0

    def evict_small(self):
        while self.S:
            h = self.S.pop(0)
            if self.freq[h] >= self.threshold:
                self.M.append(h)
                self.freq[h] = 0  # the moved block restarts at 0
            else:
                del self.freq[h]
                if h not in self.G:
                    if len(self.G) >= self.ghost_size:
                        self.G.pop(0)
                    self.G.append(h)
                return

    def evict_main(self):
        while self.M:
            h = self.M.pop(0)
            if self.freq[h] >= 1:
                self.freq[h] = min(self.freq[h], 3) - 1
                self.M.append(h)
            else:
                del self.freq[h]  # no ghost for M's victims
                return


@pytest.mark.parametrize("seed, capacity, small, ghost, threshold", [
    (0, 20, 0.1, 0.9, 2), (1, 40, 0.1, 0.9, 2), (2, 120, 0.1, 0.9, 2), (3, 37, 0.25, 0.75, 1),
    (4, 64, 0.2, 0.5, 3), (5, 300, 0.1, 0.9, 1), (6, 12, 0.1, 0.9, 2),  # 12: S of 1, nothing cached
])
def test_libcachesim_s3fifo_is_the_variant_documented_above(seed, capacity, small, ghost, threshold):
    requests = random_requests(seed)
    theirs = lcs.S3FIFO(cache_size=capacity, small_size_ratio=small, ghost_size_ratio=ghost,
                        move_to_main_threshold=threshold)
    model = LcsS3FIFO(capacity, small, ghost, threshold)
    hits = []
    for ids, _ in requests:
        k = 0
        while k < len(ids) and model.contains(ids[k]):
            k += 1
        hits.append(k)
        for h in ids:
            model.get(h)
    assert lcs_replay(theirs, requests) == hits
    assert theirs.get_n_obj() == len(model.S) + len(model.M)


def test_the_two_s3fifo_variants_differ_on_the_same_trace():
    """Same capacity, S of 10%: the variants are not the same policy (documented, not a bug)."""
    requests = random_requests(7)
    theirs = lcs_replay(lcs.S3FIFO(cache_size=100), requests)
    mine, _ = ours("kv-s3fifo", 100, requests)
    assert mine != theirs

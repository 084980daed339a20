"""KV-only block caches over hash-id traces: hand-worked traces per policy, property tests against
plain reference implementations, the run's invariants, the CLI, and the whole Mooncake trace."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from toy_profile import ToyProfile

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.kv_blocks.registry import build_block_cache, parse_kv_spec
from sglang_marconi.sim.kv_blocks.replay import replay_blocks
from sglang_marconi.sim.kv_blocks.s3fifo import S3FIFOBlockCache
from sglang_marconi.sim.kv_blocks.view import BlockTrace, block_trace
from sglang_marconi.sim.policies import split_policies
from sglang_marconi.sim.traces import load_trace, save_trace
from sglang_marconi.sim.workload import ListWorkload, Request

TOY = ToyProfile()  # 1 byte of KV per token


def run(spec, capacity, requests, block=4):
    """Replay (hash ids, input length) pairs; per-request hit blocks and hit tokens, and the cache."""
    cache = build_block_cache(spec, capacity)
    result = replay_blocks(BlockTrace("hand", block, requests, derived=False), cache, TOY, progress=False)
    return result.per_request["hit_blocks"], result.per_request["hit_tokens"], cache, result


# ------------------------------------------------------------------ hand-worked traces, 4-token blocks

MIXED = [  # (hash ids, input length)
    ([1, 2], 7),
    ([1, 2, 3], 10),
    ([1, 4], 5),
    ([1, 2, 3], 12),
    ([5, 3], 8),  # 3 is resident but 5 is not: the scan stops at 5, no skip-ahead
    ([2, 5, 3], 9),  # all resident: 3 blocks but only 9 tokens (partial last block)
]


def test_lru_by_hand():
    # capacity 3, LRU order (least recent first) after each request:
    # r0 miss 1,2 -> [1 2]; r1 hits 1,2 (8 tokens), admits 3 -> [1 2 3]
    # r2 hits 1 (4), admits 4 evicting 2 -> [3 1 4]; r3 hits 1 (4), 2 evicts 3, 3 evicts 4 -> [1 2 3]
    # r4: 5 misses (0 although 3 is resident), 5 evicts 1, 3 refreshed -> [2 5 3]; r5 hits all 3 blocks = 9 tokens
    blocks, tokens, cache, res = run("kv-lru", 3, MIXED)
    assert blocks == [0, 2, 1, 1, 0, 3]
    assert tokens == [0, 8, 4, 4, 0, 9]
    assert cache.blocks() == [2, 5, 3] and cache.evictions == 4
    assert res.block_cache["final_cache_blocks"] == 3 and res.block_cache["total_hit_tokens"] == 25


def test_fifo_by_hand():
    # capacity 3, admission order: r0 [1 2]; r1 hits 1,2, admits 3 -> [1 2 3]; r2 hits 1 (no refresh),
    # 4 evicts 1 -> [2 3 4]; r3: 1 is gone, so 0 hits; 1 evicts 2, 2 evicts 3, 3 evicts 4 -> [1 2 3]
    # r4: 5 evicts 1 -> [2 3 5]; r5 hits all 3 = 9 tokens
    blocks, tokens, cache, _ = run("kv-fifo", 3, MIXED)
    assert blocks == [0, 2, 1, 0, 0, 3]
    assert tokens == [0, 8, 4, 0, 0, 9]
    assert cache.blocks() == [2, 3, 5] and cache.evictions == 5


def test_lfu_by_hand():
    # capacity 3; (block: count), ties evicted least recently used first
    trace = [
        ([1, 2], 8),  # 0 hits; {1:1, 2:1}
        ([1, 3], 8),  # hits 1 (4 tokens); {1:2, 2:1, 3:1}
        ([1, 4], 8),  # hits 1; 1 -> 3; 4 evicts 2 (count 1, used before 3); {1:3, 3:1, 4:1}
        ([2, 3], 8),  # 0 hits (2 gone); 2 evicts 3 (count 1, older than 4); 3 evicts 4; {1:3, 2:1, 3:1}
        ([3, 2], 6),  # hits both: min(8, 6) = 6 tokens; {1:3, 3:2, 2:2}
        ([5], 4),  # 5 evicts 3 (count 2, used before 2); {1:3, 2:2, 5:1}
        ([3], 4),  # 0 hits; 3 comes back with count 1 (counts are lost on eviction), evicting 5
    ]
    blocks, tokens, cache, _ = run("kv-lfu", 3, trace)
    assert blocks == [0, 1, 1, 0, 2, 0, 0]
    assert tokens == [0, 4, 4, 0, 6, 0, 0]
    assert cache.resident == {1: 3, 2: 2, 3: 1}
    assert cache.blocks() == [3, 2, 1]  # eviction order: count 1, then 2, then 3
    assert cache.evictions == 5


def single(*hashes):
    """One-block requests (4 tokens each): a request's hit is its block's hit."""
    return [([h], 4) for h in hashes]


def s3(cache):
    f = cache.resident
    return ([(h, f[h]) for h in cache.small], [(h, f[h]) for h in cache.main], list(cache.ghost))


def test_s3fifo_promotion_second_chance_and_ghost_by_hand():
    # capacity 4, small_ratio 0.25: S 1 block, M 3, G 3; max_freq 3
    trace = single(
        "a", "a", "a",  # a in S, freq 2
        "b",  # S full: a (freq 2) moves to M keeping freq 2; S [b]
        "c",  # b (freq 0) -> G; S [c]
        "c", "d", "d", "e", "e",  # c, d promoted with freq 1: M [a2 c1 d1]; S [e1]
        "f",  # e (1) to a full M: second chance a2->1, c1->0, d1->0, a1->0 (each requeued at the
        #       tail), then c (0) is the one real eviction -> G [b c]; M [d0 a0 e1]; S [f0]
    )
    blocks, _, cache, _ = run("kv-s3fifo:small_ratio=0.25,max_freq=3", 4, trace)
    assert blocks == [0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert s3(cache) == ([("f", 0)], [("d", 0), ("a", 0), ("e", 1)], ["b", "c"])
    # a survived because its freq 2 was kept on promotion; with the freq reset, a would have gone
    # ghost hit: b leaves G and enters M's tail with freq 0, evicting M's head d (freq 0) to G
    blocks, _, cache, _ = run("kv-s3fifo:small_ratio=0.25,max_freq=3", 4, trace + single("b", "b"))
    assert blocks[-2:] == [0, 1]  # the ghost hit is a miss; b is resident afterwards
    assert s3(cache) == ([("f", 0)], [("a", 0), ("e", 1), ("b", 1)], ["c", "d"])
    assert cache.blocks() == ["f", "a", "e", "b"] and cache.evictions == 3


@pytest.mark.parametrize("max_freq, a_freq, a_after", [(2, 2, 0), (3, 3, 1)])
def test_s3fifo_frequency_saturates(max_freq, a_freq, a_after):
    spec = f"kv-s3fifo:small_ratio=0.25,max_freq={max_freq}"
    head = single("a", "a", "a", "a", "a")  # 4 hits on a
    _, _, cache, _ = run(spec, 4, head)
    assert cache.resident["a"] == a_freq
    # a, b, c, d promoted (a saturated, the others at 1); e's promotion runs the second chance:
    # max_freq 2: a2->1, b1->0, c1->0, d? not yet in M ... see below
    trace = head + single("b", "b", "c", "c", "d", "d", "e")
    _, _, cache, _ = run(spec, 4, trace)
    # a, b, c move to M (a saturated, b and c at 1): M [a b1 c1]; d (1) to the full M runs the
    # second chance: max_freq 2: a2->1, b1->0, c1->0, a1->0, b0 evicted -> M [c0 a0 d1]
    #                max_freq 3: a3->2, b1->0, c1->0, a2->1, b0 evicted -> M [c0 a1 d1]
    assert s3(cache) == ([("e", 0)], [("c", 0), ("a", a_after), ("d", 1)], ["b"])


@pytest.mark.parametrize("capacity, small", [(15, 2), (25, 2), (35, 4), (20, 2), (10, 1)])
def test_s3fifo_small_queue_rounds_half_to_even(capacity, small):
    cache = build_block_cache("kv-s3fifo", capacity)
    assert (cache.small_cap, cache.main_cap, cache.ghost_cap) == (small, capacity - small, capacity - small)
    # behaviour, not just the field: one-hit blocks fill S, the first of them overflows to G
    _, _, cache, _ = run("kv-s3fifo", capacity, single(*range(small + 1)))
    assert s3(cache) == ([(h, 0) for h in range(1, small + 1)], [], [0])


def test_s3fifo_refuses_an_empty_queue():
    with pytest.raises(MarconiError, match=r"round\(5 \* 0.1\) = 0.*capacity >= 6"):
        build_block_cache("kv-s3fifo", 5)  # round(0.5) = 0; 6 blocks give round(0.6) = 1
    with pytest.raises(MarconiError, match="main queue 0"):
        build_block_cache("kv-s3fifo:small_ratio=0.9", 1)


def test_first_hash_never_seen_hits_nothing_even_with_later_blocks_resident():
    blocks, _, _, _ = run("kv-lru", 8, [([1, 2, 3], 12), ([9, 2, 3], 12), ([1, 2, 3], 11)])
    assert blocks == [0, 0, 3]


# ------------------------------------------------------------------ plain reference implementations


class PlainLRU:
    def __init__(self, capacity, refresh=True):
        self.capacity, self.refresh, self.q = capacity, refresh, []

    def resident(self):
        return list(self.q)

    def access(self, h):
        if h in self.q:
            if self.refresh:
                self.q.remove(h)
                self.q.append(h)
            return
        if len(self.q) == self.capacity:
            self.q.pop(0)
        self.q.append(h)


class PlainLFU:
    def __init__(self, capacity):
        self.capacity, self.entries, self.clock = capacity, {}, 0  # h -> [count, last access]

    def resident(self):
        return sorted(self.entries, key=lambda h: self.entries[h])

    def access(self, h):
        self.clock += 1
        if h in self.entries:
            self.entries[h][0] += 1
            self.entries[h][1] = self.clock
            return
        if len(self.entries) == self.capacity:
            del self.entries[min(self.entries, key=lambda k: self.entries[k])]
        self.entries[h] = [1, self.clock]


class PlainS3FIFO:
    """The issue's rules, one by one, on plain lists."""

    def __init__(self, capacity, small_ratio=0.1, max_freq=3):
        self.small_cap = round(capacity * small_ratio)
        self.main_cap = self.ghost_cap = capacity - self.small_cap
        self.max_freq = max_freq
        self.S, self.M, self.G, self.freq = [], [], [], {}

    def resident(self):
        return self.S + self.M

    def to_ghost(self, h):
        del self.freq[h]
        if h in self.G:
            self.G.remove(h)
        self.G.append(h)
        if len(self.G) > self.ghost_cap:
            self.G.pop(0)

    def insert_main(self, h, f):
        while len(self.M) >= self.main_cap:
            head = self.M.pop(0)
            if self.freq[head] >= 1:
                self.freq[head] -= 1
                self.M.append(head)
            else:
                self.to_ghost(head)
                break
        self.M.append(h)
        self.freq[h] = f

    def access(self, h):
        if h in self.S or h in self.M:
            self.freq[h] = min(self.freq[h] + 1, self.max_freq)
        elif h in self.G:
            self.G.remove(h)
            self.insert_main(h, 0)
        else:
            while len(self.S) >= self.small_cap:
                head = self.S.pop(0)
                if self.freq[head] >= 1:
                    self.insert_main(head, self.freq[head])
                else:
                    self.to_ghost(head)
            self.S.append(h)
            self.freq[h] = 0


def plain_replay(model, block, requests):
    hits = []
    for ids, _ in requests:
        k = 0
        while k < len(ids) and ids[k] in model.resident():
            k += 1
        hits.append(k)
        for h in ids:
            model.access(h)
    return hits


# Requests that share prefixes: each extends a prefix of an earlier one with fresh or old ids.
block_requests = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 4), st.lists(st.integers(0, 14), min_size=0, max_size=5),
              st.integers(0, 3)),
    min_size=1, max_size=40,
)


def build_requests(raw, block=4):
    out = []
    for pick, keep, tail, short in raw:
        base = out[pick % len(out)][0][:keep] if out else []
        ids = (base + tail) or [100 + pick]
        out.append((ids, len(ids) * block - min(short, block - 1)))
    return out


def references(capacity):
    return {
        "kv-lru": lambda: PlainLRU(capacity),
        "kv-fifo": lambda: PlainLRU(capacity, refresh=False),
        "kv-lfu": lambda: PlainLFU(capacity),
    }


@settings(max_examples=150, deadline=None)
@given(block_requests, st.integers(1, 10), st.sampled_from(["kv-lru", "kv-fifo", "kv-lfu"]))
def test_matches_plain_reference(raw, capacity, spec):
    requests = build_requests(raw)
    blocks, tokens, cache, _ = run(spec, capacity, requests)
    model = references(capacity)[spec]()
    assert blocks == plain_replay(model, 4, requests)
    assert cache.blocks() == model.resident()
    assert tokens == [min(4 * k, n) for k, (_, n) in zip(blocks, requests)]


@settings(max_examples=200, deadline=None)
@given(block_requests, st.integers(2, 30), st.sampled_from([0.1, 0.25, 0.3, 0.5]), st.integers(1, 4))
def test_s3fifo_matches_plain_reference(raw, capacity, ratio, max_freq):
    assume(1 <= round(capacity * ratio) < capacity)
    requests = build_requests(raw)
    blocks, _, cache, _ = run(f"kv-s3fifo:small_ratio={ratio},max_freq={max_freq}", capacity, requests)
    model = PlainS3FIFO(capacity, ratio, max_freq)
    assert blocks == plain_replay(model, 4, requests)
    assert (list(cache.small), list(cache.main), list(cache.ghost)) == (model.S, model.M, model.G)
    assert cache.resident == model.freq


@settings(max_examples=100, deadline=None)
@given(block_requests, st.integers(1, 12), st.sampled_from(["kv-lru", "kv-fifo", "kv-lfu", "kv-s3fifo:small_ratio=0.5"]),
       st.sampled_from([1, 4, 16]))
def test_run_invariants(raw, capacity, spec, block):
    assume(not spec.startswith("kv-s3fifo") or capacity >= 2)
    requests = build_requests(raw, block)
    _, _, cache, res = run(spec, capacity, requests, block)
    b, per = res.block_cache, res.per_request
    assert b["overall_hit_rate"] == b["total_hit_tokens"] / b["total_prompt_tokens"] == res.token_hit_rate
    assert sum(per["hit_tokens"]) == b["total_hit_tokens"] and sum(per["prompt_tokens"]) == b["total_prompt_tokens"]
    assert b["final_cache_blocks"] == len(cache) <= capacity
    seen = set()
    for (ids, length), k, hit in zip(requests, per["hit_blocks"], per["hit_tokens"]):
        if ids[0] not in seen:
            assert k == 0
        assert hit == min(k * block, length) <= length
        seen.update(ids)


# ------------------------------------------------------------------ specs, CLI


def test_split_policies_keeps_parameters_together():
    assert split_policies("kv-lru,kv-s3fifo:small_ratio=0.1,max_freq=3,marconi:0.5, sglang+") == [
        "kv-lru", "kv-s3fifo:small_ratio=0.1,max_freq=3", "marconi:0.5", "sglang+"]
    assert split_policies("kv-s3fifo:max_freq=2 , small_ratio = 0.2,kv-lfu") == [
        "kv-s3fifo:max_freq=2 , small_ratio = 0.2", "kv-lfu"]
    assert split_policies("none,vllm+,,") == ["none", "vllm+"]
    cls, kwargs = parse_kv_spec("kv-s3fifo:max_freq=2 , small_ratio = 0.2")
    assert cls is S3FIFOBlockCache and kwargs == {"max_freq": 2, "small_ratio": 0.2}


@pytest.mark.parametrize("args, message", [
    (["--policies", "kv-lru2"], "kv-lru2"),
    (["--policies", "kv-s3fifo:small_ratio=1"], "small_ratio"),
    (["--policies", "kv-s3fifo:small_ratio=0"], "small_ratio"),
    (["--policies", "kv-s3fifo:small_ratio=nan"], "small_ratio"),
    (["--policies", "kv-s3fifo:max_freq=0"], "max_freq"),
    (["--policies", "kv-s3fifo:max_freq=2.5"], "'2.5'"),
    (["--policies", "kv-s3fifo:ratio=0.1"], "'ratio'"),
    (["--policies", "kv-s3fifo:small_ratio"], "key=value"),
    (["--policies", "kv-lru:small_ratio=0.1"], "no parameters"),
    (["--policies", "kv-lru", "--capacity-blocks", "0"], "'0'"),
    (["--policies", "kv-lru", "--capacity-blocks", "ten"], "'ten'"),
    (["--policies", "sglang+", "--capacity-blocks", "10"], "--capacity-blocks"),
    (["--policies", "kv-s3fifo", "--capacity-blocks", "5"], "round(5 * 0.1) = 0"),
    (["--policies", "kv-lru", "--capacity", "1000"], "holds no KV block"),
    (["--policies", "kv-lru", "--model", "mamba2-2.7b"], "--capacity-blocks"),
])
def test_cli_errors_name_the_bad_value(args, message, capsys):
    assert main(args + ["--no-progress", "--limit", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err and err.count("\n") == 1


def mooncake_lines(tmp_path, records):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                            for i, (ids, n) in enumerate(records)))
    return path


def test_cli_kv_runs_on_a_hash_trace(tmp_path, capsys):
    # 512-token blocks: the trace's own ids are replayed, whatever --block-size says
    path = mooncake_lines(tmp_path, [([0, 1], 1000), ([0, 1, 2], 1500), ([0, 3], 600), ([0, 1, 2], 1100)])
    out = tmp_path / "runs.json"
    rc = main(["--trace", str(path), "--policies", "kv-lru,kv-s3fifo:small_ratio=0.5,max_freq=3,none",
               "--capacity-blocks", "2,8", "--block-size", "32", "--json", str(out), "--with-requests",
               "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())
    assert [(r["policy"], r["capacity_blocks"]) for r in runs if r["policy"] != "none"] == [
        ("kv-lru", 2), ("kv-lru", 8), ("kv-s3fifo:small_ratio=0.5,max_freq=3", 2),
        ("kv-s3fifo:small_ratio=0.5,max_freq=3", 8)]
    lru2, lru8 = runs[0], runs[1]
    # capacity 8: r1 hits 0,1 (1024); r2 hits 0 (512); r3 hits 0,1,2 = min(1536, 1100) = 1100
    assert lru8["per_request"]["hit_tokens"] == [0, 1024, 512, 1100]
    assert lru8["per_request"]["hit_blocks"] == [0, 2, 1, 3]
    assert lru8["per_request"]["prompt_tokens"] == [1000, 1500, 600, 1100]
    assert lru8["final_cache_blocks"] == 4 and lru8["block_size"] == 512
    # capacity 2: r1 hits 0,1 (1024), then 2 evicts 0 -> [1 2]; r2: 0 is gone (0 hits), 0 evicts 1
    # and 3 evicts 2 -> [0 3]; r3 hits 0 only (512)
    assert lru2["per_request"]["hit_tokens"] == [0, 1024, 0, 512] and lru2["final_cache_blocks"] == 2
    assert lru2["capacity_bytes"] == 2 * 512 * 65536  # paper-7b: 64 KiB of KV per token
    for r in runs:
        for key in ("token_hit_rate", "request_hit_rate", "flops_saved", "wall_seconds", "alpha_history"):
            assert key in r
    assert lru8["overall_hit_rate"] == lru8["token_hit_rate"] == pytest.approx(2636 / 4200)
    assert "KV-only policy" in capsys.readouterr().out


def test_cli_kv_capacity_in_bytes(tmp_path):
    path = mooncake_lines(tmp_path, [([0, 1], 1000), ([0, 1, 2], 1500)])
    out = tmp_path / "runs.json"
    block_bytes = 512 * 65536
    assert main(["--trace", str(path), "--policies", "kv-lfu", "--capacity", f"{3 * block_bytes - 1},1GB",
                 "--json", str(out), "--no-progress"]) == 0
    runs = json.loads(out.read_text())
    assert [(r["capacity_blocks"], r["capacity_bytes"]) for r in runs] == [
        (2, 3 * block_bytes - 1), (10**9 // block_bytes, 10**9)]


def test_token_workloads_get_chained_hash_ids(tmp_path):
    # no hash ids in the workload: ids derived from 4-token blocks, chained by prefix
    a = list(range(10))
    w = ListWorkload("toks", [
        Request("s", 0, 0.0, a, [1]),
        Request("s", 1, 1.0, a[:8] + [99, 98], [1]),  # shares 2 full blocks, not the partial third
        Request("t", 0, 2.0, [5] * 4 + a[4:10], [1]),  # same 2nd block content, other prefix: no hit
        Request("s", 2, 3.0, a, [1]),  # the same input: every block, partial last included
    ])
    trace = block_trace(w, 4)
    assert trace.derived and trace.block_size == 4 and [len(ids) for ids, _ in trace.requests] == [3, 3, 3, 3]
    assert trace.requests[0][0] == trace.requests[3][0]
    assert trace.requests[0][0][:2] == trace.requests[1][0][:2] and trace.requests[0][0][2] != trace.requests[1][0][2]
    assert not set(trace.requests[2][0]) & set(trace.requests[0][0])
    res = replay_blocks(trace, build_block_cache("kv-lru", 100), TOY, progress=False)
    assert res.per_request["hit_tokens"] == [0, 8, 0, 10]
    # the CLI does the same through --block-size
    out = tmp_path / "runs.json"
    assert main(["--trace", str(save_trace(w, tmp_path / "t.jsonl")), "--policies", "kv-lru", "--block-size", "4",
                 "--capacity-blocks", "100", "--json", str(out), "--with-requests", "--no-progress"]) == 0
    (r,) = json.loads(out.read_text())
    assert r["per_request"]["hit_tokens"] == [0, 8, 0, 10] and r["hashes_derived"] and r["block_size"] == 4


def test_mooncake_full_trace_every_policy(mooncake_path):
    """The whole conversation trace (12,031 requests) through each policy (its replay time is
    the benchmark's: scripts/bench_kv_blocks.py prints it, against the 5 s target)."""
    trace = block_trace(load_trace(mooncake_path, "blocks"), 32)
    assert len(trace) == 12031 and trace.block_size == 512 and not trace.derived
    rates = {}
    for spec in ("kv-lru", "kv-lfu", "kv-fifo", "kv-s3fifo"):
        cache = build_block_cache(spec, 14901)  # 500 GB of paper-7b KV
        res = replay_blocks(trace, cache, TOY, progress=False)
        rates[spec] = res.token_hit_rate
        assert res.block_cache["final_cache_blocks"] == 14901
    assert rates["kv-lru"] > rates["kv-fifo"] > rates["kv-s3fifo"] > rates["kv-lfu"] > 0.1

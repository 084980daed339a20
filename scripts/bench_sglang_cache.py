"""SGLang's real hybrid prefix cache on CPU: upstream LRU (Python and Rust tree cores) vs Marconi
(our FULL/MAMBA components + admission: alpha fixed at 0 and 1, tuned online, and tuned without
our admission) replaying the same traces at several pool sizes, in SGLang's two Mamba cache
strategies. Prints markdown tables (docs/benchmarks.md has a run).

    python scripts/bench_sglang_cache.py [--quick] [--traces agent,chat,mooncake,mooncake-blocks,stress,reasoning]
        [--mamba-radix-cache-strategy no_buffer,extra_buffer] [--json out.json]

Each request goes through the scheduler's calls on SGLang 0.5.23's own objects (the cache built by
`tests/serving/sglang_cpu.py`: a tiny Mamba2 hybrid, page size 1, Mamba checkpoint grid 64): match
(`Req.init_next_round_input`, with the Mamba copy-on-write), lock, request/KV slot allocation
(evicting as needed), prefill in chunks of `--chunk-size` tokens (`checkpoint_kv_cache` after each
non-final chunk; Marconi ends a chunk where its branch state can be kept, `chunk_end_for_branch`:
at the branch in no_buffer mode, a snapshot step before it, and at it, in extra_buffer mode), the
first token, `checkpoint_kv_cache`, the decode KV (allocated in one call, not one per token: same memory, fewer
eviction calls), `release_kv_cache(checkpoint=True)`. One request at a time. In extra_buffer mode
(SGLang's GPU default) the state each extend and each 64 decoded tokens snapshot is picked by
SGLang's own bookkeeping (`ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`), as the
forward pass would.

Traces: `agent` = synthetic swe-agent (shared system prompt, long trajectories) at 0.1x lengths,
`chat` = synthetic lmsys multi-turn at 0.25x, `mooncake` = the first N requests of the Mooncake
conversation trace with each 512-token hash block mapped to 64 tokens (0.125x; block boundaries
stay on the 64-token Mamba grid, as 512 is on it in the real trace) and a conversation's next
turn rebuilt to repeat the previous turn's tail and reply (`sim/mooncake_tokens.py`);
`mooncake-blocks` = the same requests with only the trace's full blocks shared (a stress case
outside the targets: no turn can extend its predecessor there); `stress` = chains and fan-outs
off earlier sequences, shuffled, in the shape of SGLang's own radix-cache fuzz (`sim/stress.py`);
`reasoning` = a reasoning model's conversations whose chat template drops each answer's reasoning from
the history (`sim/stress.reasoning_chat`: every next turn leaves the cached sequence where its
predecessor's input ended). Pool sizes: KV tokens = a fraction of the trace's infinite-cache
footprint; Mamba slots = SGLang's default memory split (`--mamba-full-memory-ratio 0.9`) of that KV pool for the real model
(nemotron-h-8b: one SSM state = 3,162 tokens of KV), counting KV at the trace's real length (see
`pool_sizes`).

Timings (perf_counter_ns around each call, exclusive): match = `init_next_round_input`,
checkpoint = each `checkpoint_kv_cache`, release = `release_kv_cache`, evict = each outermost call
of the cache's `evict_for_alloc` / `evict` (one allocation's or one slot reservation's whole
eviction walk; made only when an allocation is short). Eviction inside a match (copy-on-write
slot), a checkpoint (Marconi's branch slot) or an allocation counts under evict only and is
subtracted from the enclosing operation; "victims / call" counts the eviction steps that evicted
a node or dropped a state, and "evict µs / victim" divides each call by them. Pool tensor
operations (`TokenToKVPoolAllocator.free`, which concatenates the whole free list on CPU,
`MambaSlotAllocator.free`, the same for state slots, and `MambaPool.copy_from`, the state fork) are
subtracted from every operation and summed in "pool ops s": they are device work on a GPU, and
here they would swamp the tree's cost. torch runs with 1 intra-op thread (2 threads on this
2-core VM stall tiny tensor ops for milliseconds) and glibc keeps freed memory (`keep_malloc_arenas`).

`--tree-nodes 1500,6000,24000,96000` times single eviction steps on trees of those sizes instead:
one SWA eviction step (`--tree-kinds swa`) and, under HiCache write_back, one device eviction with
the host full and one host eviction (`--tree-kinds host`, `host_step_cell`), upstream's against
Marconi's on the same request stream.

Per cell: token hit rate, prefill FLOPs saved (nemotron-h-8b profile, sum of prefill_flops(0, hit)
over requests), SSM states in the tree at the end per request served, median (p99) microseconds
per operation, tree microseconds per request (all four summed), and ratios vs upstream LRU on the
Python tree core measured in the same run. A tuned cell's "choices" are the tuner's decisions, then
what the cache put in force at which release (sync points), and how many sync points found the tuner
behind: this replay has no forward pass between requests, so the background tuner can fall behind
and a decision take effect late (the hit rate then is not the inline tuner's).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serving"))  # sglang_cpu: SGLang's cache built on CPU
MOONCAKE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

# marconi-aN: alpha fixed at N; marconi-auto: tuned online (what `--marconi-alpha auto` runs);
# marconi-evict: tuned FLOP-aware eviction with upstream's admission (`--marconi-admission off`);
# marconi-coverage: SGLang PR #38000's rule served (`--marconi-eviction coverage`), Marconi's admission.
CONFIGS = ("lru-py", "lru-rust", "marconi-a0", "marconi-a1", "marconi-auto", "marconi-evict", "marconi-coverage")
OPS = ("match", "checkpoint", "release", "evict")
PER_VICTIM = "evict/victim"  # an evict call's time over the nodes it evicted (or states it dropped)
# Like for like: a match that hits forks a state and a miss does not; an eviction for KV tokens
# walks leaves, one for a Mamba slot walks states. Medians of each kind, compared kind to kind.
LIKE_FOR_LIKE = ("match:hit", "match:miss", "checkpoint", "release", "evict:kv", "evict:mamba")
# Finer: an eviction for a Mamba slot that deletes a leaf (its KV too: SGLang's deletion path)
# against upstream's such evictions, and one that only drops a state against upstream's. The
# policy decides the mix (Marconi deletes more leaves than upstream's LRU), so this view is the
# one that isolates what choosing a victim costs.
BY_VICTIM_KIND = ("match:hit", "match:miss", "checkpoint", "release", "evict:kv", "evict:mamba-leaf",
                  "evict:mamba-state")
MIN_SAMPLES = 20  # a like-for-like median needs this many samples on both sides
MOONCAKE_BLOCK = 512


# -- traces -------------------------------------------------------------------------------------

def mooncake_requests(n: int, block_tokens: int, tokens: str = "conversation"):
    """The first `n` requests of the Mooncake conversation trace, each 512-token hash block mapped
    to `block_tokens` tokens (`MooncakeTrace.scaled`; `tokens` "conversation": a next turn repeats
    the previous turn's tail and reply)."""
    from sglang_marconi.sim.traces import load_trace

    return list(load_trace(MOONCAKE, tokens).scaled(block_tokens, n))


def traces(quick: bool):
    """name -> (description, token scale vs the real trace, requests factory)."""
    from sglang_marconi.sim.synthetic import generate

    from sglang_marconi.sim.stress import chain_fanout, reasoning_chat

    agent, chat, moon = (2, 10, 300) if quick else (20, 100, 3000)
    stress = 600 if quick else 5000
    reasoning = 12 if quick else 48
    return {
        # SGLang's own radix-cache fuzz shape (chains and fan-outs off earlier sequences, shuffled);
        # pools sized as if each token stood for 8 (scale 0.125), like the Mooncake rows.
        "stress": (f"chain / fan-out stress, {stress:,} sequences (sim/stress.py), pools at scale 0.125", 0.125,
                   lambda: list(chain_fanout(stress))),
        # a reasoning model whose template drops each answer's reasoning from the history
        "reasoning": (f"reasoning chat, {reasoning} conversations x 10 turns, reasoning dropped from the history "
                      "(sim/stress.py), pools at scale 0.1", 0.1, lambda: list(reasoning_chat(reasoning))),
        "agent": (f"synthetic swe-agent, {agent} trajectories, scale 0.1", 0.1,
                  lambda: list(generate("swe-agent", sessions=agent, scale=0.1))),
        "chat": (f"synthetic lmsys, {chat} sessions, scale 0.25", 0.25,
                 lambda: list(generate("lmsys", sessions=chat, scale=0.25))),
        "mooncake": (f"Mooncake conversation trace, first {moon:,} requests, 64 tokens per 512-token block, "
                     "turns rebuilt", 64 / MOONCAKE_BLOCK, lambda: mooncake_requests(moon, 64)),
        # Stress case, outside TARGET_TRACES: only full blocks are shared (see MooncakeTokenizer).
        "mooncake-blocks": (f"Mooncake conversation trace, first {moon:,} requests, 64 tokens per 512-token "
                            "block, literal blocks only", 64 / MOONCAKE_BLOCK,
                            lambda: mooncake_requests(moon, 64, "blocks")),
    }
TARGET_TRACES = ("agent", "chat", "mooncake", "stress", "reasoning")
GAIN_POINTS, GAIN_BELOW = 0.03, 0.90  # tuned >= upstream + 3 points wherever upstream is below 90%
COVERAGE_SLACK = 0.005  # tuned >= SGLang #38000's coverage rule - 0.5 points


@dataclass
class TraceInfo:
    requests: list
    input_tokens: int
    unique_tokens: int  # an infinite cache's KV footprint (input + output of every request)
    infinite_hit: float
    longest: int


def describe(requests) -> TraceInfo:
    from sglang_marconi.sim.baselines.infinite import InfiniteCache

    inf = InfiniteCache()
    hits = sum(inf.serve(r).hit_tokens for r in requests)
    total = sum(r.input_len for r in requests)
    return TraceInfo(requests, total, inf.tokens, hits / total, max(r.input_len + r.output_len for r in requests))


MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's default --mamba-full-memory-ratio


def pool_sizes(info: TraceInfo, fractions, scale: float, profile):
    """(KV tokens, Mamba slots) from tight to ample. KV = a fraction of the infinite-cache
    footprint (never below what the longest request needs in flight); Mamba slots = what SGLang's
    default memory split gives that KV pool for the real model: mamba bytes = 0.9 x KV bytes
    (`--mamba-full-memory-ratio`), with the nemotron-h-8b profile's bytes (one SSM state = 3,162
    tokens of KV) and the KV counted at the trace's real length (scaled tokens / `scale`)."""
    floor_kv = info.longest + 256
    tokens_per_state = profile.ssm_state_bytes / profile.kv_bytes_per_token
    cells = []
    for f in fractions:
        kv = max(floor_kv, round(f * info.unique_tokens))
        mamba = max(6, round(MAMBA_FULL_MEMORY_RATIO * kv / scale / tokens_per_state))
        if (kv, mamba) not in cells:
            cells.append((kv, mamba))
    return cells


# -- one replay ----------------------------------------------------------------------------------

@dataclass
class Cell:
    config: str
    kv_size: int
    mamba_size: int
    backend: str = ""
    hit_tokens: int = 0
    input_tokens: int = 0
    flops_saved: float = 0.0
    states_end: int = 0
    requests: int = 0
    evicted_tokens: int = 0
    evicted_states: int = 0
    wall_s: float = 0.0
    pool_s: float = 0.0  # time in pool tensor ops (KV and state-slot frees, MambaPool.copy_from)
    samples: dict = field(default_factory=lambda: {op: [] for op in OPS})
    victims: list = field(default_factory=list)  # nodes evicted (or states tombstoned) per evict call
    evict_kinds: list = field(default_factory=list)  # per evict call: "kv" (tokens asked) or "mamba"
    evict_freed_kv: list = field(default_factory=list)  # per evict call: whether it deleted a leaf
    match_hits: list = field(default_factory=list)  # per match: whether it hit
    runtime_ns: list = field(default_factory=list)  # per request: Marconi's runtime on the scheduler thread
    choices: list = field(default_factory=list)  # eviction choices the tuner decided, in order
    adopted: list = field(default_factory=list)  # (releases seen, choice) as the cache adopted them at sync points
    late_syncs: int = 0  # sync points that found the tuner behind (the choice in force stayed)
    syncs: int = 0
    tuner_dropped: int = 0

    def runtime_stat(self):
        x = np.asarray(self.runtime_ns, dtype=float) / 1e3
        return (float(np.median(x)), float(np.percentile(x, 99)), len(x)) if len(x) else (math.nan, math.nan, 0)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def stat(self, op):
        if op in ("match:hit", "match:miss"):
            keep = np.asarray(self.match_hits, dtype=bool) == (op == "match:hit")
            x = np.asarray(self.samples["match"], dtype=float)[keep] / 1e3
        elif op in ("evict:kv", "evict:mamba"):
            keep = np.asarray(self.evict_kinds) == op.split(":")[1]
            x = np.asarray(self.samples["evict"], dtype=float)[keep] / 1e3
        elif op in ("evict:mamba-leaf", "evict:mamba-state"):
            keep = (np.asarray(self.evict_kinds) == "mamba") & (
                np.asarray(self.evict_freed_kv, dtype=bool) == (op == "evict:mamba-leaf"))
            x = np.asarray(self.samples["evict"], dtype=float)[keep] / 1e3
        elif op == PER_VICTIM:
            t, v = np.asarray(self.samples["evict"], dtype=float), np.asarray(self.victims, dtype=float)
            x = t[v > 0] / v[v > 0] / 1e3
        else:
            x = np.asarray(self.samples[op], dtype=float) / 1e3
        return (float(np.median(x)), float(np.percentile(x, 99)), len(x)) if len(x) else (math.nan, math.nan, 0)


def _timed(fn, record, clock=time.perf_counter_ns):
    """`fn`, calling `record(nanoseconds)` after each call."""
    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            record(clock() - t0)

    return timed


class _TimeInside:
    """The thread CPU time spent inside `owner.name` (wrapped) since `ns` was last set to 0: the
    part of a step that is not the policy's, subtracted from it."""

    def __init__(self, owner, name: str):
        self.ns = 0
        setattr(owner, name, _timed(getattr(owner, name), self._add, clock=time.thread_time_ns))

    def _add(self, ns: int) -> None:
        self.ns += ns


class Probe:
    """Exclusive timings: an operation's sample excludes the outermost evictions and the pool
    tensor operations (`allocator.free`, `MambaPool.copy_from`) made inside it; an eviction's
    sample excludes the pool operations inside it. Pool time is summed separately."""

    def __init__(self, cc, cell: Cell):
        self.cell, self.depth, self.excluded_ns, self.pool_ns, self.victims = cell, 0, 0, 0, 0
        for name in ("evict", "evict_for_alloc"):
            setattr(cc.cache, name, self._wrap_evict(getattr(cc.cache, name)))
        cc.cache._evict_device_next_node = self._count_victims(cc.cache._evict_device_next_node)
        cc.allocator.free = self._wrap_pool(cc.allocator.free)
        pool = cc.req_to_token_pool.mamba_pool
        pool.copy_from = self._wrap_pool(pool.copy_from)
        slots = cc.req_to_token_pool.mamba_allocator
        slots.free = self._wrap_pool(slots.free)
        runtime = getattr(cc, "runtime", None)
        if runtime is not None:
            runtime.on_release = self._time_runtime(runtime.on_release)

    def _time_runtime(self, fn):
        # What Marconi's runtime costs the scheduler thread per request: figures, and with tuning
        # the hand-over to the shadow tuner and the read of its choice (inside `release`'s time too).
        return _timed(fn, self.cell.runtime_ns.append)

    def _wrap_pool(self, fn):
        return _timed(fn, self._add_pool_time)

    def _add_pool_time(self, dt: int) -> None:
        self.pool_ns += dt
        self.excluded_ns += dt

    def _count_victims(self, fn):
        # One eviction step: a leaf to delete (node id) or one in-place mutation (a tombstone).
        def counted_step(*args, **kwargs):
            node_id, made_progress = fn(*args, **kwargs)
            self.victims += node_id is not None or made_progress
            return node_id, made_progress

        return counted_step

    def _wrap_evict(self, fn):
        def timed_evict(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            self.victims = 0
            x0 = self.excluded_ns
            t0 = time.perf_counter_ns()
            try:
                result = fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                self.depth -= 1
                self.cell.samples["evict"].append(dt - (self.excluded_ns - x0))
                self.cell.victims.append(self.victims)
                params = args[0] if args else kwargs.get("params")
                self.cell.evict_kinds.append("kv" if getattr(params, "num_tokens", 0) else "mamba")
                self.excluded_ns = x0 + dt
            self.cell.evicted_tokens += result.num_tokens_evicted
            self.cell.evicted_states += result.mamba_num_evicted
            self.cell.evict_freed_kv.append(result.num_tokens_evicted > 0)
            return result

        return timed_evict

    def op(self, name, fn, *args, **kwargs):
        x0 = self.excluded_ns
        t0 = time.perf_counter_ns()
        result = fn(*args, **kwargs)
        self.cell.samples[name].append(time.perf_counter_ns() - t0 - (self.excluded_ns - x0))
        return result


def build(config: str, kv_size: int, mamba_size: int, max_context_len: int, extra_buffer: bool = False,
          chunk: int | None = None):
    """upstream: `build_cache` on either tree core; marconi: what `--radix-cache-backend marconi`
    builds (our components + admission + cache class + runtime), alpha fixed or tuned by the
    shadow tuner's background process (started, as in a server, before the first request).
    `chunk`: the server's `--chunked-prefill-size`, the prefill chunk `serve` runs (the backtrack
    rule reads it: never more states than upstream keeps)."""
    from sglang_cpu import build_cache, build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    kw = dict(kv_size=kv_size, mamba_size=mamba_size, max_num_reqs=2, max_context_len=max_context_len,
              extra_buffer=extra_buffer, chunked_prefill_size=chunk)
    if config == "lru-py":
        return build_cache(**kw)
    if config == "lru-rust":
        return build_cache(tree_core_backend="rust", **kw)
    alpha = float(config.removeprefix("marconi-a")) if config.startswith("marconi-a") and config != "marconi-auto" else None
    config_ = MarconiServingConfig(alpha=alpha, admission=config != "marconi-evict", tune_workers=1,
                                   eviction="coverage" if config == "marconi-coverage" else "marconi")
    cc, runtime = build_marconi_serving(config_, **kw)
    cc.settings = runtime.settings
    cc.runtime = runtime
    deadline = time.monotonic() + 60
    while runtime.tuner is not None and not runtime.tuner.ready and time.monotonic() < deadline:
        time.sleep(0.01)  # a server's tuner starts with the scheduler, before any request
    return cc


def serve(cc, probe: Probe, r, chunk: int | None, chunk_end) -> int:
    """One request through the scheduler's calls (see the module docstring); returns the hit."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.allocation import alloc_token_slots
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang_cpu import _chunk_end, _extend, _track_extend, make_request, track_decode_span

    cache, pool = cc.cache, cc.req_to_token_pool
    outputs = r.output_tokens.tolist()
    req = make_request(r.input_tokens.tolist(), len(outputs))
    probe.op("match", req.init_next_round_input, cache)
    hit = req.prefix_len
    probe.cell.match_hits.append(hit > 0)
    n = r.input_len
    while True:
        end = n if chunk is None else min(req.prefix_len + chunk, n)
        if chunk_end is not None:
            end = _chunk_end(cc, chunk_end, req, end)  # extra_buffer: the mode's snapshot grid
        _extend(cc, req, end)
        if cache.enable_mamba_extra_buffer:
            _track_extend(cc, req)  # which state of this extend the forward pass snapshots
        if end == n:
            break
        probe.op("checkpoint", checkpoint_kv_cache, req, cache)
    req.output_ids.append(outputs[0])
    req.update_finish_state()
    if not req.finished():
        probe.op("checkpoint", checkpoint_kv_cache, req, cache)  # after the first token
        pos, extra = req.kv.kv_committed_len, len(outputs) - 1
        loc = alloc_token_slots(cache, extra)
        pool.write((req.kv.req_pool_idx, slice(pos, pos + extra)), loc)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + extra
        if cache.enable_mamba_extra_buffer:
            track_decode_span(cc, req, pos, pos + extra)  # the decode snapshots those steps take
        req.output_ids.extend(outputs[1:])
        req.update_finish_state()
    if req.finished_reason is None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    probe.op("release", release_kv_cache, req, cache, checkpoint=True)
    return hit


def run_cell(config, kv_size, mamba_size, info: TraceInfo, chunk, profile, bar, extra_buffer=False) -> Cell:
    from sglang_marconi.policy.tuning.shadow_tuner import choice_label
    from sglang_marconi.serving.admission import chunk_end_for_branch

    cell = Cell(config, kv_size, mamba_size)
    cc = build(config, kv_size, mamba_size, max(4096, 2 * info.longest), extra_buffer, chunk)
    cell.backend = cc.cache._tree_core_backend
    probe = Probe(cc, cell)
    chunk_end = chunk_end_for_branch if config.startswith("marconi") and config != "marconi-evict" else None
    gc.collect()
    t0 = time.perf_counter()
    for r in info.requests:
        hit = serve(cc, probe, r, chunk, chunk_end)
        cell.hit_tokens += hit
        cell.input_tokens += r.input_len
        cell.flops_saved += profile.prefill_flops(0, hit) if hit else 0.0
        cell.requests += 1
        if bar is not None:
            bar.update(1)
    runtime = getattr(cc, "runtime", None)
    if runtime is not None:
        runtime.close()  # waits for the shadow tuner to observe what it was fed
        if runtime.tuner is not None:
            cell.choices = [choice_label(c) for _, c in (runtime.tuner_log.decisions if runtime.tuner_log else [])]
            cell.tuner_dropped = runtime.tuner.dropped
            cell.adopted = [(n, choice_label(c)) for n, c in runtime.adoptions]
            cell.late_syncs, cell.syncs = runtime.sync_waits_late, runtime.released // runtime.sync_every
    cell.wall_s = time.perf_counter() - t0
    cell.pool_s = probe.pool_ns / 1e9
    cc.check_no_leak()
    cell.states_end = cc.cache.mamba_evictable_size() + cc.cache.mamba_protected_size()
    if getattr(cc, "settings", None) is not None:
        assert cc.settings.counters.stale_repairs == 0
    return cell


def warm_up(chunk):
    """First calls pay one-off costs (torch kernels, imports): pay them outside the timings."""
    from sglang_marconi.sim.synthetic import generate

    info = describe(list(generate("lmsys", sessions=2, scale=0.1)))
    for config in CONFIGS:
        run_cell(config, 4096, 16, info, chunk, _profile(), None)


def keep_malloc_arenas() -> None:
    """Ask glibc to serve large blocks from the heap and keep freed memory (no mmap/munmap and
    page faults per call): SGLang's CPU allocator concatenates its whole free list on every
    free, and without this its cost swings by 10x from run to run. Ignored off glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def _profile():
    from sglang_marconi.policy.cost.model_profile import load_profile

    return load_profile("nemotron-h-8b")


# -- reporting -----------------------------------------------------------------------------------

def ratio(a, b):
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def like_ratio(c, b, op) -> str:
    (m, _, n), (bm, _, bn) = c.stat(op), b.stat(op)
    return ratio(m, bm) if min(n, bn) >= MIN_SAMPLES else "-"


def us(stat):
    med, p99, n = stat
    return "-" if not n else f"{med:.0f} ({p99:.0f})"


def tuner_drops(c: Cell) -> str:
    """What the tuned cell's cache did with the tuner's decisions: requests the tuner dropped, the
    choices adopted at sync points (at release n), and the sync points that found the tuner behind (a
    replay with no forward pass between requests can outrun it: the choice in force stays)."""
    notes = [f"{c.tuner_dropped} dropped"] if c.tuner_dropped else []
    if c.adopted:
        notes.append("in force: " + ", ".join(f"{label} @{n}" for n, label in c.adopted))
    if c.late_syncs:
        notes.append(f"{c.late_syncs} of {c.syncs} syncs late")
    return f" ({'; '.join(notes)})" if notes else ""


def tree_us_per_request(c: Cell) -> float:
    return sum(sum(c.samples[op]) for op in OPS) / 1e3 / max(c.requests, 1)


def table(name, desc, info: TraceInfo, cells: list[Cell], chunk) -> str:
    lines = [
        f"### {name}: {desc}",
        "",
        f"{len(info.requests):,} requests, {info.input_tokens:,} input tokens, infinite-cache bound "
        f"{100 * info.infinite_hit:.2f}%, footprint {info.unique_tokens:,} tokens; prefill chunk "
        f"{chunk or 'none'}.",
        "",
        "| KV tokens / Mamba slots | config | hit % | hit vs py | FLOPs saved (PFLOP) | FLOPs vs py "
        "| states / req | match µs | checkpoint µs | release µs | evict µs (calls) | victims / call "
        "| evict µs / victim | median vs py: match / ckpt / release / evict call / evict victim "
        "| like for like vs py: match hit / miss, evict kv / mamba (leaf / state) "
        "| tree µs / req (vs py) | vs rust | runtime µs / req (p99) | choices | pool ops s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base, rust = {}, {}
    expected_core = {"lru-rust": "rust"}
    for c in cells:
        key = (c.kv_size, c.mamba_size)
        if c.config == "lru-py":
            base[key] = c
        if c.config == "lru-rust":
            rust[key] = c
        b = base[key]
        st = {op: c.stat(op) for op in (*OPS, PER_VICTIM)}
        bst = {op: b.stat(op) for op in (*OPS, PER_VICTIM)}
        ratios = " / ".join(ratio(st[op][0], bst[op][0]) for op in (*OPS, PER_VICTIM))
        per_call = f"{np.mean(c.victims):.1f}" if c.victims else "-"
        like = [like_ratio(c, b, op) for op in
                ("match:hit", "match:miss", "evict:kv", "evict:mamba", "evict:mamba-leaf", "evict:mamba-state")]
        like = f"{like[0]} / {like[1]}, {like[2]} / {like[3]} ({like[4]} / {like[5]})"
        config = c.config if c.backend == expected_core.get(c.config, "python") else f"{c.config} (core: {c.backend}!)"
        tree, btree = tree_us_per_request(c), tree_us_per_request(b)
        lines.append(
            f"| {c.kv_size:,} / {c.mamba_size:,} | {config} | {100 * c.hit_rate:.2f} "
            f"| {ratio(c.hit_rate, b.hit_rate)} | {c.flops_saved / 1e15:.2f} | {ratio(c.flops_saved, b.flops_saved)} "
            f"| {c.states_end / c.requests:.2f} | {us(st['match'])} | {us(st['checkpoint'])} | {us(st['release'])} "
            f"| {us(st['evict'])} ({st['evict'][2]:,}) | {per_call} | {us(st[PER_VICTIM])} | {ratios} | {like} "
            f"| {tree:.0f} ({ratio(tree, btree)}) | {ratio(tree, tree_us_per_request(rust[key])) if key in rust else '-'} "
            f"| {us(c.runtime_stat())} | {' > '.join(c.choices) or '-'}{tuner_drops(c)} "
            f"| {c.pool_s:.2f} | {c.wall_s:.1f} |"
        )
    return "\n".join(lines)


def targets(results) -> str:
    """Hit rate >= upstream (both cores) in every cell; per-op median (as issued, like for like,
    and by victim kind) and tree time per request <= 1.2x lru-py."""
    hit_miss, op_miss, tree_miss, cells, checked = [], [], [], 0, 0
    views = {LIKE_FOR_LIKE: ([], [0]), BY_VICTIM_KIND: ([], [0])}
    for name, (_, _, cells_of) in results.items():
        if name not in TARGET_TRACES:
            continue
        base = {(c.kv_size, c.mamba_size): c for c in cells_of if c.config == "lru-py"}
        rust = {(c.kv_size, c.mamba_size): c for c in cells_of if c.config == "lru-rust"}
        for c in cells_of:
            if not c.config.startswith("marconi"):
                continue
            cells += 1
            key = (c.kv_size, c.mamba_size)
            up = max(base[key].hit_rate, rust[key].hit_rate)
            if c.hit_rate + 1e-12 < up:
                hit_miss.append(f"{name} {key[0]:,}/{key[1]:,} {c.config}: {100 * c.hit_rate:.2f}% < {100 * up:.2f}%")
            tree, btree = tree_us_per_request(c), tree_us_per_request(base[key])
            if tree > 1.2 * btree:
                tree_miss.append(f"{name} {key[0]:,}/{key[1]:,} {c.config}: {tree / btree:.2f}x")
            for op in (*OPS, PER_VICTIM):
                m, bm = c.stat(op)[0], base[key].stat(op)[0]
                if math.isnan(m) or math.isnan(bm):
                    continue
                checked += 1
                if m > 1.2 * bm:
                    op_miss.append(f"{name} {key[0]:,}/{key[1]:,} {c.config} {op}: {m / bm:.2f}x")
            for view, (misses, checked_in_view) in views.items():
                for op in view:
                    (m, _, n), (bm, _, bn) = c.stat(op), base[key].stat(op)
                    if min(n, bn) < MIN_SAMPLES:
                        continue
                    checked_in_view[0] += 1
                    if m > 1.2 * bm:
                        misses.append(f"{name} {key[0]:,}/{key[1]:,} {c.config} {op}: {m / bm:.2f}x")
    out = [auto_targets(results)]
    out.append(f"- hit rate >= upstream (max of lru-py, lru-rust): {cells - len(hit_miss)} of {cells} Marconi cells")
    out += [f"  - missed: {m}" for m in hit_miss]
    out.append(f"- per-operation median <= 1.2x lru-py: {checked - len(op_miss)} of {checked} (cell, op) pairs")
    out += [f"  - missed: {m}" for m in op_miss]
    for view, label in ((LIKE_FOR_LIKE, "like for like"), (BY_VICTIM_KIND, "by victim kind")):
        misses, (checked_in_view,) = views[view]
        out.append(f"- {label} ({', '.join(view)}; each vs lru-py's median of the same kind, where both have "
                   f"{MIN_SAMPLES}+): {checked_in_view - len(misses)} of {checked_in_view} (cell, op) pairs <= 1.2x")
        out += [f"  - missed: {m}" for m in misses]
    out.append(f"- tree time per request <= 1.2x lru-py: {cells - len(tree_miss)} of {cells} Marconi cells")
    out += [f"  - missed: {m}" for m in tree_miss]
    return "\n".join(out)


def cells_by_pools(results, only_targets: bool = True):
    """(trace name, KV size, Mamba size, {config: cell}) for each pool-size cell of each trace
    (of TARGET_TRACES only, with `only_targets`)."""
    for name, (_, _, cells_of) in results.items():
        if only_targets and name not in TARGET_TRACES:
            continue
        by = {}
        for c in cells_of:
            by.setdefault((c.kv_size, c.mamba_size), {})[c.config] = c
        for (kv, mamba), row in by.items():
            yield name, kv, mamba, row


def gain_targets(results) -> str:
    """marconi-auto >= upstream (the better core) + 3 points wherever upstream is below 90%."""
    misses, checked = [], 0
    for name, kv, mamba, row in cells_by_pools(results):
        up = max(row[k].hit_rate for k in ("lru-py", "lru-rust") if k in row)
        auto = row.get("marconi-auto")
        if auto is None or up >= GAIN_BELOW:
            continue
        checked += 1
        if auto.hit_rate < up + GAIN_POINTS:
            misses.append(f"{name} {kv:,}/{mamba:,}: auto {100 * auto.hit_rate:.2f}% vs upstream {100 * up:.2f}%")
    out = [f"- marconi-auto >= upstream + {100 * GAIN_POINTS:g} points where upstream < {100 * GAIN_BELOW:g}%: "
           f"{checked - len(misses)} of {checked} cells"]
    out += [f"  - missed: {m}" for m in misses]
    # SGLang PR #38000's rule, served (`--marconi-eviction coverage`), with Marconi's admission
    behind, compared = [], 0
    for name, kv, mamba, row in cells_by_pools(results, only_targets=False):
        auto, coverage = row.get("marconi-auto"), row.get("marconi-coverage")
        if auto is None or coverage is None:
            continue
        compared += 1
        if auto.hit_rate < coverage.hit_rate - COVERAGE_SLACK:
            behind.append(f"{name} {kv:,}/{mamba:,}: auto {100 * auto.hit_rate:.2f}% vs coverage "
                          f"{100 * coverage.hit_rate:.2f}%")
    out.append(f"- marconi-auto >= marconi-coverage - {100 * COVERAGE_SLACK:g} points: {compared - len(behind)} of "
               f"{compared} cells")
    return "\n".join(out + [f"  - missed: {m}" for m in behind])


AUTO_SLACK = 0.01  # marconi-auto may trail the best of lru-py, marconi-a0 and -a1 by 1 point of hit rate
RUNTIME_MEDIAN_US = 20.0


def auto_targets(results) -> str:
    """marconi-auto >= best of (lru-py, marconi-a0, marconi-a1) - 1 point; Marconi's runtime on the
    scheduler thread < 20 µs per request at the median (tuned configs); cache time per request
    (match + checkpoint + release + evict) <= lru-rust's, for every Marconi config."""
    quality, runtime, per_request = [], [], []
    n_auto = n_tuned = n_ours = 0
    for name, kv, mamba, row in cells_by_pools(results):
        where = f"{name} {kv:,}/{mamba:,}"
        auto = row.get("marconi-auto")
        if auto is not None:
            n_auto += 1
            best = max((row[k] for k in ("lru-py", "marconi-a0", "marconi-a1") if k in row), key=lambda c: c.hit_rate)
            if auto.hit_rate < best.hit_rate - AUTO_SLACK:
                quality.append(f"{where}: auto {100 * auto.hit_rate:.2f}% < {best.config} "
                               f"{100 * best.hit_rate:.2f}% - 1 (choices {' > '.join(auto.choices) or '-'})")
        for c in row.values():
            if c.config in ("marconi-auto", "marconi-evict"):
                n_tuned += 1
                med = c.runtime_stat()[0]
                if not med < RUNTIME_MEDIAN_US:
                    runtime.append(f"{where} {c.config}: {med:.1f} µs")
            if c.config.startswith("marconi") and "lru-rust" in row:
                n_ours += 1
                mine, theirs = tree_us_per_request(c), tree_us_per_request(row["lru-rust"])
                if mine > theirs:
                    per_request.append(f"{where} {c.config}: {mine:.0f} vs {theirs:.0f} µs ({mine / theirs:.2f}x)")
    out = [f"- marconi-auto >= best of lru-py, marconi-a0, marconi-a1 - 1 point: {n_auto - len(quality)} of {n_auto} cells"]
    out += [f"  - missed: {m}" for m in quality]
    out.append(f"- runtime on the scheduler thread < {RUNTIME_MEDIAN_US:g} µs per request (median, tuned configs): "
               f"{n_tuned - len(runtime)} of {n_tuned} cells")
    out += [f"  - missed: {m}" for m in runtime]
    out.append(f"- cache time per request (match + checkpoint + release + evict) <= lru-rust: "
               f"{n_ours - len(per_request)} of {n_ours} Marconi cells")
    out += [f"  - missed: {m}" for m in per_request]
    return "\n".join(out)


JSON_OPS = tuple(dict.fromkeys((*OPS, PER_VICTIM, *LIKE_FOR_LIKE, *BY_VICTIM_KIND)))


# -- one SWA eviction step against the tree's size ---------------------------------------------

SWA_CONFIGS = ("upstream", "marconi")
SWA_TREES = {  # tree family -> request generator in sglang_swa_cpu
    "chat": "session_requests",  # multi-turn sessions: earlier windows go stale, Marconi frees those first
    "branchy": "branch_requests",  # single-turn branches with branch-point windows: nothing stale, every step ranks
}


@dataclass
class SWAStepCell:
    config: str
    tree: str
    nodes: int
    requests: int = 0
    insert_us: float = 0.0  # thread CPU µs per insert while growing the tree (Marconi: with its upkeep)
    first_ms: float = 0.0  # the first eviction
    whole_tree_ms: float = math.nan  # Marconi: the from-scratch plan on this tree (a step without incremental upkeep)
    step_ns: list = field(default_factory=list)
    kinds: list = field(default_factory=list)  # Marconi: the victim kind of each step
    visited: list = field(default_factory=list)  # Marconi: tree nodes the plan read per step

    def stat(self, kind=None):
        x = np.asarray([t for t, k in zip(self.step_ns, self.kinds or [None] * len(self.step_ns))
                        if kind is None or k == kind], dtype=float) / 1e3
        return (float(np.median(x)), float(np.percentile(x, 99)), len(x)) if len(x) else (math.nan, math.nan, 0)


def swa_step_cell(config: str, tree: str, nodes: int, steps: int, window: int, seed: int) -> SWAStepCell:
    """Grow SGLang's real SWA cache (upstream's or Marconi's) to `nodes` nodes with the requests of
    `tree` (`SWA_TREES`: the same tree for both), then time `steps` calls of
    `cache.evict(swa_num_tokens=1)`, each one SWA eviction step (a tombstone or a leaf deletion),
    less the pool frees it drains (SGLang's CPU allocator copies its whole free list per free).
    Times are the thread's CPU time (`time.thread_time_ns`): other processes on a shared machine
    do not inflate them. The pools' spare slots but 4,096 are held while timing, so that those
    free-list copies stay small: copying megabytes per step would flush the CPU caches and time
    cold caches more than either policy (on a GPU the pools live on the device)."""
    import sglang_swa_cpu

    cell = SWAStepCell(config, tree, nodes)
    cc = sglang_swa_cpu.build_swa_cache(kv_size=80 * nodes + 4096, swa_size=40 * nodes + 4096, window=window,
                                        marconi=config == "marconi")
    t0 = time.thread_time_ns()
    requests = getattr(sglang_swa_cpu, SWA_TREES[tree])(window, seed)
    cell.requests = sglang_swa_cpu.grow_tree(cc, nodes, requests)
    cell.insert_us = (time.thread_time_ns() - t0) / 1e3 / cell.requests
    cell.nodes = len(cc.tree_core._node_arena) - 1
    drained = _TimeInside(cc.cache, "_drain_device_frees")
    t0 = time.thread_time_ns()
    cc.evict_swa(1)
    cell.first_ms = (time.thread_time_ns() - t0) / 1e6
    held = [(a, a.alloc(a.available_size() - 4096))
            for a in (cc.allocator.full_attn_allocator, cc.allocator.swa_attn_allocator)]
    figures = cc.settings.figures if cc.settings is not None else None
    gc.collect()
    for _ in range(steps):
        before = dict(vars(figures)) if figures is not None else None
        visited = cc.plan.visited if cc.plan is not None else 0
        drained.ns = 0
        t = time.thread_time_ns()
        cc.evict_swa(1)
        cell.step_ns.append(time.thread_time_ns() - t - drained.ns)
        if figures is not None:
            cell.kinds.append(next((k.removeprefix("evictions_") for k, v in vars(figures).items()
                                    if k.startswith("evictions_") and v != before[k]), "none"))
            cell.visited.append(cc.plan.visited - visited)
    if config == "marconi":  # for reference: the victims computed from the whole tree at once
        from sglang_marconi.serving.swa_component import plan_victims

        t0 = time.thread_time_ns()
        plan_victims(cc.tree_core, sglang_swa_cpu.SWA, sglang_swa_cpu.FULL, cc.settings,
                     cc.tree_core.evictable_device_leaves)
        cell.whole_tree_ms = (time.thread_time_ns() - t0) / 1e6
    for allocator, slots in held:
        allocator.free(slots)
    cc.check_no_leak()
    if cc.settings is not None:
        assert cc.settings.faulted is None, cc.settings.faulted
    return cell


def swa_step_table(cells: list, window: int, steps: int) -> str:
    lines = [
        f"### One SWA eviction step against the tree's size (window {window}, {steps} steps per tree; "
        "thread CPU µs, pool frees excluded)",
        "",
        "| tree | nodes | inserts | upstream µs / step (p99) | marconi µs / step (p99) | marconi vs upstream "
        "| marconi by victim: stale / window / leaf / fallback µs (steps) | plan nodes read / step: median (max) "
        "| first eviction ms: upstream / marconi | insert µs (incl. pool ops): upstream / marconi "
        "| whole-tree plan ms (a step without incremental upkeep) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {}
    for c in cells:
        by.setdefault((c.tree, c.nodes), {})[c.config] = c
    for (tree, nodes), row in by.items():
        up, ours = row["upstream"], row["marconi"]
        kinds = " / ".join(f"{ours.stat(k)[0]:.0f} ({ours.stat(k)[2]})" if ours.stat(k)[2] else "-"
                           for k in ("stale", "window", "leaf", "fallback"))
        seen = np.asarray(ours.visited) if ours.visited else np.zeros(1)
        lines.append(f"| {tree} | {nodes:,} | {ours.requests:,} | {us(up.stat())} | {us(ours.stat())} "
                     f"| {ratio(ours.stat()[0], up.stat()[0])} | {kinds} | {np.median(seen):.0f} ({seen.max():.0f}) "
                     f"| {up.first_ms:.1f} / {ours.first_ms:.1f} | {up.insert_us:.0f} / {ours.insert_us:.0f} "
                     f"| {ours.whole_tree_ms:.0f} |")
    return "\n".join(lines)


def swa_step_bench(trees, sizes, steps: int, window: int, seed: int, bar=None) -> str:
    for tree in trees:  # first calls pay one-off costs (imports, torch kernels): outside the table
        for config in SWA_CONFIGS:
            swa_step_cell(config, tree, 300, 20, window, seed)
    cells = []
    for tree in trees:
        for nodes in sizes:
            row = [swa_step_cell(config, tree, nodes, steps, window, seed) for config in SWA_CONFIGS]
            assert len({(c.nodes, c.requests) for c in row}) == 1, "the two caches grew different trees"
            cells += row
            if bar is not None:
                bar.update(1)
    return swa_step_table(cells, window, steps)


# -- one host-tier step (HiCache write_back) against the tree's size --------------------------------

HOST_CONFIGS = ("upstream", "marconi")
HOST_TOKENS_PER_REQUEST = 6  # the fresh tail of each request: ~2 nodes per request (a split, a leaf)


@dataclass
class HostStepCell:
    config: str
    nodes: int
    requests: int = 0
    host_only: int = 0  # nodes whose KV is on the host only
    grow_s: float = 0.0
    device_ns: list = field(default_factory=list)
    host_ns: list = field(default_factory=list)
    whole_tree_ms: float = math.nan  # Marconi: the host candidates from scratch (a step without incremental upkeep)

    def stat(self, which):
        x = np.asarray(self.device_ns if which == "device" else self.host_ns, dtype=float) / 1e3
        return (float(np.median(x)), float(np.percentile(x, 99)), len(x)) if len(x) else (math.nan, math.nan, 0)


def host_requests(seed: int):
    """Branching traffic without end: each request repeats a random earlier request up to a random
    cut and appends fresh tokens (a split and a leaf), so the tree grows by ~2 nodes per request."""
    import random

    rng, counter, seen = random.Random(seed), iter(range(1, 1 << 40)), []
    while True:
        base = rng.choice(seen) if seen else []
        tokens = base[:rng.randint(0, len(base))] + [next(counter) for _ in range(HOST_TOKENS_PER_REQUEST)]
        seen.append(tokens)
        if len(seen) > 4096:
            seen.pop(rng.randrange(len(seen)))
        yield tokens


def host_step_cell(config: str, nodes: int, steps: int, seed: int, requests: int | None = None) -> HostStepCell:
    """Grow SGLang's real HiCache write_back cache (upstream's or Marconi's host tier) to `nodes`
    nodes with `host_requests` (or serve exactly `requests` of them: the two rules keep different
    trees from the same stream), the host pools sized to fill on the way,
    then time `steps` calls of each: `cache.evict(num_tokens=1)` (one device eviction with the host
    full: a demotion whose host copy needs room; Marconi's ranked admission) and
    `cache.evict_host(1, FULL)` (one host eviction: upstream's LRU host leaf, Marconi's ranked
    victim). Thread CPU µs, pool frees (`_apply_eviction_result`) excluded: the same tensor work in
    both and device work on a GPU."""
    from hicache_cpu import attach_hicache
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang_cpu import FULL, build_cache, build_marconi_serving
    from test_host_tier_served import serve as serve_request

    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.serving.host_tier import attach_host_tier

    # host pools (HiCache's ratio of the device's) holding ~4 KV tokens and ~1/2 SSM state per node
    kv_size, mamba_size = 4096, 512
    ratio = max(2.0, 4 * nodes / kv_size)
    cell = HostStepCell(config, nodes)
    if config == "marconi":
        cc, _ = build_marconi_serving(MarconiServingConfig(alpha=1.0, tune_workers=0), kv_size=kv_size,
                                      mamba_size=mamba_size)
        attach_hicache(cc, ratio=ratio)
        tier = attach_host_tier(cc.cache, cc.settings.profile)
    else:
        cc, tier = attach_hicache(build_cache(kv_size=kv_size, mamba_size=mamba_size), ratio=ratio), None
    arena = cc.tree_core._node_arena
    t0 = time.perf_counter()
    for tokens in host_requests(seed):
        serve_request(cc, tokens, n_out=1, check_device_index=False)
        cell.requests += 1
        if (cell.requests >= requests) if requests is not None else (len(arena) - 1 >= nodes):
            break
    cell.grow_s = time.perf_counter() - t0
    cell.nodes = len(arena) - 1
    cell.host_only = sum(1 for n in arena.values() if n.parent is not None
                         and n.component_data[FULL].value is None and n.component_data[FULL].host_value is not None)
    applied = _TimeInside(cc.cache, "_apply_eviction_result")
    gc.collect()
    for record, step in ((cell.device_ns, lambda: cc.cache.evict(EvictParams(num_tokens=1))),
                         (cell.host_ns, lambda: cc.cache.evict_host(1, FULL))):
        for _ in range(steps):
            applied.ns = 0
            t = time.thread_time_ns()
            step()
            cc.cache.check_hicache_events()
            record.append(time.thread_time_ns() - t - applied.ns)
    if tier is not None:
        assert cc.cache.marconi.faults.fallen_back is None, cc.cache.marconi.faults.fallen_back
        t0 = time.thread_time_ns()
        tier.brute_force_entries()
        cell.whole_tree_ms = (time.thread_time_ns() - t0) / 1e6
    return cell


def host_step_table(cells: list, steps: int) -> str:
    lines = [
        f"### One host-tier step against the tree's size (HiCache write_back, {steps} steps each; thread CPU µs, "
        "pool frees excluded)",
        "",
        "| nodes: upstream / marconi | host-only nodes: upstream / marconi | requests "
        "| device eviction, host full: upstream µs (p99) | marconi µs (p99) "
        "| marconi vs upstream | host eviction: upstream µs (p99) | marconi µs (p99) | marconi vs upstream "
        "| whole-tree host candidates ms (a step without incremental upkeep) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by, up = {}, None
    for c in cells:
        if c.config == "marconi":
            by[up.nodes] = {"upstream": up, "marconi": c}
        else:
            up = c
    for row in by.values():
        up, ours = row["upstream"], row["marconi"]
        lines.append(f"| {up.nodes:,} / {ours.nodes:,} | {up.host_only:,} / {ours.host_only:,} | {ours.requests:,} "
                     f"| {us(up.stat('device'))} "
                     f"| {us(ours.stat('device'))} | {ratio(ours.stat('device')[0], up.stat('device')[0])} "
                     f"| {us(up.stat('host'))} | {us(ours.stat('host'))} "
                     f"| {ratio(ours.stat('host')[0], up.stat('host')[0])} | {ours.whole_tree_ms:.0f} |")
    return "\n".join(lines)


def host_step_bench(sizes, steps: int, seed: int, bar=None) -> str:
    for config in HOST_CONFIGS:  # first calls pay one-off costs (imports, torch kernels): outside the table
        host_step_cell(config, 200, 10, seed)
    cells = []
    for nodes in sizes:
        up = host_step_cell("upstream", nodes, steps, seed)
        cells += [up, host_step_cell("marconi", nodes, steps, seed, requests=up.requests)]  # the same stream
        if bar is not None:
            bar.update(1)
    return host_step_table(cells, steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small traces, two pool sizes (~25 s)")
    ap.add_argument("--traces", default="agent,chat,mooncake,mooncake-blocks,stress,reasoning")
    ap.add_argument("--mamba-radix-cache-strategy", default="no_buffer,extra_buffer",
                    help="SGLang's Mamba cache strategies to run: no_buffer, extra_buffer (the GPU default), or both "
                         "(the default)")
    ap.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens (0: no chunking)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (2 on this 2-core VM adds ms-scale stalls to tiny CPU tensor ops)")
    ap.add_argument("--json", type=Path, help="write every cell's numbers here")
    ap.add_argument("--tree-nodes", help="instead of the traces: one SWA eviction step's and one host-tier step's "
                                         "cost on trees of these sizes (comma-separated node counts, e.g. "
                                         "1500,6000,24000,96000), upstream's and Marconi's on the same trees")
    ap.add_argument("--swa-steps", type=int, default=200, help="eviction steps timed per tree (--tree-nodes)")
    ap.add_argument("--swa-window", type=int, default=32, help="sliding window in tokens (--tree-nodes)")
    ap.add_argument("--swa-trees", default=",".join(SWA_TREES), help="tree families (--tree-nodes): "
                    + "; ".join(f"{k}: sglang_swa_cpu.{v}" for k, v in SWA_TREES.items()))
    ap.add_argument("--host-steps", type=int, default=100,
                    help="host-tier steps timed per tree and kind (--tree-nodes; 0: no host-tier rows)")
    ap.add_argument("--tree-kinds", default="swa,host",
                    help="which steps --tree-nodes times: swa (SWA eviction), host (HiCache write_back host tier)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_MININTERVAL", "1")
    chunk = args.chunk_size or None
    fractions = (0.25, 1.0) if args.quick else (0.1, 0.25, 0.5, 1.0, 2.0)
    all_traces = traces(args.quick)
    chosen = [t for t in args.traces.split(",") if t]
    unknown = set(chosen) - set(all_traces)
    if unknown:
        ap.error(f"unknown traces {sorted(unknown)}; known: {list(all_traces)}")

    import torch

    torch.set_num_threads(args.torch_threads)
    keep_malloc_arenas()
    if args.tree_nodes:
        sizes = [int(n) for n in args.tree_nodes.split(",") if n]
        t_start = time.perf_counter()
        trees = [t for t in args.swa_trees.split(",") if t]
        unknown = set(trees) - set(SWA_TREES)
        if unknown:
            ap.error(f"unknown trees {sorted(unknown)}; known: {list(SWA_TREES)}")
        kinds = {k for k in args.tree_kinds.split(",") if k}
        if kinds - {"swa", "host"}:
            ap.error(f"--tree-kinds {args.tree_kinds!r}: expected swa, host or both")
        bar = tqdm(total=len(sizes) * (len(trees) * ("swa" in kinds) + ("host" in kinds)), desc="trees", unit="tree", file=sys.stderr) if tqdm else None
        tables = []
        if "swa" in kinds:
            tables.append(swa_step_bench(trees, sizes, args.swa_steps, args.swa_window, seed=0, bar=bar))
        if "host" in kinds and args.host_steps:
            tables.append(host_step_bench(sizes, args.host_steps, seed=0, bar=bar))
        step_table = "\n\n".join(tables)
        if bar is not None:
            bar.close()
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}; wall {time.perf_counter() - t_start:.0f} s\n")
        print(step_table)
        return 0
    profile = _profile()
    t_start = time.perf_counter()
    warm_up(chunk)
    plan = {}
    for name in chosen:
        desc, scale, make = all_traces[name]
        info = describe(make())
        plan[name] = (desc, info, pool_sizes(info, fractions, scale, profile))
    given = args.mamba_radix_cache_strategy
    strategies = ["no_buffer", "extra_buffer"] if given == "both" else [m for m in given.split(",") if m]
    if not strategies or set(strategies) - {"no_buffer", "extra_buffer"}:
        ap.error(f"--mamba-radix-cache-strategy {args.mamba_radix_cache_strategy!r}: expected no_buffer, "
                 "extra_buffer, both, or the two comma-separated")
    total = sum(len(info.requests) * len(sizes) * len(CONFIGS) for _, info, sizes in plan.values()) * len(strategies)
    bar = tqdm(total=total, desc="replay", unit="req", file=sys.stderr, mininterval=1) if tqdm else None
    by_mode = {}
    for mode in strategies:
        results = by_mode[mode] = {}
        for name, (desc, info, sizes) in plan.items():
            cells = []
            for kv, mamba in sizes:
                for config in CONFIGS:
                    if bar is not None:
                        bar.set_postfix_str(f"{mode} {name} {kv}/{mamba} {config}")
                    cells.append(run_cell(config, kv, mamba, info, chunk, profile, bar, mode == "extra_buffer"))
            results[name] = (desc, info, cells)
    if bar is not None:
        bar.close()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}; wall {time.perf_counter() - t_start:.0f} s\n")
    for mode, results in by_mode.items():
        print(f"## --mamba-radix-cache-strategy {mode}\n")
        for name, (desc, info, cells) in results.items():
            print(table(name, desc, info, cells, chunk), "\n")
        print(f"Targets, {mode} (over {', '.join(TARGET_TRACES)}):\n" + targets(results) + "\n" + gain_targets(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({mode: {
            name: {"description": desc, "requests": len(info.requests), "input_tokens": info.input_tokens,
                   "infinite_hit_rate": info.infinite_hit, "cells": [
                       {"config": c.config, "backend": c.backend, "kv_size": c.kv_size, "mamba_size": c.mamba_size,
                        "hit_rate": c.hit_rate, "flops_saved": c.flops_saved, "states_end": c.states_end,
                        "requests": c.requests, "evicted_tokens": c.evicted_tokens, "evicted_states": c.evicted_states,
                        "wall_s": c.wall_s, "runtime_us": c.runtime_stat()[:2], "choices": c.choices,
                        "tuner_dropped": c.tuner_dropped, "adopted": c.adopted, "late_syncs": c.late_syncs,
                        "syncs": c.syncs, "tree_us_per_request": tree_us_per_request(c),
                        **{f"{op}_us": c.stat(op)[:2] for op in JSON_OPS},
                        **{f"{op}_n": c.stat(op)[2] for op in JSON_OPS}} for c in cells]}
            for name, (desc, info, cells) in results.items()} for mode, results in by_mode.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

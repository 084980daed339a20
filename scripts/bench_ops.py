"""Operation-cost benchmark of the policy core: microseconds per lookup (match + speculative
insertion), admit (insert), and eviction (per evicted node) on trees of 1k, 10k and 100k nodes;
and the cross-kind choice of one byte budget (`candidate_index.lowest_across`, KV leaves and SSM
states ranked together) beside one index's choice (`CandidateIndex.lowest`) at the same sizes.

    python scripts/bench_ops.py [--sizes 1000,10000,100000] [--alphas 0,1]

Absolute times depend on the machine (name it when quoting them); the ratios between sizes are
what shows how cost grows with the tree.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

from sglang_marconi.policy.tree.candidate_index import CandidateIndex, lowest_across
from sglang_marconi.policy.rules.eviction import FlopAwareEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.cost.model_profile import load_profile

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def random_sequences(rng, count, pool):
    """Sequences that branch off random earlier ones: each insert adds about two nodes."""
    for _ in range(count):
        if pool and rng.random() < 0.9:
            base = pool[int(rng.integers(len(pool)))]
            cut = int(rng.integers(1, len(base)))
            seq = np.concatenate((base[:cut], rng.integers(0, 2**31, size=int(rng.integers(8, 64)))))
        else:
            seq = rng.integers(0, 2**31, size=int(rng.integers(16, 128)))
        pool.append(seq)
        yield seq


def build(profile, nodes, alpha, rng):
    cache = HybridPrefixCache(profile, 10**18, FlopAwareEviction(alpha))
    pool: list[np.ndarray] = []
    gen = random_sequences(rng, 10**9, pool)
    while cache.tree._next_id - 1 < nodes:  # ids count nodes made; nothing is evicted while building
        seq = next(gen)
        lookup = cache.lookup(seq)
        cache.admit(seq, lookup.checkpoint_at)
    return cache, pool


def timed(fn, repeats):
    samples = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter_ns()
        fn(i)
        samples[i] = (time.perf_counter_ns() - t0) / 1e3
    return samples


def bench(size, alpha, profile, repeats):
    rng = np.random.default_rng(size)
    cache, pool = build(profile, size, alpha, rng)
    n_nodes = sum(1 for _ in cache.tree.nodes())
    probes = [pool[int(i)] for i in rng.integers(len(pool), size=repeats)]
    lookups = {}
    match_us = timed(lambda i: lookups.__setitem__(i, cache.lookup(probes[i])), repeats)
    candidates = len(cache.index)
    evict_us = timed(lambda i: cache.evict(cache.eviction.choose(cache.index)), min(repeats, n_nodes // 10))
    fresh = list(random_sequences(rng, repeats, pool))
    insert_us = timed(lambda i: cache.admit(fresh[i], cache.lookup(fresh[i]).checkpoint_at), repeats)
    cache.check_invariants()
    return n_nodes, candidates, match_us, insert_us, evict_us


def choice_across_kinds(size, alpha, repeats):
    """Median microseconds of one choice over two indexes of `size` candidates each (one byte
    budget), and of one choice over one index of `size`, in the same run."""
    rng = np.random.default_rng(size)
    indexes = []
    for _ in range(2):
        index = CandidateIndex()
        for i in range(size):
            index.add(i, float(rng.random()), float(rng.random()))
        indexes.append(index)
    across = timed(lambda i: lowest_across(indexes, alpha), repeats)
    one = timed(lambda i: indexes[0].lowest(alpha), repeats)
    return float(np.median(across)), float(np.median(one))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--alphas", default="0,1")
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args(argv)
    profile = load_profile("paper-7b")
    sizes = [int(s) for s in args.sizes.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, numpy {np.__version__}; median (p99) microseconds per operation\n")
    print("| nodes | eviction candidates | alpha | lookup | admit | evict (per node) | evict vs smallest tree |")
    print("|---|---|---|---|---|---|---|")
    base: dict[float, float] = {}
    cells = [(s, a) for s in sizes for a in alphas]
    for size, alpha in (tqdm(cells, desc="trees", leave=False, file=sys.stderr) if tqdm else cells):
        n_nodes, cands, m, ins, ev = bench(size, alpha, profile, args.repeats)
        med = lambda x: f"{np.median(x):.1f} ({np.percentile(x, 99):.1f})"
        base.setdefault(alpha, float(np.median(ev)))
        print(f"| {n_nodes:,} | {cands:,} | {alpha:g} | {med(m)} | {med(ins)} | {med(ev)} "
              f"| {np.median(ev) / base[alpha]:.1f}x |", flush=True)
    print("\n| candidates per kind | alpha | choice across both kinds µs | one kind's choice µs | ratio |")
    print("|---|---|---|---|---|")
    for size, alpha in cells:
        across, one = choice_across_kinds(size, alpha, min(args.repeats, 500))
        print(f"| {size:,} | {alpha:g} | {across:.1f} | {one:.1f} | {across / one:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

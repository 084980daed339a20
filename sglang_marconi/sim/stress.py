"""A chain / fan-out stress in the shape of SGLang's own radix-cache fuzz benchmark
(`bench_unified_radix_cache.py`, written from its description, not its code): every sequence
extends an earlier one, half of them one at a time (chains), half in bursts of 2-10 children of
one parent (fan-outs); all share one short root prefix; arrival order is shuffled, so a child
may come before its parent. A hard case for a hybrid cache: branch points lie anywhere, and the
first sight of one finds no state there.
"""

from __future__ import annotations

import random

import numpy as np

from sglang_marconi.sim.workload import ListWorkload, Request


def chain_fanout(n: int, *, chunk: int = 256, vocab: int = 32000, output_tokens: int = 4,
                 seed: int = 42) -> ListWorkload:
    """`n` requests; a child adds 1..`chunk` fresh tokens to its parent; each decodes
    `output_tokens` tokens (fresh ids, never shared)."""
    rng = random.Random(seed)
    seqs = [[rng.randint(1, vocab) for _ in range(max(1, chunk // 4))]]
    for _ in range(n // 2):  # chains
        seqs.append(rng.choice(seqs) + [rng.randint(1, vocab) for _ in range(rng.randint(1, chunk))])
    left = n - n // 2
    while left > 0:  # fan-outs
        fan = min(rng.randint(2, 10), left)
        parent = rng.choice(seqs)
        for _ in range(fan):
            seqs.append(parent + [rng.randint(1, vocab) for _ in range(rng.randint(1, chunk))])
        left -= fan
    seqs = seqs[1:]  # the root prefix alone is not a request
    rng.shuffle(seqs)
    out = vocab + 1
    requests = []
    for i, seq in enumerate(seqs):
        requests.append(Request(f"stress-{i}", 0, float(i), np.asarray(seq, dtype=np.int64),
                                np.arange(out, out + output_tokens, dtype=np.int64)))
        out += output_tokens
    return ListWorkload(f"chain-fanout:{n}", requests)

"""Request streams (session id, input tokens, output tokens) for the shadow tuner's tests: each
made to exercise one part of the tuner (contention, branches, sampling, the guard, the prior)."""

import numpy as np

from sglang_marconi.policy.tuning.sampling import session_in_sample


def contended_requests(n, seed=0):
    """One long valuable prefix revisited rarely, many short one-off requests in between."""
    rng = np.random.default_rng(seed)
    long_prefix = np.arange(10_000, 10_300)
    for i in range(n):
        if i % 7 == 0:
            yield f"long-{i % 3}", np.concatenate((long_prefix, rng.integers(0, 50, 5))), np.array([1, 2])
        else:
            yield f"short-{i}", rng.integers(100, 10_000, size=int(rng.integers(20, 60))), np.array([3])


def conversations(n, sessions=12, seed=1):
    """Multi-turn sessions over a shared prompt: branches, splits and single-child evictions."""
    rng = np.random.default_rng(seed)
    prompt = np.arange(50_000, 50_040)
    history = {s: np.concatenate((prompt, rng.integers(0, 500, 10))) for s in range(sessions)}
    for _ in range(n):
        s = int(rng.integers(sessions))
        inp = np.concatenate((history[s], rng.integers(0, 500, int(rng.integers(1, 30)))))
        out = rng.integers(0, 500, int(rng.integers(1, 8)))
        history[s] = np.concatenate((inp, out))
        if len(history[s]) > 400:  # a session ends; a new one starts from the prompt
            history[s] = np.concatenate((prompt, rng.integers(0, 500, 10)))
        yield f"s{s}", inp, out


def session_ids(inside: bool, rate: float, prefix: str):
    """Endless session ids that a hash sample at `rate` keeps (inside) or drops."""
    i = 0
    while True:
        sid, i = f"{prefix}{i}", i + 1
        if session_in_sample(sid, rate) == inside:
            yield sid


def misleading_sample(n, rate, seed=0):
    """A quarter of the traffic, exactly the sessions the tuner's sample keeps, revisits a long prefix
    among one-off requests (value-first eviction wins there); the rest, which the sample never sees,
    are long one-shot documents and short questions on three shared prompts (recency wins)."""
    rng = np.random.default_rng(seed)
    inside, outside = session_ids(True, rate, "s"), session_ids(False, rate, "o")
    long_prefix = np.arange(10_000, 10_120)
    prompts = [np.arange(20_000 + 1000 * k, 20_040 + 1000 * k) for k in range(3)]
    for i in range(n):
        if i % 4 == 0:
            if i % 16 == 0:
                yield next(inside), np.concatenate((long_prefix, rng.integers(0, 50, 5))), np.array([1])
            else:
                yield next(inside), rng.integers(100, 10_000, size=int(rng.integers(20, 60))), np.array([3])
        elif i % 4 == 1:
            yield next(outside), rng.integers(10**6, 2 * 10**6, size=int(rng.integers(150, 300))), np.array([5])
        else:
            yield next(outside), np.concatenate((prompts[int(rng.integers(3))], rng.integers(3 * 10**6, 4 * 10**6, 8))), \
                np.array([7])


def shift_to_recency(n_each, seed=0):
    """contended_requests (value-first wins), then questions on shared prompts among long
    one-shot documents (recency wins)."""
    yield from contended_requests(n_each, seed)
    rng = np.random.default_rng(seed + 1)
    prompts = [np.arange(20_000 + 1000 * k, 20_040 + 1000 * k) for k in range(3)]
    for i in range(n_each):
        if i % 3 == 0:
            yield f"doc-{i}", rng.integers(10**6, 2 * 10**6, size=int(rng.integers(150, 300))), np.array([5])
        else:
            yield f"q-{i}", np.concatenate((prompts[int(rng.integers(3))], rng.integers(3 * 10**6, 4 * 10**6, 8))), \
                np.array([7])


def revisits(n, every, seed=0):
    """A 300-token prefix revisited every `every` requests (and right away once: the second visit
    checkpoints its branch, the third hits), one-off requests of 50-100 tokens between."""
    rng = np.random.default_rng(seed)
    prefix = np.arange(10_000, 10_300)
    for i in range(n):
        if i % every == 0 or i == 1:
            yield f"long-{i}", np.concatenate((prefix, rng.integers(0, 50, 5))), np.array([1, 2])
        else:
            yield f"short-{i}", rng.integers(100, 10_000, size=int(rng.integers(50, 100))), np.array([3])


def branching(n, seed=0, alphabet=4, prompts=6):
    """Short sequences over a tiny alphabet after a few shared prompts: many near-identical
    prefixes, so edges split, merge and get revisited at every depth; some inputs repeat exactly
    (a prefix used twice in a row: probation), some end inside an existing edge."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, alphabet, int(rng.integers(5, 60))) for _ in range(prompts)]
    previous = None
    for i in range(n):
        if previous is not None and rng.random() < 0.15:
            inp = previous  # the same input again, another reply
        else:
            base = bases[int(rng.integers(prompts))]
            cut = int(rng.integers(1, len(base) + 1))
            inp = np.concatenate((base[:cut], rng.integers(0, alphabet, int(rng.integers(0, 25)))))
        out = rng.integers(0, alphabet, int(rng.integers(0, 6)))
        previous = inp
        yield f"b{int(rng.integers(40))}", inp, out


def agent_sessions(n, sessions=20, seed=0):
    """Agent-like sessions: each turn resends the whole history plus a tool result; sessions end
    and new ones start from one of two system prompts."""
    rng = np.random.default_rng(seed)
    systems = [np.arange(70_000, 70_080), np.arange(80_000, 80_030)]
    history, starts = {}, 0
    for _ in range(n):
        s = int(rng.integers(sessions))
        if s not in history or len(history[s]) > 900:
            starts += 1
            history[s] = np.concatenate((systems[starts % 2], rng.integers(0, 10**5, int(rng.integers(5, 40)))))
        inp = np.concatenate((history[s], rng.integers(0, 10**5, int(rng.integers(10, 80)))))
        out = rng.integers(0, 10**5, int(rng.integers(1, 30)))
        history[s] = np.concatenate((inp, out))
        yield f"agent{s}-{starts}", inp, out


def extending_sessions(rng):
    """Requests (input, output) of six conversations that extend their last sequence, restart now
    and then, and end past 120 tokens; drawn from `rng` one request at a time."""
    sessions = {}
    while True:
        k = int(rng.integers(6))
        if k not in sessions or rng.random() < 0.15:
            sessions[k] = rng.integers(0, 1000, 15)
        inp = np.concatenate((sessions[k], rng.integers(0, 1000, int(rng.integers(1, 8)))))
        out = rng.integers(0, 1000, 3)
        sessions[k] = np.concatenate((inp, out))
        if len(sessions[k]) > 120:
            del sessions[k]
        yield inp.astype(np.int64), out.astype(np.int64)

"""A chain / fan-out stress in the shape of SGLang's own radix-cache fuzz benchmark
(`bench_unified_radix_cache.py`, written from its description, not its code): every sequence
extends an earlier one, half of them one at a time (chains), half in bursts of 2-10 children of
one parent (fan-outs); all share one short root prefix; arrival order is shuffled, so a child
may come before its parent. A hard case for a hybrid cache: branch points lie anywhere, and the
first sight of one finds no state there.

`agent_backtrack`: coding-agent trajectories that come back to earlier points of themselves (a
retried step, a template that strips earlier reasoning): each step extends the trajectory at a
message boundary, and with probability `backtrack` it first drops back to an earlier boundary
(uniformly chosen). Several trajectories interleave, sharing one system prompt.

`reasoning_chat`: a reasoning model's conversations whose chat template drops each answer's reasoning
from the history (as DeepSeek-R1's and Qwen3's thinking templates do): a turn decodes reasoning, then
its answer, and the next turn's input is the previous input, the answer alone and a new user message.
So every next turn leaves the cached sequence right where the previous input ended: the state a turn
resumes from must have been kept at the end of its predecessor's input, not after its decode.
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


def agent_backtrack(sessions: int = 8, steps: int = 40, *, backtrack: float = 0.3, system: int = 300,
                    task: int = 60, observation: tuple[int, int] = (20, 600), output: tuple[int, int] = (8, 60),
                    max_input: int = 6400, vocab: int = 32000, seed: int = 7) -> ListWorkload:
    """`sessions` trajectories of up to `steps` requests each, interleaved in a seeded random order.
    A request's input is its trajectory's messages so far (system prompt, task, then per step the
    previous answer and a tool observation of `observation` tokens, uniform); it decodes `output`
    tokens (uniform), the next message. With probability `backtrack` a step first returns to a
    uniformly chosen earlier message boundary; a trajectory that would pass `max_input` tokens
    returns to its task instead."""
    if not 0 <= backtrack <= 1:
        raise ValueError(f"backtrack must be a probability, got {backtrack!r}")
    rng = random.Random(seed)
    fresh = iter(range(vocab + 1, 1 << 40))

    def tokens(n: int) -> list[int]:
        return [rng.randint(1, vocab) for _ in range(n)]

    prompt = tokens(system)
    order = [s for s in range(sessions) for _ in range(steps)]
    rng.shuffle(order)
    messages: list[list[list[int]]] = [[prompt, tokens(task)] for _ in range(sessions)]
    answers: list[list[int] | None] = [None] * sessions
    turns = [0] * sessions
    requests = []
    for i, s in enumerate(order):
        msgs = messages[s]
        if answers[s] is not None:
            msgs.append(answers[s])
            msgs.append(tokens(rng.randint(*observation)))
            if rng.random() < backtrack and len(msgs) > 4:
                keep = rng.randrange(2, len(msgs) - 1)  # an earlier boundary: past the task, before the end
                del msgs[keep:]
                msgs.append(tokens(rng.randint(*observation)))
            if sum(map(len, msgs)) > max_input:
                del msgs[2:]
                msgs.append(tokens(rng.randint(*observation)))
        answer = [next(fresh) for _ in range(rng.randint(*output))]
        answers[s] = answer
        requests.append(Request(f"agent-{s}", turns[s], float(i), np.fromiter((t for m in msgs for t in m), np.int64),
                                np.asarray(answer, dtype=np.int64)))
        turns[s] += 1
    return ListWorkload(f"agent-backtrack:{sessions}x{steps},p={backtrack:g}", requests)


def reasoning_chat(sessions: int = 12, turns: int = 10, *, system: int = 400, user: tuple[int, int] = (50, 400),
                   reasoning: tuple[int, int] = (100, 400), answer: tuple[int, int] = (50, 300),
                   vocab: int = 32000, seed: int = 3) -> ListWorkload:
    """`sessions` conversations of `turns` turns each behind one `system` prompt, interleaved in a
    seeded random order. A turn's input is the system prompt, then per earlier turn its user message
    and its answer, then a new user message (`user` tokens, uniform); it decodes `reasoning` tokens,
    then `answer` tokens (uniform), and only the answer goes into the next turn's history."""
    for name, (lo, hi) in (("user", user), ("reasoning", reasoning), ("answer", answer)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)!r}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(1, vocab) for _ in range(n)]

    prompt = tokens(system)
    history = [list(prompt) for _ in range(sessions)]
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)
    fresh = vocab + 1
    turn = [0] * sessions
    requests = []
    for i, s in enumerate(order):
        inp = history[s] + tokens(rng.randint(*user))
        think, said = rng.randint(*reasoning), rng.randint(*answer)
        out = list(range(fresh, fresh + think + said))
        fresh += think + said
        history[s] = inp + out[think:]
        requests.append(Request(f"reasoning-{s}", turn[s], float(i), np.asarray(inp, dtype=np.int64),
                                np.asarray(out, dtype=np.int64)))
        turn[s] += 1
    return ListWorkload(f"reasoning-chat:{sessions}x{turns}", requests)

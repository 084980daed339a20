"""Many users, one system prompt: an SGLang frontend program against any SGLang server.

Every user's question runs under the same long system prompt; each user then forks into parallel
branches (`fork`) that answer in different styles. On a hybrid model this is where prefix caching
needs an SSM state at the end of the shared prompt: with Marconi's admission the server keeps one
there (the branch point), so every later user and every branch skips the shared prefill.

    python examples/system_prompt_users.py --url http://127.0.0.1:30000 --users 8 --branches 2

Prints, per user, the prompt and cached tokens of the question and of each branch, and the token
hit rate over all calls; `--json OUT` writes the same records.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import sglang as sgl

SYSTEM_PROMPT = (
    "you are a helpful assistant for a team that builds serving systems . answer every question with care "
    "and keep replies short . when the user asks for code write it in python and explain each step . "
    "the cache keeps the state of shared prefixes so that later requests skip their prefill . a hybrid "
    "model mixes attention layers with state space layers whose recurrent state is updated in place and "
    "cannot be rolled back , so a hit needs a checkpoint at exactly the matched position . "
) * 2
QUESTIONS = (
    "what is a cache hit ?", "how does the scheduler pick the next request ?", "why is prefill slow ?",
    "where is the radix tree kept ?", "when do we evict a leaf ?", "which layers keep a recurrent state ?",
    "how many slots does the pool have ?", "what does the tree node hold ?", "why do we need two pass prefill ?",
    "what is the token hit rate of this server ?", "how long is the first token latency ?",
    "which request should we drop first ?",
)
STYLES = ("answer in one short line .", "answer with a plan of steps .", "answer with a small table .",
          "answer with code .")


@sgl.function
def ask(s, system_prompt, question, branches, max_tokens):
    s += sgl.system(system_prompt)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))
    forks = s.fork(branches)
    for style, f in zip(STYLES, forks):
        f += sgl.user(style)
        f += sgl.assistant(sgl.gen("styled", max_tokens=max_tokens, temperature=0))
    forks.join()
    return list(forks)  # the branch states, for their meta info (cached tokens)


@dataclass
class Call:
    user: int
    part: str  # "answer" or "branch-K"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


def _call(user: int, part: str, state, name: str) -> Call:
    meta = state.get_meta_info(name)
    return Call(user, part, meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"], state[name])


def run(url: str, users: int = 8, branches: int = 2, max_tokens: int = 12, parallel: int = 1,
        system_prompt: str = SYSTEM_PROMPT) -> list[Call]:
    """Run the program for `users` users (`parallel` at a time); returns every generation call."""
    if not 1 <= branches <= len(STYLES):
        raise ValueError(f"--branches {branches}: must be 1..{len(STYLES)}")
    backend = sgl.RuntimeEndpoint(url)
    arguments = [dict(system_prompt=system_prompt, question=QUESTIONS[i % len(QUESTIONS)] + f" user {i}",
                      branches=branches, max_tokens=max_tokens) for i in range(users)]
    states = ask.run_batch(arguments, backend=backend, num_threads=parallel, progress_bar=users > 4)
    calls = []
    for user, state in enumerate(states):
        if state.error():
            raise RuntimeError(f"user {user}: {state.error()}")
        calls.append(_call(user, "answer", state, "answer"))
        for k, branch in enumerate(state.ret_value):
            calls.append(_call(user, f"branch-{k}", branch, "styled"))
    return calls


def hit_rate(calls: list[Call]) -> float:
    prompt = sum(c.prompt_tokens for c in calls)
    return sum(c.cached_tokens for c in calls) / prompt if prompt else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--branches", type=int, default=2, help=f"parallel branches per user (1..{len(STYLES)})")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--parallel", type=int, default=1, help="users in flight at once")
    p.add_argument("--json", help="write the calls here")
    args = p.parse_args(argv)
    calls = run(args.url, args.users, args.branches, args.max_tokens, args.parallel)
    print(f"{'user':>4} {'call':<9}{'prompt':>7}{'cached':>7}")
    for c in calls:
        print(f"{c.user:>4} {c.part:<9}{c.prompt_tokens:>7}{c.cached_tokens:>7}")
    print(f"token hit rate over {len(calls)} calls: {100 * hit_rate(calls):.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(c) for c in calls], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

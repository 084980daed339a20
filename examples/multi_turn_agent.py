"""A multi-turn tool-using agent: an SGLang frontend program against any SGLang server.

Each agent works on a task for several turns: the model proposes a step, a (simulated, seeded)
tool answers, and the conversation grows. Every turn's prompt is the previous turn's prompt,
the model's reply and the tool's result, so a server that caches the state after the last decoded
token (Marconi's admission) reuses all of the previous turn: `cached_tokens` of turn t+1 covers
the prompt and output of turn t (less the last sampled token, whose KV is computed next turn).

    python examples/multi_turn_agent.py --url http://127.0.0.1:30000 --agents 2 --turns 4

Prints each turn's prompt, cached and completion tokens and the token hit rate; `--json OUT`
writes the records.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from dataclasses import asdict, dataclass

import sglang as sgl

SYSTEM_PROMPT = (
    "you are a code agent . you can call read_file , write_file , list_dir , run_tests , grep and edit . "
    "plan one step at a time , call one tool per step and read its result before the next step . "
)
TASKS = ("fix the failing test in the scheduler", "add a check for a bad value in the cache",
         "find why the hit rate is low", "write a benchmark for the tree")
TOOL_WORDS = ("file", "line", "function", "class", "test", "error", "value", "pass", "fail", "node", "leaf",
              "cache", "tree", "request", "token", "index", "path", "return", "def", "python", "check", "fix")


def tool_result(agent: int, turn: int, action: str, min_words: int = 12, max_words: int = 40) -> str:
    """A deterministic stand-in for a tool's output: seeded by the agent, the turn and the action."""
    rng = random.Random(zlib.crc32(f"{agent}/{turn}/{action}".encode()))
    words = [rng.choice(TOOL_WORDS) for _ in range(rng.randint(min_words, max_words))]
    return "tool result : " + " ".join(words)


@sgl.function
def agent_program(s, agent, system_prompt, task, turns, max_tokens):
    s += sgl.system(system_prompt)
    s += sgl.user(task)
    for t in range(turns):
        s += sgl.assistant(sgl.gen(f"step_{t}", max_tokens=max_tokens, temperature=0))
        s += sgl.user(tool_result(agent, t, s[f"step_{t}"]))


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def run(url: str, agents: int = 2, turns: int = 4, max_tokens: int = 12, parallel: int = 1) -> list[Turn]:
    """Run `agents` agents for `turns` turns each (`parallel` at a time); returns every turn."""
    backend = sgl.RuntimeEndpoint(url)
    arguments = [dict(agent=a, system_prompt=SYSTEM_PROMPT, task=TASKS[a % len(TASKS)] + f" number {a}",
                      turns=turns, max_tokens=max_tokens) for a in range(agents)]
    states = agent_program.run_batch(arguments, backend=backend, num_threads=parallel, progress_bar=agents > 4)
    out = []
    for a, state in enumerate(states):
        if state.error():
            raise RuntimeError(f"agent {a}: {state.error()}")
        for t in range(turns):
            meta = state.get_meta_info(f"step_{t}")
            out.append(Turn(a, t, meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--parallel", type=int, default=1, help="agents in flight at once")
    p.add_argument("--json", help="write the turns here")
    args = p.parse_args(argv)
    turns = run(args.url, args.agents, args.turns, args.max_tokens, args.parallel)
    print(f"{'agent':>5}{'turn':>5}{'prompt':>8}{'cached':>8}{'output':>8}")
    for t in turns:
        print(f"{t.agent:>5}{t.turn:>5}{t.prompt_tokens:>8}{t.cached_tokens:>8}{t.completion_tokens:>8}")
    prompt = sum(t.prompt_tokens for t in turns)
    print(f"token hit rate: {100 * sum(t.cached_tokens for t in turns) / max(1, prompt):.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(t) for t in turns], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

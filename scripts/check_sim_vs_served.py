"""Does the simulator describe the server, request by request?

    python scripts/check_sim_vs_served.py --workload synthetic:lmsys[:key=value,...] | --trace FILE
        --model PROFILE --kv-tokens N (--mamba-slots M | --kind sliding-window --swa-tokens S)
        [--mamba-radix-cache-strategy no_buffer|extra_buffer] [--chunked-prefill-size N]
        [--alpha A|lru|auto|depth:B|coverage] [--probation on|off] [--backtrack-states auto|B] [--shadows]
        [--session-keys in-memory|24h]
        [--limit N] [--json OUT]

Replays one trace (any format the simulator reads, token ids where it has them) twice:

- served: SGLang 0.5.23's real radix cache with the `marconi` backend as the server builds it
  (`tests/serving/sglang_cpu.py`: our FULL/MAMBA components, admission, cache class and runtime;
  the scheduler hooks the plugin registers), each request, naming its trace session as a client
  does (`session_id`: what the tuner samples and clusters by), through the scheduler's calls: match
  with the Mamba copy-on-write, lock, request and KV slot allocation (evicting), prefill in chunks
  of `--chunked-prefill-size` (Marconi's two-pass chunk ends; `checkpoint_kv_cache` after each
  non-final chunk), the first token, `checkpoint_kv_cache`, the decode's KV (one allocation: the
  same victims as one per step), extra_buffer snapshots by SGLang's own bookkeeping,
  `release_kv_cache`. With `--alpha auto` the runtime tunes inline (its shadows on the scheduler
  thread), adopting the tuner's choice at its sync points, as a server does.
- simulated: `python -m sglang_marconi.sim` with the same pools (`--kv-tokens`, `--mamba-slots`,
  the strategy and chunking): `sim/baselines/served.py`, the model in `policy/tree/served_cache.py`.

It prints the share of requests whose hit tokens agree, each side's total hit tokens, and the first
disagreement with its cause (the states each cache held on that request's path, and the evictions
that removed the one the other kept); exit status 0 when >= 99% of requests hit identically and
the totals agree within 0.5%, 1 otherwise.

Client cache hints (`prompt_cache_key` / `prompt_cache_retention`): requests that carry them (a
trace's fields, or `--session-keys RETENTION`: each request keyed by its session, as a client
naming its conversation does) carry them on both sides: served, in SGLang's `kv_hints` envelope on
the scheduler's `Req`, to the ledger the plugin attaches (`serving/cache_hints.py`, the default
`--marconi-hinted-share`); simulated, through `sim/hinted.py`'s `HintedPolicy`. The hint rule is
then part of what must agree request by request.

`--shadows` (a fixed `--alpha`, sample rate 1): a `ShadowTuner` built as the runtime builds it,
given what the live cache was given (`runtime.served_pools`), fed every request; the shadow of the
live cache's choice must predict the live cache's hits within the same bound.

`--kind sliding-window --swa-tokens S` (a profile with sliding-window layers, e.g. gpt-oss-20b):
served is SGLang's SWA cache with the `marconi` backend as its factory builds it (Marconi's SWA
component, cache class and `SWARuntime`; `tests/serving/sglang_swa_cpu.py`), each request through
the scheduler's calls (match with SGLang's SWA validator and branching seqlen, lock, allocation,
prefill chunks, `checkpoint_kv_cache`, decode with the scheduler's out-of-window SWA freeing,
`release_kv_cache`) on a full-KV pool of `--kv-tokens` and an SWA pool of `--swa-tokens`;
simulated is the simulator's `marconi` SWA policy on those two pools as served
(`sim/baselines/swa_radix.served_marconi_swa`, `python -m sglang_marconi.sim --kv-tokens N
--swa-tokens S`), which is also what the SWA runtime's window shadows run. `--shadows`: the window
tuner the runtime builds (`SWARuntime.tuner_spec`), fed every request.

The tiny CPU models (SSM: 8 layers, 2 attention; SWA: 4 layers, 3 sliding) stand in for `--model`,
whose profile prices FLOPs and bytes (what eviction ranks by) and, for SWA, gives the window; pools
are in tokens and slots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "serving"))  # sglang_cpu: SGLang's cache built on CPU

AGREE = 0.99  # share of requests with identical hits
TOTALS = 0.005  # relative difference of total hit tokens


@dataclass
class Side:
    hits: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)  # state depths on each request's input path, before it
    victims: list[tuple[int, str, str, int, int]] = field(default_factory=list)  # (request, pressure, kind, start, end)
    choices: list[tuple[int, str]] = field(default_factory=list)  # (request, choice adopted)


@dataclass
class Report:
    config: dict
    requests: int
    agree: int
    served_hits: int
    sim_hits: int
    input_tokens: int
    first: dict | None
    wall_s: float
    shadow: dict | None = None

    @property
    def share(self) -> float:
        return self.agree / self.requests if self.requests else 1.0

    @property
    def totals_gap(self) -> float:
        return abs(self.sim_hits - self.served_hits) / max(1, self.served_hits)

    @property
    def ok(self) -> bool:
        shadow_ok = self.shadow is None or (self.shadow["share"] >= AGREE and self.shadow["totals_gap"] <= TOTALS)
        return self.share >= AGREE and self.totals_gap <= TOTALS and shadow_ok

    def lines(self) -> list[str]:
        c = self.config
        if c.get("kind") == "sliding-window":
            pools = f"KV {c['kv_tokens']} tokens, SWA {c['swa_tokens']} tokens (window {c['window']}), chunk {c['chunk']}"
        else:
            pools = (f"KV {c['kv_tokens']} tokens, {c['mamba_slots']} Mamba slots, {c['strategy']}, chunk "
                     f"{c['chunk']}")
        out = [f"{c['workload']} on {c['model']}: {self.requests} requests, {self.input_tokens:,} input tokens; "
               f"{pools}, alpha {c['alpha']}, probation {'on' if c['probation'] else 'off'}"
               + (f", backtrack states {c['backtrack_states']}" if c.get("backtrack_states") is not None else ""),
               f"requests with identical hits: {self.agree}/{self.requests} ({100 * self.share:.2f}%)",
               f"total hit tokens: served {self.served_hits:,}, simulated {self.sim_hits:,} "
               f"({100 * self.totals_gap:.3f}% apart; token hit rate served "
               f"{100 * self.served_hits / max(1, self.input_tokens):.2f}%)"]
        if c["alpha"] == "auto":
            out.append(f"choices adopted (request, choice): served {c['served_choices']}, simulated {c['sim_choices']}")
            if c.get("tuner_s"):
                out.append("tuner time per request (its own timing): "
                           + ", ".join(f"{side} {1e3 * s / max(1, self.requests):.2f} ms"
                                       for side, s in c["tuner_s"].items()))
        if c.get("hints"):
            out.append(f"cache hints (granted / kept anyway / refused / replaced / expired): "
                       + "; ".join(f"{side} " + " / ".join(str(v) for v in counts.values())
                                   for side, counts in c["hints"].items()))
        if self.first is None:
            out.append("no disagreement")
        else:
            f = self.first
            out.append(f"first disagreement: request {f['request']}: served hit {f['served']}, simulated {f['sim']}; "
                       f"{f['cause']}")
        if self.shadow is not None:
            s = self.shadow
            out.append(f"tuner's shadow of {s['choice']}: {s['agree']}/{self.requests} requests as the live cache "
                       f"({100 * s['share']:.2f}%), hit tokens {s['hits']:,} ({100 * s['totals_gap']:.3f}% apart)"
                       + (f"; first disagreement at request {s['first']}" if s["first"] is not None else ""))
        out.append(f"{'PASS' if self.ok else 'FAIL'} (>= {100 * AGREE:g}% identical, totals within {100 * TOTALS:g}%)")
        return out


def _served_path(cc, tokens: np.ndarray) -> list[int]:
    """Depths of the Mamba states on `tokens`' path in SGLang's tree (whole edges only)."""
    from sglang_cpu import MAMBA

    node, pos, out = cc.tree_core.root_node, 0, []
    limit = len(tokens) - 1
    while pos < limit:
        child = node.children.get(int(tokens[pos]))
        if child is None:
            break
        key = list(child.key.token_ids)
        if pos + len(key) > len(tokens) or list(tokens[pos: pos + len(key)]) != key:
            break
        node, pos = child, pos + len(key)
        if child.component_data[MAMBA].value is not None:
            out.append(pos)
    return out


def _cause(index: int, served: Side, sim: Side) -> str:
    """Why request `index` hit differently: the states each side held on its path, and the
    evictions that took the deepest one the other side still had."""
    s, m = served.paths[index], sim.paths[index]
    only_served = sorted(set(s) - set(m))
    only_sim = sorted(set(m) - set(s))
    parts = [f"states on its path: served {s[-8:]}, simulated {m[-8:]}"]
    for depth, side, other, label in ((max(only_served, default=None), sim, "served", "the simulator"),
                                      (max(only_sim, default=None), served, "simulated", "SGLang")):
        if depth is None:
            continue
        took = [v for v in side.victims if v[0] < index and v[4] == depth]
        if took:
            r, pressure, kind, start, end = took[-1]
            parts.append(f"{label} evicted the state at {depth} (request {r}, {pressure} pressure, {kind} "
                         f"[{start}, {end}))")
        else:
            parts.append(f"the state at {depth} exists only in the {other} cache (never admitted by {label}, or "
                         f"lost to a split or merge)")
    if [c for c in served.choices if c[0] <= index] != [c for c in sim.choices if c[0] <= index]:
        parts.append(f"choices adopted differ: served {served.choices[:6]}, simulated {sim.choices[:6]}")
    return "; ".join(parts)


def run(requests, profile_name: str, kv_tokens: int, mamba_slots: int, strategy: str = "no_buffer",
        chunk: int | None = None, alpha="auto", probation: bool = True, shadows: bool = False,
        workload_name: str = "?", sync_every: int = 32, backtrack_states: int | None = None) -> Report:
    """Replay `requests` through SGLang's cache and the simulator's model of it; the report.
    Requests that carry cache hints carry them on both sides. `backtrack_states`: B per request
    on both sides (`--marconi-backtrack-states`; None: the rule's default for the strategy)."""
    warnings.filterwarnings("ignore")
    import sglang_cpu  # noqa: F401 (SGLang's Python tree core, set before SGLang loads)

    from sglang_marconi.policy.cost.model_profile import load_profile
    from sglang_marconi.serving.two_pass_prefill import install_two_pass_prefill_hook

    profile = load_profile(profile_name)
    if profile.has_sliding_window or profile.ssm_state_bytes <= 0:
        raise SystemExit(f"{profile_name}: the served-cache model covers SSM hybrids")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_marconi.serving import two_pass_prefill

    hooked = any(h is hook for target, hook in two_pass_prefill._HOOKS for _, h, _ in HookRegistry._hooks.get(target, ()))
    install_two_pass_prefill_hook(apply_now=True)  # what the plugin registers in a scheduler
    try:
        return _run(requests, profile, profile_name, kv_tokens, mamba_slots, strategy, chunk, alpha, probation,
                    shadows, workload_name, sync_every, backtrack_states)
    finally:
        if not hooked:
            two_pass_prefill.uninstall_two_pass_prefill_hook()


def _run(requests, profile, profile_name, kv_tokens, mamba_slots, strategy, chunk, alpha, probation, shadows,
         workload_name, sync_every, backtrack_states) -> Report:
    from sglang_cpu import build_marconi_serving, node_depth, run_request

    from sglang_marconi.policy.tree.served_cache import ServedPools
    from sglang_marconi.policy.tuning.shadow_tuner import LRU, ShadowTuner, choice_label
    from sglang_marconi.serving.admission import chunk_end_for_branch
    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.serving.eviction_settings import MarconiVictim
    from sglang_marconi.serving.runtime import served_pools
    from sglang_marconi.sim.policies import build_policy

    tuned = alpha == "auto"
    # a rule fixed by `--marconi-eviction`: the depth rule (depth:B | depth:auto) or coverage
    fixed_rule = str(alpha).startswith("depth:") or alpha == "coverage"
    choice = None if tuned else (alpha if alpha == LRU or fixed_rule else float(alpha))
    if shadows and (tuned or fixed_rule):
        raise SystemExit("--shadows compares the shadow of a fixed choice with the live cache: give --alpha A or lru")
    config = MarconiServingConfig(alpha=None if tuned else (0.0 if choice == LRU or fixed_rule else choice),
                                  eviction=alpha if fixed_rule else "marconi", probation=probation,
                                  tune_workers=0, tune_sync_every=sync_every,
                                  extra={} if backtrack_states is None else {"backtrack_states": backtrack_states})
    longest = max(r.input_len + r.output_len for r in requests)
    cc, runtime = build_marconi_serving(config, profile=profile, kv_size=kv_tokens, mamba_size=mamba_slots,
                                        max_num_reqs=2, max_context_len=max(4096, 2 * longest),
                                        extra_buffer=strategy == "extra_buffer", chunked_prefill_size=chunk)
    hinted = any(r.prompt_cache_key is not None for r in requests)
    if hinted:  # what the plugin attaches to the cache it builds
        from sglang_marconi.serving.cache_hints import attach_hints

        attach_hints(cc.cache, config)
    if choice == LRU:
        runtime.settings.choice = LRU
    pools = served_pools(cc.cache, config)
    assert pools == ServedPools(kv_tokens, mamba_slots, strategy, chunk, pools.snapshot_step,
                                pools.decode_snapshot_step, pools.tracking_slots, backtrack_states), pools
    served, sim = Side(), Side()
    clock = {"request": 0}

    def observe(victim: MarconiVictim) -> None:
        end = node_depth(victim.node)
        served.victims.append((clock["request"], victim.pressure, victim.kind, end - len(victim.node.key), end))

    runtime.settings.observer = observe
    if fixed_rule:  # the served-cache model under the same rule
        from sglang_marconi.sim.baselines.served import ServedPolicy

        policy = ServedPolicy(alpha, profile, pools, alpha, probation=probation)
    else:
        name = "marconi" if tuned else ("sglang+" if choice == LRU else f"marconi:{choice:g}")
        policy = build_policy(name, profile, 0, served=pools, probation=probation, sync_every=sync_every,
                              tuning=config.tuning() if tuned else None)
    policy.cache.events = []
    serving = policy
    if hinted:
        from sglang_marconi.sim.hinted import HintedPolicy

        serving = HintedPolicy(policy, share=config.hinted_share, horizon=config.hint_horizon)
    tuner = None
    if shadows:
        tuner = ShadowTuner(profile, 1, config.tuning(), probation=probation, served=pools)
        tuner_choice = tuner.choices.index(choice if choice == LRU else choice)
        shadow_hits = []
    started = time.perf_counter()
    adopted = runtime.settings.choice
    for i, r in enumerate(requests):
        clock["request"] = i
        served.paths.append(_served_path(cc, r.input_tokens))
        sim.paths.append(policy.cache.states_on_path(r.input_tokens[: r.input_len - 1]))
        with _carrying_hint(r):
            _, hit = run_request(cc, r.input_tokens.tolist(), r.output_len, chunk_size=chunk,
                                 out_tokens=r.output_tokens.tolist(), chunk_end=chunk_end_for_branch,
                                 decode_at_once=True, session_id=r.session_id)
        served.hits.append(hit)
        if runtime.settings.choice != adopted:
            adopted = runtime.settings.choice
            served.choices.append((i + 1, choice_label(adopted)))
        sim.hits.append(serving.serve(r).hit_tokens)
        if tuner is not None:
            out = r.output_tokens
            tuner.observe(r.session_id, r.input_tokens, out[:-1])
            shadow_hits.append(tuner.last_hits[tuner_choice])
    wall = time.perf_counter() - started
    tuner_s = None
    if tuned:  # the tuner's own timing (`TunerLog.seconds`): the served one runs inline here
        tuner_s = {"served": runtime.tuner.tuner.log.seconds, "simulated": policy.tuner.log.seconds}
    runtime.close()
    cc.check_no_leak()
    hints = None
    if hinted:
        served_ledger = cc.cache.marconi.hints.ledger
        hints = {"served": asdict(served_ledger.counters), "simulated": asdict(serving.ledger.counters)}
    sim.victims = [(e.request, e.pressure, e.kind, e.start, e.end) for e in policy.cache.events]
    sim.choices = [(at, choice_label(c)) for at, c in policy.history[1:]]
    a, b = np.array(served.hits), np.array(sim.hits)
    differ = np.flatnonzero(a != b)
    first = None
    if differ.size:
        i = int(differ[0])
        first = {"request": i, "served": int(a[i]), "sim": int(b[i]), "cause": _cause(i, served, sim)}
    shadow = None
    if tuner is not None:
        h = np.array(shadow_hits)
        d = np.flatnonzero(h != a)
        shadow = {"choice": choice_label(choice), "agree": int((h == a).sum()), "share": float((h == a).mean()),
                  "hits": int(h.sum()), "totals_gap": abs(int(h.sum()) - int(a.sum())) / max(1, int(a.sum())),
                  "first": int(d[0]) if d.size else None}
    return Report(
        config={"workload": workload_name, "model": profile_name, "kv_tokens": kv_tokens, "mamba_slots": mamba_slots,
                "strategy": strategy, "chunk": chunk, "alpha": alpha, "probation": probation,
                "backtrack_states": backtrack_states,
                "served_choices": served.choices, "sim_choices": sim.choices, "hints": hints, "tuner_s": tuner_s},
        requests=len(requests), agree=int((a == b).sum()), served_hits=int(a.sum()), sim_hits=int(b.sum()),
        input_tokens=int(sum(r.input_len for r in requests)), first=first, wall_s=wall, shadow=shadow)


@contextlib.contextmanager
def _carrying_hint(request):
    """While SGLang's `Req` for `request` is made: with the request's cache hint in its `kv_hints`
    envelope, as the server's intake puts it there (`serving/cache_hints.py`)."""
    from sglang_marconi.policy.rules.cache_hints import parse_hint

    hint = parse_hint(request.prompt_cache_key, request.prompt_cache_retention)
    if hint is None:
        yield
        return
    import sglang_cpu
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    from sglang_marconi.serving.cache_hints import with_hint_action

    make_request = sglang_cpu.make_request

    def hinted_request(tokens, n_out):
        req = make_request(tokens, n_out)
        req.kv_hints = decode_kv_hints_envelope(with_hint_action(None, hint))
        return req

    sglang_cpu.make_request = hinted_request
    try:
        yield
    finally:
        sglang_cpu.make_request = make_request


def run_swa(requests, profile_name: str, kv_tokens: int, swa_tokens: int, chunk: int | None = None, alpha="auto",
            shadows: bool = False, workload_name: str = "?", sync_every: int = 32) -> Report:
    """Replay `requests` through SGLang's SWA cache with the `marconi` backend and the simulator's
    served SWA policy (`--kind sliding-window`); the report."""
    warnings.filterwarnings("ignore")
    import dataclasses

    import sglang_swa_cpu  # noqa: F401 (SGLang's Python tree core, set before SGLang loads)
    from sglang_swa_cpu import build_marconi_swa_serving, run_swa_request

    from sglang_marconi.policy.cost.model_profile import load_profile
    from sglang_marconi.policy.tuning.shadow_tuner import choice_label
    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.sim.baselines.swa_radix import served_marconi_swa

    profile = load_profile(profile_name)
    if not profile.has_sliding_window or profile.n_ssm_layers:
        raise SystemExit(f"{profile_name}: --kind sliding-window needs a profile with sliding-window layers and no SSM")
    tuned = alpha == "auto"
    config = MarconiServingConfig(alpha=None if tuned else float(alpha), tune_workers=0, tune_sync_every=sync_every)
    if shadows and tuned:
        raise SystemExit("--shadows compares the shadow of a fixed alpha with the live cache: give --alpha A")
    longest = max(r.input_len + r.output_len for r in requests)
    cc, runtime = build_marconi_swa_serving(config, profile, kv_size=kv_tokens, swa_size=swa_tokens,
                                            max_context_len=max(4096, 2 * longest))
    policy = served_marconi_swa(profile, kv_tokens, swa_tokens, alpha=None if tuned else float(alpha),
                                tuning=config.tuning() if tuned else None, sync_every=sync_every, chunk_size=chunk)
    # SGLang's time counter is process-wide; recency is what the rule ranks by (min-max, where a node never
    # stamped counts 0): start it where the model's starts, as in a freshly started server.
    from sglang.srt.mem_cache.unified_cache.components import base as sglang_components

    sglang_components._LAST_ACCESS_TIME_COUNTER_FLOAT = float(policy.cache.clock)
    tuner = shadow_hits = None
    if shadows:
        spec = runtime.tuner_spec(cc.cache)
        tuner = dataclasses.replace(spec, config=dataclasses.replace(spec.config, sample_rate=1.0)).build()
        tuner_choice = tuner.choices.index(float(alpha))
        shadow_hits = []
    served, sim = Side(), Side()
    evicted_served, evicted_sim = [], []  # evictions so far, before each request
    started = time.perf_counter()
    adopted = runtime.settings.choice
    for i, r in enumerate(requests):
        f, c = cc.settings.figures, policy.cache.counters
        evicted_served.append(f.evictions_stale + f.evictions_window + f.evictions_leaf + f.evictions_fallback)
        evicted_sim.append(c.evictions_stale + c.evictions_window + c.evictions_leaf + c.evictions_fallback)
        served.hits.append(run_swa_request(cc, r.input_tokens.tolist(), r.output_tokens.tolist(), chunk_size=chunk))
        if runtime.settings.choice != adopted:
            adopted = runtime.settings.choice
            served.choices.append((i + 1, choice_label(adopted)))
        sim.hits.append(policy.serve(r).hit_tokens)
        if tuner is not None:
            tuner.observe(r.session_id, r.input_tokens, r.output_tokens[:-1])
            shadow_hits.append(tuner.last_hits[tuner_choice])
    wall = time.perf_counter() - started
    runtime.close()
    cc.check_no_leak()
    sim.choices = [(at, choice_label(a)) for at, a in policy.history[1:]]
    a, b = np.array(served.hits), np.array(sim.hits)
    differ = np.flatnonzero(a != b)
    first = None
    if differ.size:
        i = int(differ[0])
        f = cc.settings.figures
        if evicted_served[i] == evicted_sim[i] == 0:
            cause = "neither cache had evicted: admission or matching differ"
        else:
            cause = (f"evictions before it: served {evicted_served[i]} (SGLang's SWA tree: stale segments, branch "
                     f"windows, leaves by window_plan; all run: stale {f.evictions_stale}, window "
                     f"{f.evictions_window}, leaf {f.evictions_leaf}, fallback {f.evictions_fallback}), simulated "
                     f"{evicted_sim[i]} (the model of that tree: {policy.cache.counters})")
        if [x for x in served.choices if x[0] <= i] != [x for x in sim.choices if x[0] <= i]:
            cause += f"; choices adopted differ: served {served.choices[:6]}, simulated {sim.choices[:6]}"
        first = {"request": i, "served": int(a[i]), "sim": int(b[i]), "cause": cause}
    shadow = None
    if tuner is not None:
        h = np.array(shadow_hits)
        d = np.flatnonzero(h != a)
        shadow = {"choice": choice_label(float(alpha)), "agree": int((h == a).sum()), "share": float((h == a).mean()),
                  "hits": int(h.sum()), "totals_gap": abs(int(h.sum()) - int(a.sum())) / max(1, int(a.sum())),
                  "first": int(d[0]) if d.size else None}
    return Report(
        config={"workload": workload_name, "model": profile_name, "kind": "sliding-window", "kv_tokens": kv_tokens,
                "swa_tokens": swa_tokens, "window": int(profile.sliding_window), "chunk": chunk, "alpha": alpha,
                "probation": False, "served_choices": served.choices, "sim_choices": sim.choices,
                "served_evictions": evicted_served[-1] if requests else 0,
                "sim_evictions": evicted_sim[-1] if requests else 0},
        requests=len(requests), agree=int((a == b).sum()), served_hits=int(a.sum()), sim_hits=int(b.sum()),
        input_tokens=int(sum(r.input_len for r in requests)), first=first, wall_s=wall, shadow=shadow)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a trace file the simulator reads (Marconi JSONL, Mooncake)")
    src.add_argument("--workload", help="synthetic:KIND[:key=value,...] or stress:KIND[:key=value,...]")
    p.add_argument("--mooncake-tokens", default="conversation", choices=("conversation", "blocks"))
    p.add_argument("--model", default="nemotron-h-8b", help="profile pricing FLOPs and bytes (default nemotron-h-8b)")
    p.add_argument("--kv-tokens", type=int, required=True, help="the KV pool, in token slots")
    p.add_argument("--mamba-slots", type=int, help="the Mamba pool, in state slots (--kind ssm)")
    p.add_argument("--mamba-radix-cache-strategy", default="no_buffer", choices=("no_buffer", "extra_buffer"))
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="prefill chunk (default: one extend)")
    p.add_argument("--kind", default="ssm", choices=("ssm", "sliding-window"))
    p.add_argument("--swa-tokens", type=int, help="the SWA KV pool, in token slots (--kind sliding-window)")
    p.add_argument("--alpha", default="auto", help="A (fixed alpha), lru (SGLang's LRU), auto (tuned online), "
                                                  "depth:B / depth:auto (the depth rule, fixed: --marconi-eviction) "
                                                  "or coverage (SGLang #38000's rule: --marconi-eviction coverage)")
    p.add_argument("--probation", default="on", choices=("on", "off"), help="--kind ssm: probationary states")
    p.add_argument("--backtrack-states", default="auto",
                   help="--kind ssm: backtrack states per request on both sides, as --marconi-backtrack-states "
                        "(auto: the rule's default for the strategy; 0: off)")
    p.add_argument("--tune-sync-every", type=int, default=32)
    p.add_argument("--shadows", action="store_true", help="also check the tuner's shadow of the live choice")
    p.add_argument("--session-keys", choices=("in-memory", "24h"),
                   help="key each request by its session (prompt_cache_key) with this retention")
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--json", help="write the report here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    swa = args.kind == "sliding-window"
    if swa and (args.swa_tokens is None or args.mamba_slots is not None):
        parser.error("--kind sliding-window takes --kv-tokens and --swa-tokens (no --mamba-slots)")
    if not swa and (args.mamba_slots is None or args.swa_tokens is not None):
        parser.error("--kind ssm takes --kv-tokens and --mamba-slots (no --swa-tokens)")
    from sglang_marconi.policy.errors import MarconiError
    from sglang_marconi.policy.rules.backtrack_states import parse_backtrack_states

    try:
        backtrack = parse_backtrack_states(args.backtrack_states, "--backtrack-states")
    except MarconiError as exc:
        parser.error(str(exc))
    if swa and backtrack is not None:
        parser.error("--backtrack-states: SSM states (--kind ssm)")
    from sglang_marconi.sim.traces import load_workload

    workload = load_workload(args.trace or args.workload, args.mooncake_tokens)
    if args.session_keys:
        if swa:
            parser.error("--session-keys: the hint rule has no model of the SWA cache (--kind ssm)")
        from sglang_marconi.sim.hinted import with_session_keys

        workload = with_session_keys(workload, args.session_keys)
    requests = list(workload)[: args.limit] if args.limit else list(workload)
    alpha = args.alpha if args.alpha in ("auto", "lru", "coverage") or args.alpha.startswith("depth:") else float(args.alpha)
    name = args.trace or args.workload
    if swa:
        report = run_swa(requests, args.model, args.kv_tokens, args.swa_tokens, args.chunked_prefill_size, alpha,
                         args.shadows, workload_name=name, sync_every=args.tune_sync_every)
    else:
        report = run(requests, args.model, args.kv_tokens, args.mamba_slots, args.mamba_radix_cache_strategy,
                     args.chunked_prefill_size, alpha, args.probation == "on", args.shadows,
                     workload_name=name, sync_every=args.tune_sync_every, backtrack_states=backtrack)
    print("\n".join(report.lines()))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(report) | {"share": report.share, "totals_gap": report.totals_gap,
                                                      "ok": report.ok}, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the end-to-end tests ask a live SGLang server, over its HTTP API."""

from __future__ import annotations

from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 300


@dataclass
class Generation:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # of each output token
    prompt_tokens: int
    cached_tokens: int
    # Each output position's two most likely tokens, best first: (logprob, token id).
    top2: list[list[tuple[float, int]]] = field(default_factory=list)


def generate(url: str, input_ids: list[int], max_new_tokens: int = 8) -> Generation:
    """Greedy generation from token ids (text would be re-tokenised), with output logprobs."""
    return generate_with_meta(url, input_ids, max_new_tokens)[0]


def generate_with_meta(url: str, input_ids: list[int], max_new_tokens: int = 8) -> tuple[Generation, dict]:
    """`generate`, and the response's whole `meta_info`."""
    r = requests.post(url + "/generate", timeout=TIMEOUT_S, json={
        "input_ids": list(input_ids), "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    })
    r.raise_for_status()
    body = r.json()
    meta = body["meta_info"]
    return generation_from(input_ids, body, meta), meta


def generation_from(input_ids: list[int], body: dict, meta: dict) -> Generation:
    """A /generate response (asked with `return_logprob` and `top_logprobs_num` 2) as a Generation."""
    top2 = [[(lp, token) for lp, token, *_ in position[:2]] for position in meta.get("output_top_logprobs") or []]
    return Generation(list(input_ids), body["output_ids"], [lp[0] for lp in meta["output_token_logprobs"]],
                      meta["prompt_tokens"], meta["cached_tokens"], top2)


# --- warm == cold -----------------------------------------------------------------------------
# A hit that reads only prefill-written KV / states runs the same arithmetic as the cold request:
# compared with gap 0 (identical tokens and logprobs). A hit that reads KV or a state written by
# decode steps does not: SGLang's CPU engine computes a decode step's one row with other kernels
# (or other blockings) than a prefill's many, so every later logprob moves by up to a small gap,
# with upstream's cache too. Such a pair is compared with the measured gap of that engine and
# model (`numeric_gap.py` measures it on upstream's server).


@dataclass(frozen=True)
class TieAwareComparison:
    same: bool
    compared: int  # output positions held to equality (all of them, or up to a near-tie flip)
    detail: str

    def __bool__(self) -> bool:
        return self.same


def _top2_of(g: Generation, i: int) -> list[tuple[float, int]]:
    if i >= len(g.top2) or len(g.top2[i]) < 2:
        raise ValueError(f"output position {i} has no top-2 logprobs (ask with top_logprobs_num 2)")
    return g.top2[i]


def same_up_to_numeric_ties(warm: Generation, cold: Generation, gap: float) -> TieAwareComparison:
    """Do `warm` and `cold` (the same input) agree, given that every logprob of one may differ
    from the other's by at most `gap` (0: identical arithmetic)?

    Position by position while the outputs agree, the chosen token's logprobs must be within
    `gap`. At the first position where the tokens differ, that is allowed only as a near tie that
    the gap can flip: each run's top two are the same two tokens {a, b}, and warm's margin
    (a over b) plus cold's margin (b over a) is at most 2 * gap (each of the four logprobs moved
    by at most `gap`). After such a flip the contexts differ, so nothing later is compared."""
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    if warm.input_ids != cold.input_ids:
        return TieAwareComparison(False, 0, "different inputs")
    if len(warm.output_ids) != len(cold.output_ids):
        return TieAwareComparison(False, 0, f"output lengths {len(warm.output_ids)} != {len(cold.output_ids)}")
    for i, (w, c) in enumerate(zip(warm.output_ids, cold.output_ids)):
        if w == c:
            moved = abs(warm.logprobs[i] - cold.logprobs[i])
            if moved > gap:
                return TieAwareComparison(False, i, f"token {i} ({w}): logprob moved by {moved:.3g} > gap {gap}")
            continue
        warm_top, cold_top = _top2_of(warm, i), _top2_of(cold, i)
        if {t for _, t in warm_top} != {w, c} or {t for _, t in cold_top} != {w, c}:
            return TieAwareComparison(False, i, f"token {i}: warm {w}, cold {c}, not each other's runner-up "
                                                f"(warm top-2 {warm_top}, cold top-2 {cold_top})")
        margins = (warm_top[0][0] - warm_top[1][0]) + (cold_top[0][0] - cold_top[1][0])
        if margins > 2 * gap:
            return TieAwareComparison(False, i, f"token {i}: warm {w}, cold {c} with margins {margins:.3g} "
                                                f"> 2 * gap {gap}: not a near tie")
        return TieAwareComparison(True, i, f"near tie flipped at token {i} (margins {margins:.3g})")
    return TieAwareComparison(True, len(warm.output_ids), "identical up to the gap")


def reads_decode_written_kv(hit: Generation, earlier: list[Generation]) -> bool:
    """Whether the cached prefix of `hit` may hold KV or a state that an earlier request wrote in
    a decode step: it reaches into some earlier request's output (conservative: the tree may hold
    another request's prefill-written copy)."""
    return any(min(hit.cached_tokens, common_prefix(hit.input_ids, e.input_ids + e.output_ids)) > len(e.input_ids)
               for e in earlier)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def flush_cache(url: str) -> None:
    # A just-answered request may still be finishing in the scheduler: let the server wait for it.
    requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=TIMEOUT_S).raise_for_status()


def internal_state(url: str) -> dict:
    """The first scheduler's internal state from /server_info."""
    r = requests.get(url + "/server_info", timeout=TIMEOUT_S)
    r.raise_for_status()
    return r.json()["internal_states"][0]


def marconi_figures(url: str) -> dict:
    return internal_state(url)["marconi"]


def metric_samples(url: str):
    """Every sample on /metrics (prometheus_client's parser)."""
    r = requests.get(url + "/metrics", timeout=TIMEOUT_S)
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        yield from family.samples


def labelled_gauge(url: str, name: str, label: str) -> dict[str, float]:
    """One labelled gauge on /metrics (e.g. `sglang:marconi_shadow_score` by `choice`): label -> value."""
    return {s.labels[label]: s.value for s in metric_samples(url) if s.name == name}


def marconi_gauges(url: str) -> dict[str, float]:
    """The `sglang:marconi_*` samples on /metrics, by figure name (`marconi_...`)."""
    return {s.name.removeprefix("sglang:"): s.value for s in metric_samples(url)
            if s.name.startswith("sglang:marconi_")}

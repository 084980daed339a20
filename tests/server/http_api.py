"""What the end-to-end tests ask a live SGLang server, over its HTTP API."""

from __future__ import annotations

from dataclasses import dataclass

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


def generate(url: str, input_ids: list[int], max_new_tokens: int = 8) -> Generation:
    """Greedy generation from token ids (text would be re-tokenised), with output logprobs."""
    return generate_with_meta(url, input_ids, max_new_tokens)[0]


def generate_with_meta(url: str, input_ids: list[int], max_new_tokens: int = 8) -> tuple[Generation, dict]:
    """`generate`, and the response's whole `meta_info`."""
    r = requests.post(url + "/generate", timeout=TIMEOUT_S, json={
        "input_ids": list(input_ids), "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    })
    r.raise_for_status()
    body = r.json()
    meta = body["meta_info"]
    return Generation(list(input_ids), body["output_ids"], [lp[0] for lp in meta["output_token_logprobs"]],
                      meta["prompt_tokens"], meta["cached_tokens"]), meta


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

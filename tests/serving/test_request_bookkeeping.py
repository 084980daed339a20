"""Nothing per request outlives the request: a thousand requests aborted while waiting, aborted
mid-prefill, retracted mid-decode, or finished with `skip_radix_cache_insert`, through the
scheduler's calls on SGLang's real cache with our backend, leave no bookkeeping behind (every KV
page and Mamba slot back, no per-request entry in any Marconi container)."""

import random

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang_cpu import _extend, build_marconi_serving, make_request, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

SHARED = list(range(1, 301))


def prompt(rng):
    """Prefix-sharing prompts: the shared prefix, one of a few branches, a private tail."""
    branch = [1000 + 50 * rng.randrange(4) + j for j in range(40)]
    return SHARED[: rng.choice((100, 300))] + branch + [rng.randrange(5000, 9000) for _ in range(rng.randrange(5, 80))]


def start(cc, tokens, n_out):
    req = make_request(tokens, n_out)
    req.init_next_round_input(cc.cache)  # match_prefix (+ Mamba copy-on-write)
    req.cached_tokens = req.prefix_len
    return req


def aborted_while_waiting(cc, tokens):
    req = start(cc, tokens, 4)
    req.finished_reason = FINISH_ABORT()
    if req.kv.holds_kv or req.kv.holds_mamba:
        release_kv_cache(req, cc.cache, checkpoint=False)


def aborted_mid_prefill(cc, tokens):
    req = start(cc, tokens, 4)
    end = chunk_end_for_branch(req, min(req.prefix_len + 64, len(tokens) - 1))
    if end <= req.prefix_len:
        return aborted_while_waiting(cc, tokens)
    _extend(cc, req, end)
    checkpoint_kv_cache(req, cc.cache)  # a chunk done: stashed as the scheduler does
    req.finished_reason = FINISH_ABORT()
    release_kv_cache(req, cc.cache, checkpoint=False)


def retracted_mid_decode(cc, tokens, *, skip_insert=False):
    req = start(cc, tokens, 8)
    _extend(cc, req, len(req.full_untruncated_fill_ids))
    req.output_ids.append(7)
    checkpoint_kv_cache(req, cc.cache)  # after prefill, before the first decode step
    if skip_insert:  # finished, but not to be kept (SGLang's skip_radix_cache_insert)
        req.skip_radix_cache_insert = True
        req.finished_reason = FINISH_LENGTH(length=1)
        release_kv_cache(req, cc.cache, checkpoint=True)
    else:  # retracted under memory pressure: everything goes back, the request waits again
        release_kv_cache(req, cc.cache, checkpoint=False)


def containers(cc, runtime):
    """Every dict / set / list the Marconi objects hold, by name -> length."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    owners = {"runtime": runtime, "figures": runtime.figures, "settings": runtime.settings,
              "admission": cc.cache.components[ComponentType.MAMBA],
              "full": cc.cache.components[ComponentType.FULL],
              "two_pass": cc.cache.__dict__.get("marconi_two_pass_counters"),
              "index": getattr(cc.cache, "marconi_index", None)}
    sizes = {}
    for name, owner in owners.items():
        for attr, value in vars(owner or object()).items() if owner is not None else ():
            if isinstance(value, (dict, set, list)) and (attr.startswith("_marconi") or name != "admission"):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def test_a_thousand_aborted_and_retracted_requests_leave_nothing_behind():
    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=None, tune_workers=0), kv_size=3000, mamba_size=10)
    rng = random.Random(5)
    paths = (aborted_while_waiting, aborted_mid_prefill, retracted_mid_decode,
             lambda c, t: retracted_mid_decode(c, t, skip_insert=True))
    sizes = []
    for i in range(1000):
        if i % 5 == 0:  # some requests finish normally, so the tree fills and evicts
            run_request(cc, prompt(rng), 4, chunk_end=chunk_end_for_branch)
        paths[i % len(paths)](cc, prompt(rng))
        cc.check_no_leak()
        if i in (199, 999):
            sizes.append(containers(cc, runtime))
    early, late = sizes
    grown = {k: (early.get(k), v) for k, v in late.items() if v > max(early.get(k, 0), 64)}
    assert not grown, grown
    assert not any(k.endswith("_full_kv_hits") for k in late)  # per-request data lives on the Req now
    assert runtime.figures.requests == 200  # only requests released into the tree are counted

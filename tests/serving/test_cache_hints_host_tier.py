"""Retention `24h` on a host tier, at the cache level (SGLang's real HiCache classes on CPU under the
`marconi` backend's cache, `test_host_tier_served.py`): a device leaf a client asked to keep for a
day (`prompt_cache_retention: 24h`, a credit in force) is written back to the host when it leaves
the device, where Marconi's ranked host admission would drop it, and its next turn hits from the
host (`policy/rules/tier_rules.py`, `serving/host_tier.py`, `serving/cache_hints.py`)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import test_host_tier_served as served  # noqa: E402
from test_host_tier_served import _others, marconi_hicache, serve  # noqa: E402

from sglang_marconi.policy.rules.cache_hints import CacheHint  # noqa: E402
from sglang_marconi.serving.cache_hints import attach_hints, with_hint_action  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

_plain_server_args_after = served._plain_server_args_after  # the HiCache arguments do not outlive a test

KEPT = list(range(1, 25))


def _hinted(make_request, retention):
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    def hinted_request(tokens, n_out):
        req = make_request(tokens, n_out)
        req.kv_hints = decode_kv_hints_envelope(with_hint_action(None, CacheHint("conversation", retention)))
        return req

    return hinted_request


@pytest.mark.parametrize("retention", ["24h", "in-memory"])
def test_a_24h_end_leaving_the_device_is_written_back_where_the_ranked_host_would_drop_it(retention, monkeypatch):
    cc, _, tier = marconi_hicache(alpha=0.0)
    hints = attach_hints(cc.cache, MarconiServingConfig(tune_workers=0))
    # the gate open (returns seen losing their prefix: `tests/test_cache_hints.py`), and a contended
    # host on which nothing ranks below a new candidate: the ranked admission refuses every one
    monkeypatch.setattr(hints.ledger._history, "losing", lambda: True)
    monkeypatch.setattr(tier, "host_admits", lambda *args: False)
    with monkeypatch.context() as keyed:
        keyed.setattr(served, "make_request", _hinted(served.make_request, retention))
        serve(cc, KEPT)
    assert hints.ledger.counters.granted == 1
    counters = cc.settings.counters
    for seq in _others(5):  # device pressure: everything older leaves the device, the credited end too
        serve(cc, seq)
    ids = cc.tree_core._node_arena
    credited = hints.ledger.credits()[0].node
    assert ids.get(credited.id) is not credited or credited.component_data[served.FULL].value is None
    answered = KEPT + [10_000_000 + 7 * len(KEPT)]  # what `serve` decoded: its last token is not fed back
    req, host = serve(cc, answered + [7, 8])
    if retention == "24h":  # written back with its state: its next turn loads it back from the host
        assert host == req.cached_tokens == len(answered) and counters.states_demoted >= 1, (host, req.cached_tokens)
    else:  # ranked like any other: refused by the host, dropped
        assert host == 0 and req.cached_tokens == 0 and counters.host_drops >= 1

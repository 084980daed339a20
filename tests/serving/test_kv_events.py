"""SSM-state KV events (`serving/kv_events.py`) against SGLang's real cache on CPU, published
through SGLang's own `SchedulerKvEventsPublisher.publish_kv_events` (with our hook), encoded
as its ZMQ publisher encodes, and rebuilt by `serving/kv_event_view.py`.

After every request the view rebuilt from the events alone must equal the tree's reusable points
(a whole-tree walk), with leaf evictions and single-child tombstones happening on the way, and
must predict each next request's reused prefix exactly."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.kv_events import KVEventBatch  # noqa: E402
from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher  # noqa: E402
from sglang_cpu import CpuCache, build_cache, run_request  # noqa: E402

from sglang_marconi.serving import kv_events  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.kv_event_view import KvEventView, RankView  # noqa: E402


class CollectingPublisher:
    """SGLang's ZmqEventPublisher's encoding (msgspec msgpack of the batch), without a socket."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.payloads: list[bytes] = []

    def publish(self, batch) -> None:
        if batch.attn_dp_rank is None:
            batch.attn_dp_rank = 0
        self.payloads.append(self.encoder.encode(batch))


def events_cache(kv_size=3000, mamba_size=16, **kwargs) -> CpuCache:
    """The `marconi` backend's cache (components, admission, runtime) with KV events on."""
    from sglang_marconi.serving.admission import admission_mixin
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.components import marconi_component_overrides
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings
    from sglang_marconi.serving.plugin import attach_runtime

    config = MarconiServingConfig(alpha=1.0, tune_workers=0)
    settings = MarconiEvictionSettings("nemotron-h-8b", choice=1.0)
    overrides = marconi_component_overrides(settings, mamba_mixins=(admission_mixin(),))
    params = build_cache(component_registry_override=overrides, kv_size=kv_size, mamba_size=mamba_size,
                         return_params=True, **kwargs)
    params.enable_kv_cache_events = True
    cache = marconi_cache_class()(params)
    cc = CpuCache(cache, params.token_to_kv_pool_allocator, params.req_to_token_pool, kv_size, mamba_size, 4)
    cc.settings = settings
    attach_runtime(cache, config)
    return cc


def scheduler_publisher(cc: CpuCache):
    """What SchedulerKvEventsPublisher.publish_kv_events reads, with a collecting publisher."""
    return SimpleNamespace(enable_kv_cache_events=True, tree_cache=cc.cache, kv_event_publisher=CollectingPublisher())


def workload(seed: int, n: int, sessions: int = 4):
    """Multi-turn sessions extending their own history (70%) and one-offs behind two shared
    system prompts (tokens 2..400); a session restarts past 400 tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(2, 400) for _ in range(rng.randrange(40, 90))] for _ in range(2)]
    histories: dict[int, list[int] | None] = {}
    for _ in range(n):
        if rng.random() < 0.7:
            sid = rng.randrange(sessions)
            history = histories.get(sid) or list(rng.choice(systems))
            prompt = history + [rng.randrange(2, 400) for _ in range(rng.randrange(5, 40))]
            histories[sid] = prompt if len(prompt) < 400 else None
        else:
            prompt = rng.choice(systems) + [rng.randrange(2, 400) for _ in range(rng.randrange(10, 60))]
        yield prompt


def publish(pub) -> list[bytes]:
    """One scheduler publish step through SGLang's method (our hook runs after it)."""
    start = len(pub.kv_event_publisher.payloads)
    SchedulerKvEventsPublisher.publish_kv_events(pub)
    return pub.kv_event_publisher.payloads[start:]


def block_hashes_in_tree(cc: CpuCache) -> set[int]:
    recorder = cc.cache.tree_core.kv_events
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    out, stack = set(), list(cc.cache.tree_core.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        out.update(hash_str_to_int64(h) for h in recorder._node_event_hash_values(node))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_view_from_events_equals_tree_after_every_request(seed):
    cc = events_cache()
    pub = scheduler_publisher(cc)
    view, predicted_hits, hits = KvEventView(), [], []
    for tokens in workload(seed, 70):
        predicted = view.rank(0).reusable_prefix_length(tokens[:-1])  # SGLang matches at most len - 1
        _, hit = run_request(cc, tokens, n_out=3)
        predicted_hits.append(predicted)
        hits.append(hit)
        for payload in publish(pub):
            view.apply_payload(payload)
        rank = view.rank(0)
        assert rank.reusable_points() == kv_events.tree_reusable_points(cc.cache)
        assert set(rank.blocks) == block_hashes_in_tree(cc)
        cc.check_no_leak()
    counters = cc.settings.counters
    assert counters.evictions_leaf > 0 and counters.evictions_single_child > 0, counters  # both kinds happened
    assert sum(hits) > 0 and predicted_hits == hits
    # A full-KV router would have believed in more: the gap these events close.
    assert view.rank(0).gaps == 0


def test_sglang_typed_decoder_loses_no_block_batch():
    """SGLang's typed decoder rejects a batch with an unknown tag whole: Marconi's events travel in
    batches of their own, so every block batch still decodes (and only Marconi's are refused)."""
    cc = events_cache()
    pub = scheduler_publisher(cc)
    payloads = []
    for tokens in workload(3, 30):
        run_request(cc, tokens, n_out=3)
        payloads += publish(pub)
    typed = msgspec.msgpack.Decoder(type=KVEventBatch)
    decoded, refused = 0, 0
    for payload in payloads:
        tags = {e["type"] for e in msgspec.msgpack.decode(payload)[1]}
        if tags <= set(kv_events.EVENT_TAGS):
            with pytest.raises(msgspec.ValidationError):
                typed.decode(payload)
            refused += 1
        else:
            assert not tags & set(kv_events.EVENT_TAGS), f"a mixed batch: {tags}"
            typed.decode(payload)
            decoded += 1
    assert decoded > 0 and refused > 0


def test_a_fault_stops_state_events_not_the_scheduler(monkeypatch, caplog):
    cc = events_cache()
    pub = scheduler_publisher(cc)
    run_request(cc, list(range(2, 80)), n_out=3)

    def boom(self, cache):
        raise RuntimeError("injected")

    monkeypatch.setattr(kv_events.ReusablePointTracker, "take", boom)
    with caplog.at_level("WARNING", logger="sglang_marconi"):
        payloads = publish(pub)
    assert any("SSM-state KV events stopped" in r.message for r in caplog.records)
    assert cc.cache.marconi.kv_state_events.fault == "RuntimeError: injected"
    tags = {e["type"] for p in payloads for e in msgspec.msgpack.decode(p)[1]}
    assert "BlockStored" in tags and not tags & set(kv_events.EVENT_TAGS)  # SGLang's events went out
    run_request(cc, list(range(2, 90)), n_out=3)
    assert all(kv_events.EVENT_TAGS[0] not in str(msgspec.msgpack.decode(p)) for p in publish(pub))


def test_switched_off_publishes_sglang_events_only(monkeypatch):
    monkeypatch.setenv(kv_events.SWITCH_ENV, "off")
    cc = events_cache()
    pub = scheduler_publisher(cc)
    run_request(cc, list(range(2, 80)), n_out=3)
    payloads = publish(pub)
    assert payloads and all(b"Marconi" not in p for p in payloads)
    monkeypatch.setenv(kv_events.SWITCH_ENV, "sometimes")
    with pytest.raises(ValueError, match="SGLANG_MARCONI_KV_STATE_EVENTS='sometimes'"):
        kv_events.state_events_enabled()


def test_upstream_cache_gets_no_state_events():
    cc = build_cache()
    pub = SimpleNamespace(enable_kv_cache_events=True, tree_cache=cc.cache, kv_event_publisher=CollectingPublisher())
    run_request(cc, list(range(2, 80)), n_out=3)
    kv_events.publish_state_events(None, pub)
    assert pub.kv_event_publisher.payloads == []


def test_view_refuses_newer_schema_skips_unknown_tags_and_counts_gaps():
    enc = msgspec.msgpack.Encoder()
    view = KvEventView()
    stored = kv_events.MarconiStateStored(kv_events.SCHEMA_VERSION, 7, 1)
    block = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [5],
             "block_size": 1, "lora_id": None}
    view.apply_payload(enc.encode([1.0, [block, {"type": "SomethingNew", "x": 1}], 0]), seq=0)
    view.apply_payload(enc.encode(KVEventBatch(ts=1.0, events=[stored], attn_dp_rank=0)), seq=1)
    assert view.rank(0).reusable_points() == {7: 1}
    assert view.rank(0).reusable_prefix_length([5, 9]) == 1 and view.rank(0).gaps == 0
    view.apply_payload(enc.encode([1.0, [], 0]), seq=5)
    assert view.rank(0).gaps == 1
    newer = {"type": "MarconiStateStored", "schema_version": kv_events.SCHEMA_VERSION + 1, "block_hash": 7,
             "num_tokens": 1}
    with pytest.raises(ValueError, match="schema_version 2 is newer"):
        RankView().apply(newer)
    with pytest.raises(ValueError, match="expected 3 ZMQ frames"):
        view.apply_frames([b"", b"\0" * 8])

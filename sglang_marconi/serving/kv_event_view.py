"""Subscriber side of `kv_events.py`: rebuild, from a server's KV-event stream, where each cached
prefix is reusable (full KV and an SSM state), per DP rank.

    view = KvEventView()
    with KvEventSubscriber(["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]) as sub:  # rank 0, 1
        sub.drain(view, quiet_s=0.2)
    view.ranks[0].reusable_prefix_length(token_ids)   # what a request would really reuse there

SGLang's block events build the token tree (`BlockStored` links each block to its parent by hash),
Marconi's state events mark the blocks where a prefix ends reusably. Decoding is by tag on plain
msgpack (no SGLang import): unknown tags and fields are skipped, so newer servers stay readable;
a `schema_version` newer than this module's is refused in one line. Sequence gaps (a PUB/SUB
drop) are counted per rank (`RankView.gaps`): after one the view may be stale, and a subscriber
should resynchronise (SGLang's replay endpoint, or a cache flush).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec

from sglang_marconi.serving.kv_events import GPU, SCHEMA_VERSION

_DEVICE_MEDIA = (None, GPU)


@dataclass
class RankView:
    """One DP rank's cache as its events describe it."""

    blocks: dict = field(default_factory=dict)  # block_hash -> (parent_hash, tokens)
    children: dict = field(default_factory=dict)  # (parent_hash, tokens) -> block_hash
    states: dict = field(default_factory=dict)  # block_hash -> num_tokens: reusable points
    sizes: set = field(default_factory=set)  # block lengths seen (pages; a node's last may be shorter)
    last_seq: Optional[int] = None
    gaps: int = 0
    counts: dict = field(default_factory=dict)  # event type -> events applied

    def apply(self, event: dict) -> None:
        kind = event.get("type")
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "BlockStored":
            if event.get("medium") not in _DEVICE_MEDIA:
                return
            size, tokens, parent = event["block_size"], event["token_ids"], event.get("parent_block_hash")
            for i, block_hash in enumerate(event["block_hashes"]):
                chunk = tuple(_hashable(t) for t in tokens[i * size:(i + 1) * size])
                self.sizes.add(len(chunk))
                self.blocks[block_hash] = (parent, chunk)
                self.children[(parent, chunk)] = block_hash
                parent = block_hash
        elif kind == "BlockRemoved":
            if event.get("medium") not in _DEVICE_MEDIA:
                return
            for block_hash in event["block_hashes"]:
                known = self.blocks.pop(block_hash, None)
                if known is not None and self.children.get(known) == block_hash:
                    del self.children[known]
                self.states.pop(block_hash, None)  # no KV, no reuse, whatever the state events say
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.children.clear()
            self.states.clear()
        elif kind in ("MarconiStateStored", "MarconiStateRemoved"):
            version = event.get("schema_version")
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise ValueError(f"{kind}: schema_version {version!r} is newer than this subscriber's "
                                 f"{SCHEMA_VERSION}; upgrade sglang-marconi")
            if event.get("medium", GPU) not in _DEVICE_MEDIA:
                return
            if kind == "MarconiStateStored":
                self.states[event["block_hash"]] = event["num_tokens"]
            else:
                self.states.pop(event["block_hash"], None)
        # anything else: an event type this subscriber does not know (skipped on purpose)

    def reusable_points(self) -> dict[int, int]:
        """block_hash -> num_tokens of every point where a prefix is reusable, on a known block."""
        return {h: n for h, n in self.states.items() if h in self.blocks}

    def cached_prefix_length(self, token_ids) -> int:
        """Tokens of `token_ids` whose full KV the events report (what a full-KV router believes)."""
        return self._walk(token_ids)[0]

    def reusable_prefix_length(self, token_ids) -> int:
        """Tokens of `token_ids` a request can really skip: the deepest reusable point on its path."""
        return self._walk(token_ids)[1]

    def _walk(self, token_ids) -> tuple[int, int]:
        parent, pos, reusable = None, 0, 0
        tokens = [_hashable(t) for t in token_ids]
        while pos < len(tokens):
            for size in sorted(self.sizes, reverse=True):
                block_hash = self.children.get((parent, tuple(tokens[pos:pos + size])))
                if block_hash is not None:
                    break
            else:
                break
            parent, pos = block_hash, pos + size
            if block_hash in self.states:
                reusable = pos
        return pos, reusable


@dataclass
class KvEventView:
    """Every rank's view; frames are applied with the rank of the endpoint they came from."""

    ranks: dict = field(default_factory=dict)  # dp rank -> RankView

    def rank(self, dp_rank: int) -> RankView:
        return self.ranks.setdefault(dp_rank, RankView())

    def apply_frames(self, frames, endpoint_rank: int = 0) -> None:
        """One ZMQ message: [topic, 8-byte big-endian sequence number, msgpack KVEventBatch]."""
        if len(frames) != 3:
            raise ValueError(f"expected 3 ZMQ frames (topic, seq, payload), got {len(frames)}")
        seq = int.from_bytes(frames[1], "big", signed=True)
        self.apply_payload(frames[2], seq=seq, endpoint_rank=endpoint_rank)

    def apply_payload(self, payload: bytes, *, seq: Optional[int] = None, endpoint_rank: int = 0) -> None:
        batch = msgspec.msgpack.decode(payload)
        if not isinstance(batch, list) or len(batch) < 2:
            raise ValueError(f"not a KVEventBatch ([ts, events, attn_dp_rank]): {str(batch)[:80]}")
        dp_rank = batch[2] if len(batch) > 2 and batch[2] is not None else endpoint_rank
        view = self.rank(dp_rank)
        if seq is not None:
            if view.last_seq is not None and seq != view.last_seq + 1:
                view.gaps += 1
            view.last_seq = seq
        for event in batch[1]:
            view.apply(event)


class KvEventSubscriber:
    """SUB sockets on the endpoints of ranks 0..n-1 (SGLang offsets rank r's port by r)."""

    def __init__(self, endpoints: Iterable[str], topic: str = ""):
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.sockets = []
        for endpoint in endpoints:
            sock = self.context.socket(zmq.SUB)
            sock.setsockopt_string(zmq.SUBSCRIBE, topic)
            sock.connect(endpoint)
            self.sockets.append(sock)

    def drain(self, view: KvEventView, quiet_s: float = 0.2, max_s: float = 10.0) -> int:
        """Apply every message that arrives until none has for `quiet_s` (at most `max_s`);
        returns the number of messages applied."""
        import time

        poller = self._zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, self._zmq.POLLIN)
        applied, deadline = 0, time.monotonic() + max_s
        while time.monotonic() < deadline:
            ready = dict(poller.poll(int(quiet_s * 1000)))
            if not ready:
                break
            for rank, sock in enumerate(self.sockets):
                while sock in ready and sock.poll(0):
                    view.apply_frames(sock.recv_multipart(), endpoint_rank=rank)
                    applied += 1
        return applied

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _hashable(token):
    return tuple(token) if isinstance(token, list) else token  # bigram pages arrive as pairs

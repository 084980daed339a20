"""Token streams for Mooncake's block-hash traces.

Mooncake publishes each request as the hash ids of its 512-token input blocks plus the input and
output lengths; the tokens are gone. The ids are prefix-chained (an id fixes the whole prefix up
to its block: no id of the conversation trace appears at two positions or after two different
ids), so sharing a block id means sharing everything before it. Two reconstructions:

- ``"blocks"``: block id h becomes tokens h*B + arange(B). Requests share exactly the full blocks
  the trace says they share. But a conversation's next turn re-hashes the previous turn's last,
  partial block (it now holds more text), so it shares only the previous *input's full blocks*:
  never the previous turn's partial tail, never its reply. A cache that keeps state where the
  previous turn ended (SGLang's state after the last decoded token; half of Marconi's admission)
  can then never be hit by the next turn, although in the real token stream the next turn
  starts with the whole previous turn.
- ``"conversation"`` (the default): as ``"blocks"``, and a request is taken as the next turn of
  an earlier one when its ids start with *all* of that request's full-block ids (at least two of
  them, so more than the system-prompt block every request shares: the same conversation) and
  its input is at least that request's input + output long. Its first new blocks then start
  with the earlier request's partial tail and output tokens, as a chat template appends them;
  the rest of a new block is fresh. The latest such request is the parent. A block id keeps the
  content it got when first seen, so every later request sharing the id shares the tokens.
  On the whole conversation trace 3,548 of 12,031 requests continue an earlier one this way.

Output tokens are the caller's (`traces.output_tokens_for`: disjoint from every input token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MODES = ("conversation", "blocks")


@dataclass(frozen=True)
class _Turn:
    input_len: int
    output_len: int
    appended: np.ndarray  # what its next turn starts with after its full blocks: tail + output


class MooncakeTokenizer:
    """Rebuilds token streams request by request, in arrival order (it remembers earlier turns).

    `block_tokens` is the block size of the streams it builds (512 for the real trace; a smaller
    one replays a scaled-down copy, with lengths already scaled by the caller)."""

    def __init__(self, mode: str = "conversation", block_tokens: int = 512):
        if mode not in MODES:
            raise ValueError(f"mooncake token mode {mode!r}: expected one of {list(MODES)}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens {block_tokens}: must be >= 1")
        self.mode, self.block = mode, block_tokens
        self._offsets = np.arange(block_tokens, dtype=np.int64)
        self._content: dict[int, np.ndarray] = {}  # block id -> tokens, where not the default
        self._seen: set[int] = set()
        self._turn_by_last_full_block: dict[int, _Turn] = {}
        self.continuations = 0

    def _default(self, block_id: int) -> np.ndarray:
        return block_id * self.block + self._offsets

    def _parent(self, ids: Sequence[int], input_len: int):
        """The earlier request this one continues, and its full-block count, or (None, 0)."""
        for n_full in range(len(ids), 1, -1):  # ids are prefix-chained: one id names the prefix
            turn = self._turn_by_last_full_block.get(ids[n_full - 1])
            if turn is not None:
                if input_len >= turn.input_len + turn.output_len:
                    return turn, n_full
                return None, 0
        return None, 0

    def input_tokens(self, hash_ids: Sequence[int], input_len: int, output_tokens: np.ndarray) -> np.ndarray:
        """The next request's input tokens (call once per request, in arrival order; its
        `output_tokens` are what a later turn of the conversation would repeat)."""
        ids = [int(h) for h in hash_ids]
        b = self.block
        template, start = None, 0
        if self.mode == "conversation":
            parent, start = self._parent(ids, input_len)
            if parent is not None:
                self.continuations += 1
                template = parent.appended
        parts = []
        for k, h in enumerate(ids):
            content = self._content.get(h)
            if content is None:
                if h not in self._seen and template is not None and (k - start) * b < template.size:
                    head = template[(k - start) * b : (k - start + 1) * b]
                    content = np.concatenate([head, self._default(h)[head.size :]])
                    self._content[h] = content
                else:
                    content = self._default(h)
            self._seen.add(h)
            parts.append(content)
        tokens = np.concatenate(parts)[:input_len] if parts else np.zeros(0, dtype=np.int64)
        n_full = input_len // b
        if n_full >= 2:
            appended = np.concatenate([tokens[n_full * b :], np.asarray(output_tokens, dtype=np.int64)])
            self._turn_by_last_full_block[ids[n_full - 1]] = _Turn(input_len, len(output_tokens), appended)
        return tokens



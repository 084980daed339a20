"""Block-level KV prefix caches replayed over hash-id traces: the attention-model (KV-only) view.

A trace in the Mooncake / vLLM / SGLang ``hash_ids`` format gives each request the ids of its
input blocks (prefix-chained: an id fixes everything before it) and its input length. Replayed
against a plain block cache, a request with ``hash_ids = [h0 .. h(n-1)]`` and ``input_length = L``
hits the largest k such that h0 .. h(k-1) are all resident when it arrives (the scan stops at the
first miss), i.e. ``min(k * block_size, L)`` tokens (the last block may be partial). Then every block
of the request, hit or miss, is accessed against the policy in order: hits update the policy's
state, misses admit the block and may evict (even a block of the same request).

- `base.BlockCache`: the one interface (`resident`, `access`, `capacity`, `evictions`).
- `lru`, `lfu`, `fifo`, `s3fifo`: one policy per module.
- `registry`: policy specs as the CLI reads them (`kv-s3fifo:small_ratio=0.1,max_freq=3`).
- `view`: the hash-id view of a workload (the trace's own ids, or ids derived from tokens).
- `replay`: the replay loop, its invariants and its `RunResult`.
"""

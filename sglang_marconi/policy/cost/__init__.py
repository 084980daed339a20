"""The cost model: model profiles, Hugging Face config reading, and what a token of KV, an SSM state and a
prefill of a span cost in bytes and FLOPs (Eq. 1). Numbers only: no tree, no policy."""

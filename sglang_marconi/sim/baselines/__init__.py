"""Baseline caching policies the simulator compares Marconi against.

- `vllm_plus.VllmPlusCache` ("vllm+"): an SSM checkpoint with every 32-token KV block, LRU.
- `no_cache.NoCache` ("none"): nothing is ever reused.

Import the classes from their modules; this package imports nothing on its own.
"""

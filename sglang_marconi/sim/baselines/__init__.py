"""Baseline caching policies the simulator compares Marconi against, and the offline bound.

- `vllm_plus.VllmPlusCache` ("vllm+"): an SSM checkpoint with every 32-token KV block, LRU.
- `no_cache.NoCache` ("none"): nothing is ever reused.
- `hybrid_radix`: SGLang+, coverage (SGLang PR #38000's rule) and Marconi on the policy core's cache.
- `belady.BeladyBound` ("belady"): an upper bound on any eviction under Marconi's admission
  (`hit_options` gathers what each request could hit, `dual_bound` minimizes the LP's dual).

Import the classes from their modules; this package imports nothing on its own.
"""

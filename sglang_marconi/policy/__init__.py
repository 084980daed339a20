"""Engine-free Marconi policy core, in four layers: `cost/` (profiles, FLOPs and bytes), `tree/` (the
radix tree and the caches on it), `rules/` (eviction choices, probation, admission positions, tier and
window rules) and `tuning/` (shadow tuning of the eviction choice). `errors` holds the one-line errors
for bad input.

Must never import torch or SGLang (tests/test_layering.py checks this).
"""

"""Engine-free Marconi policy core: model profiles, radix tree, admission, eviction, alpha tuning.

Must never import torch or SGLang (tests/test_layering.py checks this).
"""

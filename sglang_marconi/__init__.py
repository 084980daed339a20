"""Marconi prefix caching for hybrid (attention + SSM) LLMs.

Layers, lowest first; a layer never imports one above it:
  policy/  engine-free cache policy core (numpy only, never torch or SGLang)
  sim/     trace replay, baselines, metrics, CLI (imports policy/)
"""

__version__ = "0.1.0"

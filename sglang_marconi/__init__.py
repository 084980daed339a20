"""Marconi prefix caching for hybrid (attention + SSM) LLMs.

Layers, lowest first; a layer never imports one above it:
  policy/  engine-free cache policy core (numpy only, never torch or SGLang)
  sim/     trace replay, baselines, metrics, CLI (imports policy/)
  serving/ the SGLang backend: components, admission, tuning runtime, metrics, plugin
           (imports policy/; SGLang only lazily, inside the serving process)
"""

__version__ = "0.1.0"

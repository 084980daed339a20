"""Marconi inside a live SGLang server: tree components, admission, plugin, serving flags.

Importing this package (or any of its modules) loads neither SGLang nor torch; the SGLang
subclasses are built on first use, inside the process that serves.
"""

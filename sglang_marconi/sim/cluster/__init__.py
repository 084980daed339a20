"""Cluster-scale simulation: a trace replayed over N workers behind a router."""

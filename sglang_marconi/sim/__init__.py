"""Trace simulator: workloads, baseline policies, replay, metrics and the CLI."""

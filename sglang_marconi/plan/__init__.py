"""The operator's planner: `python -m sglang_marconi.plan` (see `cli.py`)."""

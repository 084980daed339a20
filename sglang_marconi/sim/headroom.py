"""How much of the headroom above LRU a policy takes: the share of the LRU-to-bound gap closed.

    share = (tuned - sglang+) / (belady - sglang+)      (token hit rates)

`belady` is an upper bound (`baselines/belady.py`), so 100% may not be reachable and the share
is a lower estimate of the share of what is achievable. Where the bound is less than
`CONTENDED_POINTS` above SGLang+ there is no headroom to speak of (the cache holds about all that
any eviction could use): the share is undefined there ("n/a"), and the cell is not counted as
contended.
"""

from __future__ import annotations

import statistics

CONTENDED_POINTS = 1.0  # a cell is contended when the bound is at least this many points above SGLang+
# The bars the report checks tuned Marconi against:
CLOSE_TARGET = 0.25  # it closes at least a quarter of the gap in every contended cell
COVERAGE_MARGIN_POINTS = 0.5  # it is at least coverage - 0.5 points in every cell


def gap_closed(tuned: float, lru: float, bound: float) -> float | None:
    """(tuned - lru) / (bound - lru), or None where the gap is under CONTENDED_POINTS."""
    gap = bound - lru
    if 100 * gap < CONTENDED_POINTS:
        return None
    return (tuned - lru) / gap


def format_share(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def headroom_summary(rows: list[dict], label: str) -> list[str]:
    """Summary lines over rows with token hit rates `tuned`, `sglang+`, `belady`, `coverage`
    (fractions) and `workload`, `capacity_gb`."""
    if not rows:
        return [f"{label}: no cells"]
    name = lambda r: f"{r['workload']} @ {r['capacity_gb']:g} GB"  # noqa: E731
    shares = [(gap_closed(r["tuned"], r["sglang+"], r["belady"]), r) for r in rows]
    contended = [(s, r) for s, r in shares if s is not None]
    met = [r for s, r in contended if s >= CLOSE_TARGET]
    lines = []
    if contended:
        worst = min(contended, key=lambda sr: sr[0])
        median = statistics.median(s for s, _ in contended)
        lines.append(
            f"{label}: tuned closes >= {100 * CLOSE_TARGET:.0f}% of the LRU-to-bound gap: {len(met)} of "
            f"{len(contended)} contended cells (bound >= SGLang+ + {CONTENDED_POINTS:g} pt; median "
            f"{format_share(median)}, worst {format_share(worst[0])} at {name(worst[1])}) [target: all]")
    else:
        lines.append(f"{label}: no contended cell (bound within {CONTENDED_POINTS:g} pt of SGLang+ everywhere)")
    deltas = [(100 * (r["tuned"] - r["coverage"]), r) for r in rows]
    ok = sum(d >= -COVERAGE_MARGIN_POINTS for d, _ in deltas)
    worst_d = min(deltas, key=lambda dr: dr[0])
    lines.append(f"{label}: tuned >= coverage - {COVERAGE_MARGIN_POINTS:g} pts: {ok} of {len(rows)} cells "
                 f"(worst Δ {worst_d[0]:+.2f} pts at {name(worst_d[1])}) [target: all]")
    return lines

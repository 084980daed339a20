"""The share of the LRU-to-bound gap closed, and the summary lines bench_policies prints per group."""

import pytest

from sglang_marconi.sim.headroom import format_share, gap_closed, headroom_summary


def test_share_of_the_gap_and_where_it_is_undefined():
    assert gap_closed(0.30, 0.20, 0.60) == pytest.approx(0.25)
    assert gap_closed(0.15, 0.20, 0.60) == pytest.approx(-0.125)  # below LRU: a negative share
    assert gap_closed(0.50, 0.500, 0.505) is None  # bound within 1 point of LRU: no headroom to close
    assert format_share(None) == "n/a" and format_share(0.254) == "25%"


def row(workload, gb, lru, tuned, bound, coverage):
    return {"workload": workload, "capacity_gb": gb, "sglang+": lru, "tuned": tuned, "belady": bound,
            "coverage": coverage}


def test_summary_counts_contended_cells_and_the_coverage_margin():
    rows = [row("a", 1, 0.10, 0.20, 0.30, 0.10),   # 50% closed
            row("a", 2, 0.10, 0.11, 0.30, 0.12),   # 5%, and 1 point below coverage
            row("a", 4, 0.90, 0.90, 0.905, 0.90)]  # not contended
    closed, cov = headroom_summary(rows, "a")
    assert "1 of 2 contended cells" in closed and "worst 5% at a @ 2 GB" in closed
    assert "2 of 3 cells" in cov and "-1.00 pts at a @ 2 GB" in cov
    assert headroom_summary([], "b") == ["b: no cells"]
    assert "no contended cell" in headroom_summary([rows[2]], "c")[0]

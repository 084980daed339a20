"""Hit rate (and FLOPs saved) against cache capacity, one line per policy."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from sglang_marconi.sim.replay import RunResult


def plot_runs(runs: list[RunResult], path: str | Path, title: str = "") -> Path:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[RunResult]] = defaultdict(list)
    for run in runs:
        by_policy[run.label()].append(run)  # a host tier is its own line
    capacities = sorted({r.capacity_bytes for r in runs if r.policy not in ("none", "infinite")}) or [1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, items in by_policy.items():
        items.sort(key=lambda r: r.capacity_bytes)
        for ax, metric, scale in ((axes[0], "token_hit_rate", 100), (axes[1], "flops_saved_fraction", 100)):
            if policy in ("none", "infinite"):  # capacity-free: a horizontal reference line
                ax.axhline(getattr(items[0], metric) * scale, linestyle="--", linewidth=1, label=policy,
                           color="grey" if policy == "infinite" else "black")
            else:
                ax.plot([r.capacity_bytes / 1e9 for r in items], [getattr(r, metric) * scale for r in items],
                        marker="o", label=policy)
    for ax, ylabel in ((axes[0], "token hit rate (%)"), (axes[1], "prefill FLOPs saved (%)")):
        ax.set_xlabel("cache capacity (GB)")
        ax.set_ylabel(ylabel)
        if len(capacities) > 1 and capacities[-1] / capacities[0] >= 8:
            ax.set_xscale("log")
            ax.set_xticks([c / 1e9 for c in capacities])
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path, title, dpi=120)


def save_figure(fig, path: str | Path, title: str, *, dpi: int) -> Path:
    """Title `fig`, write it to `path` (its folder made if missing) and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path

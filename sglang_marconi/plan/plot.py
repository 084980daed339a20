"""The plan as a figure: hit rate, FLOPs saved and modeled TTFT p95 against the Mamba pool's share."""

from __future__ import annotations

from pathlib import Path

from sglang_marconi.plan.grid import Plan, POLICIES, STRATEGIES
from sglang_marconi.sim.plot import save_figure


def plot_plan(plan: Plan, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("token_hit_rate", 100, "token hit rate (%)"), ("flops_saved_fraction", 100, "prefill FLOPs saved (%)"),
               ("modeled_ttft_p95_s", 1, "MODELED TTFT p95 (s)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (metric, scale, ylabel) in zip(axes, metrics):
        for policy in POLICIES:
            for strategy in STRATEGIES:
                rows = sorted((r for r in plan.served(policy) if r.config.strategy == strategy),
                              key=lambda r: r.config.mamba_share)
                if rows:
                    ax.plot([100 * r.config.mamba_share for r in rows], [getattr(r.run, metric) * scale for r in rows],
                            marker="o", linestyle="-" if policy == "marconi" else "--", label=f"{policy}, {strategy}")
        for row in plan.tiered():  # no split: a horizontal reference line each
            ax.axhline(getattr(row.run, metric) * scale, linestyle=":", linewidth=1,
                       label=f"{row.config.policy}, {row.config.label()}",
                       color="tab:red" if row.config.host_bytes else "tab:grey",
                       alpha=1.0 if row.config.policy == "marconi" else 0.5)
        ax.axhline(getattr(plan.infinite, metric) * scale, color="black", linewidth=1, label="infinite cache")
        best = plan.best()
        ax.plot([100 * best.config.mamba_share], [getattr(best.run, metric) * scale], marker="*", markersize=16,
                color="gold", markeredgecolor="black", linestyle="none", label="best")
        ax.set_xlabel("Mamba pool's share of --memory (%)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    return save_figure(fig, path, title + " (TTFT MODELED from prefill FLOPs)", dpi=110)

"""Plot iteration frontiers (kareus and baselines) to a PNG with matplotlib."""

from __future__ import annotations

import pathlib
import textwrap

from kareus.ir.plan_file import Plan


def plot_frontiers(plan: Plan, path: str | pathlib.Path) -> pathlib.Path:
    """Write a time-energy plot of the plan's frontier and baselines; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    styles = {"megatron": "s", "perseus": "^", "nanobatch+perseus": "v"}
    for name, pts in plan.baselines.items():
        ax.plot(
            [p.time_s for p in pts],
            [p.energy_j for p in pts],
            marker=styles.get(name, "o"),
            linestyle="--",
            label=name,
        )
    (line,) = ax.plot(
        [p.time_s for p in plan.frontier],
        [p.energy_j for p in plan.frontier],
        marker="o",
        linewidth=2,
        label="kareus",
    )
    unsplit = [p for p in plan.frontier if p.nanobatches == 1]
    if unsplit:  # plans of the original graphs: clocks only, nothing split
        ax.plot(
            [p.time_s for p in unsplit],
            [p.energy_j for p in unsplit],
            marker="o",
            markersize=9,
            markerfacecolor="white",
            color=line.get_color(),
            linestyle="none",
            label="kareus, original graphs (not split)",
        )
    ax.plot(
        [plan.chosen.time_s],
        [plan.chosen.energy_j],
        marker="*",
        markersize=14,
        linestyle="none",
        color="black",
        label=f"chosen ({plan.policy})",
    )
    if plan.baselines.get("megatron"):
        mega = min(p.time_s for p in plan.baselines["megatron"])
        ax.axvline(
            mega, color="grey", linestyle=":", linewidth=1, label="Megatron-LM time (iso-time)"
        )
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration, all GPUs (J)")
    # the workload's description is long: wrapped, so that the title fits the figure
    head = textwrap.fill(f"{_workload(plan)} on {plan.gpu}", width=70)
    ax.set_title(f"{head}\ntime-energy frontiers ({plan.source})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    from kareus._files import atomic_path

    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out


def _workload(plan: Plan) -> str:
    """Return the workload as the plan file describes it (``Workload.describe``)."""
    return str(plan.workload.get("describe") or "workload")

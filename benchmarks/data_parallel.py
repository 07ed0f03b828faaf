"""Data parallelism in the plan: a sweep of the data-parallel degree (modelled figures).

Llama 3.2 3B, TP 8 x PP 2 (8 GPUs per node: every data-parallel group crosses nodes), micro-
batches of 8 x 4096 tokens, on the emulated A100-SXM4-40GB, planned by ``kareus plan --dp N``
for N in 1, 2, 4, 8, 16, in two regimes:

- fixed micro-batches: every replica runs 8 micro-batches (the global batch grows with N);
- fixed global batch: 16 micro-batches over all replicas (16 / N per replica).

Per degree and mode it prints Megatron-LM's iteration time and energy per replica (and for
the whole job, N replicas), the data-parallel communication (alone, added to the
iteration, hidden share), kareus's iso-time saving over Megatron-LM and Perseus, the clock
kareus gives the step (the exposed all-reduce and the optimizer; the lowest over ranks),
and what planning with the data-parallel traffic in view saved over a plan made blind to it
and run with it (the report's *What seeing it gained*), and writes a plot (``--out``,
default ``dp-out/``). All figures are modelled (the hardware model);
the wall time of planning is measured.

``--modes simplefsdp`` traces each degree with the parameters gathered in the graphs (its
collectives are partitions, not hook traffic: no *alone* / *added* / *seeing DP* columns;
with TP 8 the layers split and the gathers run alone, so Megatron-LM's time holds them).

Run: python benchmarks/data_parallel.py [--modes ddp,fsdp] [--degrees 1,2,4,8,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from kareus.jobs.trace import Workload
from kareus.jobs.workload import plan_workload
from kareus.planner.pareto import iso_time_energy_reduction


def run(mode: str, degree: int, microbatches: int) -> dict[str, float | int | str]:
    work = Workload(
        model="llama3.2-3b",
        tp=8,
        pp=2,
        microbatch_size=8,
        seq_len=4096,
        microbatches=microbatches,
        dp=degree,
        dp_mode=mode,
    )
    start = time.perf_counter()
    plan = plan_workload(work, "a100-40gb").plan
    wall = time.perf_counter() - start
    megatron = plan.baselines["megatron"][0]
    stages = plan.data_parallel["stages"]
    alone = max(s["alone_s"] for s in stages)
    added = max(s["added_s"] for s in stages)
    return {
        "mode": mode,
        "dp": degree,
        "microbatches": microbatches,
        "megatron_s": megatron.time_s,
        "megatron_j": megatron.energy_j,
        "job_j": megatron.energy_j * degree,
        "dp_alone_s": alone,
        "dp_added_s": added,
        "hidden": 1 - added / alone if alone > 0 else None,
        "saving_vs_megatron": _iso_time(plan, "megatron"),
        "saving_vs_perseus": _iso_time(plan, "perseus"),
        "step_mhz": min((s.freq_mhz for s in plan.schedule if s.kind == "step"), default=None),
        "seeing_dp": plan.data_parallel.get("blind", {}).get("saving"),
        "plan_wall_s": wall,
    }


def _iso_time(plan, method: str) -> float | None:
    """kareus's least energy no slower than the method's fastest plan, as a saving."""
    points = [(p.time_s, p.energy_j) for p in plan.frontier]
    theirs = [(p.time_s, p.energy_j) for p in plan.baselines[method]]
    return iso_time_energy_reduction(points, theirs)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':5} {'regime':22} {'DP':>3} {'Megatron s':>10} {'J/replica':>10} {'J job':>10} "
        f"{'DP alone ms':>11} {'added ms':>9} {'hidden':>7} {'vs Megatron':>11} "
        f"{'vs Perseus':>10} {'step MHz':>8} {'seeing DP':>9} {'plan s':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:5} {r['regime']:22} {r['dp']:3} {r['megatron_s']:10.4f} "
            f"{r['megatron_j']:10.1f} {r['job_j']:10.1f} {r['dp_alone_s'] * 1e3:11.1f} "
            f"{r['dp_added_s'] * 1e3:9.1f} {_pct(r['hidden']):>7} "
            f"{_pct(r['saving_vs_megatron']):>11} {_pct(r['saving_vs_perseus']):>10} "
            f"{r['step_mhz'] or 0:8.0f} {_pct(r['seeing_dp']):>9} {r['plan_wall_s']:7.1f}"
        )


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for (mode, regime), group in _groups(rows).items():
        dps = [r["dp"] for r in group]
        label = f"{mode}, {regime}"
        axes[0].plot(dps, [r["megatron_s"] for r in group], marker="o", label=label)
        axes[1].plot(dps, [r["job_j"] / 1e3 for r in group], marker="o", label=label)
        savings = [100 * (r["saving_vs_megatron"] or 0) for r in group]
        axes[2].plot(dps, savings, marker="o", label=label)
        seeing = [100 * (r["seeing_dp"] or 0) for r in group]
        axes[3].plot(dps, seeing, marker="o", label=label)
    titles = (
        "Megatron-LM iteration time (s)",
        "Megatron-LM energy, whole job (kJ)",
        "kareus iso-time saving vs Megatron-LM (%)",
        "saving from planning with DP in view (%)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel degree")
        ax.set_title(title + " - modelled", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Llama 3.2 3B, TP 8 x PP 2, A100-SXM4-40GB (hardware model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["mode"], r["regime"]), []).append(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="ddp", help="comma-separated: ddp, fsdp, hsdp, simplefsdp"
    )
    parser.add_argument("--degrees", default="1,2,4,8,16")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("dp-out"))
    args = parser.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    rows = []
    for mode in args.modes.split(","):
        for regime in ("fixed micro-batches (8)", "fixed global batch (16)"):
            for dp in degrees:
                micro = 8 if regime.startswith("fixed micro") else max(1, 16 // dp)
                row = run(mode, dp, micro) | {"regime": regime}
                rows.append(row)
                print_table([row])
    print("\nall figures modelled (hardware model of A100-SXM4-40GB); plan s measured")
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_parallel.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.out / "data_parallel.png")
    print(f"wrote {args.out / 'data_parallel.json'} and {args.out / 'data_parallel.png'}")


if __name__ == "__main__":
    main()

"""What pricing clock changes does to the composer's proven gaps and planning time.

Plans one workload of ``compare.py``'s matrix (its setup: PP 2 split 15/13, 8 micro-batches,
full recompute) twice on one GPU type: with each clock change priced as the GPU's spec
prices it (kareus's default), and with changes free. The relaxation's bound prices changes
by the total variation of neighbouring instructions' clock weights, which a mix spread over
neighbouring clocks pays only in part, so a plan that pays for them can carry part of their
cost in its proven gap, and CP-SAT, which prices them exactly, searches to its work limit
where the bound cannot prove a plan. Prints, for
both: planning wall time (measured), frontier points, points proven within the gap limit,
the median and largest proven gap, and the least energy (modelled).

The partition set is read from ``benchmarks/results/partitions`` where ``compare.py`` saved
it (``--partitions`` for another), else traced (about 30 s).

Run: python benchmarks/clock_change_gaps.py [--model qwen3-1.7b --tp 4 --cp 2
--microbatch-size 16 --seq-len 4096 --gpu h100]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from typing import Any

import compare


def _plan(work: Any, gpu_name: str, parts: pathlib.Path, free: bool) -> dict[str, float]:
    from kareus.jobs.workload import plan_workload
    from kareus.planner import PlannerSettings
    from kareus.planner.dag import SwitchCost

    settings = PlannerSettings(solver_workers=1, switch=SwitchCost() if free else None)
    start = time.perf_counter()
    planned = plan_workload(work, gpu_name, partitions=parts, settings=settings)
    wall = time.perf_counter() - start
    points = planned.plan.frontier
    gaps = sorted(math.inf if p.gap is None else p.gap for p in points)  # None: unproven
    return {
        "wall_s": wall,
        "points": len(points),
        "proven": sum(g <= settings.solver_gap_limit + 1e-9 for g in gaps),
        "median_gap": gaps[len(gaps) // 2],
        "max_gap": gaps[-1],
        "least_j": min(p.energy_j for p in points),
    }


def main() -> int:
    """Plan the workload both ways and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--partitions", type=pathlib.Path, help="a saved partition set")
    args = parser.parse_args()
    from kareus.jobs.trace import Workload

    wanted = (args.model, args.tp, args.cp, args.microbatch_size, args.seq_len)
    keys = ("model", "tp", "cp", "microbatch_size", "seq_len")
    fields = next(
        (f for f, _g in compare.matrix(False) if tuple(f[k] for k in keys) == wanted), None
    )
    if fields is None:
        parser.error(f"{dict(zip(keys, wanted, strict=True))} is not a workload of the matrix")
    work = Workload(**fields)
    key = compare.workload_key(fields)
    parts = args.partitions or compare.RESULTS / "partitions" / f"{key}.json"
    if not compare.holds_partition_set(work, parts):
        if args.partitions is not None:
            parser.error(f"{parts} is not a partition set of this workload")
        print(f"tracing {key} (no partition set at {parts})", flush=True)
        parts = pathlib.Path("compare-out") / "partitions" / parts.name
        compare.partition_set(work, parts, reuse=False)
    print(f"{key} on {args.gpu}: energies and gaps modelled, wall times measured")
    print("| clock changes | planning s | points | proven within the gap limit | median gap "
          "| largest gap | least energy kJ |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for label, free in (("priced", False), ("free", True)):
        r = _plan(work, args.gpu, parts, free)
        print(
            f"| {label} | {r['wall_s']:.0f} | {r['points']} | {r['proven']} "
            f"| {100 * r['median_gap']:.2f} % | {100 * r['max_gap']:.2f} % "
            f"| {r['least_j'] / 1e3:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kareus's modelled pipelines against the reference A100 pipeline plans (figures are printed).

The reference (``shared/data/a100_llama_pipeline_plans``, next to the repository): Llama 3.2
3B on 16 A100-SXM4-40GB, PP 2 with 15/13 layers, 8 micro-batches, synchronous 1F1B, bf16,
full activation recompute, clocks 900-1410 MHz in 30 MHz steps; the Perseus and
nanobatching + Perseus frontiers predicted from instruction profiles measured in situ. For each
of its configurations kareus traces and plans the same workload on its A100 model (the same
clocks, the same recompute and stage split) and the script prints, per method, the fastest
and the least-energy plan side by side: iteration time and energy of one GPU per stage (the
reference's unit: kareus's energy of one pipeline divided by TP x CP), and kareus / reference.
kareus's figures are **modelled**; the reference's are the artifact's planner predictions from
**measured** profiles.

Run: python benchmarks/pipeline_fidelity.py [--recompute full|none] [--configs N]
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import time

from kareus.hardware.calibrate import shared_data_dir
from kareus.planner import PlannerSettings
from kareus.planning import plan_workload
from kareus.trace import Workload

METHODS = {"perseus": "perseus", "nanobatch_perseus": "nanobatch+perseus"}


def reference() -> dict[tuple, dict[str, list[tuple[float, float]]]]:
    """Per configuration and method, the (time, energy) of every reference plan."""
    path = shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv"
    plans: dict[tuple, dict[str, set[tuple[float, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(set)
    )
    with path.open() as fh:
        for row in csv.DictReader(fh):
            key = tuple(
                int(row[k])
                for k in ("tp", "cp", "pp", "microbatch_size", "seq_len", "microbatches")
            )
            plans[key][row["method"]].add((float(row["plan_time_s"]), float(row["plan_energy_j"])))
    return {k: {m: sorted(v) for m, v in by.items()} for k, by in plans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recompute", default="full", choices=("none", "full", "selective"))
    parser.add_argument("--configs", type=int, help="only the first N configurations")
    args = parser.parse_args()
    clocks = tuple(range(1410, 899, -30))  # the reference's 18 clocks
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    rows = []
    for key, by_method in list(reference().items())[: args.configs]:
        tp, cp, pp, mbs, seq, micro = key
        work = Workload(
            model="llama3.2-3b",
            tp=tp,
            cp=cp,
            pp=pp,
            microbatch_size=mbs,
            seq_len=seq,
            microbatches=micro,
            recompute=args.recompute,
            layers_per_stage=(15, 13),
        )
        start = time.perf_counter()
        planned = plan_workload(
            work, "a100-40gb", settings=PlannerSettings(clocks_mhz=clocks), policy="min_energy"
        )
        wall = time.perf_counter() - start
        per_column = tp * cp  # the reference counts one GPU per stage
        for ref_method, method in METHODS.items():
            ref = by_method.get(ref_method)
            if not ref:
                continue
            ours = sorted(
                (s.time_s, s.energy_j / per_column) for s in planned.result.frontiers[method]
            )
            fastest_ref, fastest = ref[0], ours[0]
            frugal_ref = min(ref, key=lambda p: p[1])
            frugal = min(ours, key=lambda p: p[1])
            r = {
                "fastest T": fastest[0] / fastest_ref[0],
                "fastest E": fastest[1] / fastest_ref[1],
                "least E": frugal[1] / frugal_ref[1],
            }
            for k, v in r.items():
                ratios[k].append(v)
            rows.append(
                (
                    f"TP{tp} CP{cp} mbs{mbs} seq{seq}",
                    method,
                    f"{fastest_ref[0]:.3f} s / {fastest_ref[1]:.0f} J",
                    f"{fastest[0]:.3f} s / {fastest[1]:.0f} J",
                    f"{r['fastest T']:.3f}",
                    f"{r['fastest E']:.3f}",
                    f"{frugal_ref[1]:.0f} J",
                    f"{frugal[1]:.0f} J",
                    f"{r['least E']:.3f}",
                    f"{wall:.0f} s",
                )
            )
        print(f"planned {work.describe()} in {wall:.0f} s (measured wall time)", flush=True)
    header = (
        "config",
        "method",
        "reference fastest",
        "kareus fastest",
        "T ratio",
        "E ratio",
        "ref least E",
        "kareus least E",
        "least-E ratio",
        "trace+plan",
    )
    print(
        f"\nrecompute {args.recompute}; kareus modelled, reference predicted from measured profiles"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "\nmedian kareus / reference: "
        + ", ".join(
            f"{k} {statistics.median(v):.3f} (range {min(v):.3f}-{max(v):.3f})"
            for k, v in ratios.items()
        )
    )


if __name__ == "__main__":
    main()

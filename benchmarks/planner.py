"""The planner on emulated partitions: search quality and planning cost (figures printed).

1. Per partition type: evaluations of the multi-pass search against the exhaustive grid,
   and the share of the exhaustive frontier's hypervolume it reaches.
2. Planning wall time and peak memory for a 3B-parameter-class configuration (28 layers,
   hidden 3072, TP 8, PP 2, 8 micro-batches of 8 x 4096 tokens, A100-SXM4-40GB), with the
   frontiers of kareus and the baselines. The partition set is built from the shapes
   (kareus.testing.megatron_partition_set); all times and energies are modelled.

3. The composer at scale (``--scale [8x16,8x64,16x64,16x128]``): Llama 3.3 70B shapes (80
   layers, hidden 8192, TP 8, micro-batches of 8 x 4096), PP 8 x 16 by default, up to PP
   16 x 128 (4,096 instructions, about 80 s on 2 cores: the relaxation is a min-cost flow
   past 128 instructions), from partition sets built from the shapes (no tracing):
   planning wall time (measured), frontier points, the largest proven gap and the chosen
   point's, kareus's least energy against the best uniform-clock plan (every instruction
   at one clock and one overlap setting), and solves not proven within the gap limit.

   With ``--dp N [--dp-mode ddp|fsdp|hsdp]``, the same with N data-parallel replicas (8
   GPUs a node): their traffic priced beside the compute and the optimizer step.

4. Traced workloads (``--traced``): the planner on partition sets traced from the models
   (kareus's Llama on fake tensors, as `kareus plan` traces them), re-planned at the
   micro-batch counts a user changes to: Llama 3.3 70B at TP 8 x PP 8 with 16, 32 and 64
   micro-batches, and the main job (Llama 3.2 3B, TP 8 x PP 2) with 8 and 64. Each model is
   traced once into ``--traced-dir`` (partitions.json, as `kareus plan` writes it); each
   re-plan reads it, as `kareus plan --partitions` does: planning seconds (measured),
   solves, solves not proven within the gap limit, the largest proven gap, frontier points.

Run: python benchmarks/planner.py [--gpu a100-sxm4-40gb] [--scale [PPxM,...] [--dp N]]
     python benchmarks/planner.py --traced [70b-16,70b-32,70b-64,3b-8,3b-64] [--traced-dir DIR]
"""

import argparse
import resource
import time

from kareus.hardware import Emulator, gpu
from kareus.hardware.calibrate import attention_partition
from kareus.ir.costs import PartitionWork
from kareus.planner import Parallelism, exhaustive, plan_for_gpu, search
from kareus.planner.knobs import KnobSpace, default_clocks
from kareus.planner.pareto import hypervolume_share
from kareus.testing import megatron_partition_set


def search_quality(spec, pset):
    emu = Emulator(spec)
    works = {"a100-measured-attention": attention_partition()}
    works.update({k: PartitionWork(t.compute, t.collective) for k, t in pset.types.items()})
    print("search vs exhaustive (modelled):")
    print(f"  {'type':26} {'grid':>5} {'evaluated':>9} {'share':>6} {'HV reached':>10}")
    for name, work in works.items():
        space = KnobSpace(default_clocks(spec.clocks_mhz()), (2, 4, 8, 16, 32), len(work.ops))
        full = exhaustive(work, space, emu)
        got = search(work, space, emu)
        hv = hypervolume_share(
            [(p.time_s, p.energy_j) for p in full.points],
            [(p.time_s, p.energy_j) for p in got.points],
        )
        share = got.evaluations / full.evaluations
        print(f"  {name:26} {full.evaluations:5} {got.evaluations:9} {share:6.1%} {hv:10.4%}")


def _data_parallel(pp, dp, mode):
    """Llama 3.3 70B's parameters per GPU of each stage at TP 8, and the DP layout (8 per node)."""
    from kareus.planner.data_parallel import DataParallel, StageWeights

    hidden, ffn, vocab, tp = 8192, 28672, 128256, 8
    per_layer = (2.25 * hidden**2 + 3 * hidden * ffn) / tp  # q, o; k, v at 8 KV heads; MLP
    weights = [
        StageWeights(80 // pp, per_layer, vocab * hidden / tp * ((s == 0) + (s == pp - 1)))
        for s in range(pp)
    ]
    return {"data_parallel": DataParallel(dp, mode, 8, tp), "weights": weights}


def at_scale(spec, configs, dp=None, dp_mode="ddp"):
    """Plan 70B shapes at each (PP, micro-batches) of ``configs``; print the figures."""
    from kareus.planner.compose import Composer, Problem
    from kareus.planner.dag import one_f_one_b
    from kareus.planner.instruction_options import evaluate_options
    from kareus.planner.knobs import CountingEvaluator
    from kareus.planner.settings import PlannerSettings

    for pp, micro in configs:
        pset = megatron_partition_set(
            hidden=8192, ffn=28672, heads=64, seq=4096, microbatch=8, layers=80 // pp, tp=8
        )
        extra = {} if dp is None else _data_parallel(pp, dp, dp_mode)
        start = time.perf_counter()
        result = plan_for_gpu(
            pset, spec, parallel=Parallelism(tp=8, pp=pp, microbatches=micro), **extra
        )
        wall = time.perf_counter() - start
        plan = result.plan
        gaps = [p.gap for p in plan.frontier if p.gap is not None]
        # The uniform-clock plans, enumerated on the same options as the planner's.
        settings = PlannerSettings()
        ev = CountingEvaluator(Emulator(spec))
        freqs = default_clocks(spec.clocks_mhz(), plan.evaluations["clocks"])
        static = spec.calibration.static_power_w
        opts = evaluate_options([pset] * pp, ev, freqs, static, settings).options
        comp = Composer(Problem(one_f_one_b(pp, micro), opts, static, 8 * pp, gpus_per_stage=8))
        uniform = min(u.energy_j for u in comp.uniform_plans())
        least = min(p.energy_j for p in plan.frontier)
        layout = "" if dp is None else f", DP {dp} ({dp_mode}, {8 * pp * dp} GPUs)"
        against = (  # (the enumeration above prices no data-parallel traffic)
            f" vs best uniform-clock plan {uniform:.0f} J "
            f"({100 * (least - uniform) / uniform:+.2f} %, modelled)"
            if dp is None
            else " (modelled)"
        )
        print(
            f"\n70B shapes, TP 8, PP {pp} x {micro} micro-batches{layout} "
            f"({2 * pp * micro} instructions, {plan.evaluations['clocks']} clocks): planning "
            f"{wall:.1f} s wall (measured); "
            f"{len(plan.frontier)} frontier points; largest proven gap "
            f"{100 * max(gaps):.2f} %, chosen {100 * (plan.chosen.gap or 0):.2f} %; least "
            f"energy {least:.0f} J{against}; "
            f"{plan.evaluations['solves_not_proven_optimal']} of "
            f"{plan.evaluations['solves']} solves not proven within the gap limit"
        )


TRACED = {
    # name: (model, pp, micro-batches)
    "70b-16": ("llama3.3-70b", 8, 16),
    "70b-32": ("llama3.3-70b", 8, 32),
    "70b-64": ("llama3.3-70b", 8, 64),
    "3b-8": ("llama3.2-3b", 2, 8),
    "3b-64": ("llama3.2-3b", 2, 64),
}


def traced(spec, names, directory):
    """Re-plan traced workloads from their saved partitions; print the figures."""
    import pathlib

    from kareus.jobs.trace import Workload
    from kareus.jobs.workload import plan_workload

    for name in names:
        model, pp, micro = TRACED[name]
        work = Workload(model=model, tp=8, pp=pp, microbatch_size=8, seq_len=4096,
                        microbatches=micro)  # fmt: skip
        saved = pathlib.Path(directory) / f"{model}-tp8-pp{pp}" / "partitions.json"
        if not saved.is_file():  # trace once (any micro-batch count: the partitions are per stage)
            from kareus.jobs.report import write_outputs

            print(f"tracing {model} TP 8 x PP {pp} into {saved.parent} (once)", flush=True)
            write_outputs(plan_workload(work, spec.name), saved.parent)
        start = time.perf_counter()
        plan = plan_workload(work, spec.name, partitions=saved).result.plan
        wall = time.perf_counter() - start
        gaps = [p.gap for p in plan.frontier if p.gap is not None]
        ev = plan.evaluations
        print(
            f"{name}: {model} TP 8 x PP {pp} x {micro} micro-batches ({2 * pp * micro} "
            f"instructions), from {saved}: {ev['clocks']} clocks, planning {wall:.1f} s wall "
            "(measured); "
            f"{ev.get('solves', 0)} solves ({ev.get('cp_sat_solves', 0)} CP-SAT, "
            f"{ev.get('branch_solves', 0)} SCIP), "
            f"{ev.get('solves_not_proven_optimal', 0)} not proven within the gap limit; "
            f"largest proven gap {100 * max(gaps, default=float('nan')):.2f} %; "
            f"{len(plan.frontier)} frontier points (modelled)",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", default="a100-sxm4-40gb")
    parser.add_argument(
        "--scale",
        nargs="?",
        const="8x16",
        metavar="PPxM,...",
        help="only the composer at 70B scale, for these PP x micro-batch sizes (default 8x16; "
        "16x128 is 4,096 instructions and takes minutes)",
    )
    parser.add_argument(
        "--dp", type=int, help="with --scale: data-parallel replicas (their traffic and step)"
    )
    parser.add_argument("--dp-mode", default="ddp", choices=("ddp", "fsdp", "hsdp"))
    parser.add_argument(
        "--traced",
        nargs="?",
        const=",".join(TRACED),
        metavar="NAME,...",
        help=f"re-plan traced workloads from saved partitions ({', '.join(TRACED)})",
    )
    parser.add_argument(
        "--traced-dir",
        default="/tmp/kareus-bench-planner",
        help="where each traced model's partitions.json is kept between runs",
    )
    args = parser.parse_args()
    spec = gpu(args.gpu)
    if args.traced:
        traced(spec, args.traced.split(","), args.traced_dir)
        return
    if args.scale:
        sizes = [tuple(map(int, c.split("x"))) for c in args.scale.split(",")]
        at_scale(spec, sizes, args.dp, args.dp_mode)
        return
    pset = megatron_partition_set(
        hidden=3072, ffn=8192, heads=24, seq=4096, microbatch=8, layers=14, tp=8
    )
    search_quality(spec, pset)
    start = time.perf_counter()
    result = plan_for_gpu(pset, spec, parallel=Parallelism(tp=8, pp=2, microbatches=8))
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nplanning 28 layers / 2 stages, TP 8, PP 2, 8 micro-batches: {wall:.1f} s wall "
        f"(measured), peak RSS {peak:.0f} MiB (measured, whole process)"
    )
    print(result.plan.to_text())


if __name__ == "__main__":
    main()

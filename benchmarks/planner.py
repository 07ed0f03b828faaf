"""The planner on emulated partitions: search quality and planning cost (figures printed).

1. Per partition type: evaluations of the multi-pass search against the exhaustive grid,
   and the share of the exhaustive frontier's hypervolume it reaches.
2. Planning wall time and peak memory for a 3B-parameter-class configuration (28 layers,
   hidden 3072, TP 8, PP 2, 8 micro-batches of 8 x 4096 tokens, A100-SXM4-40GB), with the
   frontiers of kareus and the baselines. The partition set is built from the shapes
   (kareus.testing.megatron_partition_set); all times and energies are modelled.

Run: python benchmarks/planner.py [--gpu a100-sxm4-40gb]
"""

import argparse
import resource
import time

from kareus.costs import PartitionWork
from kareus.hardware import Emulator, gpu
from kareus.hardware.calibrate import attention_partition
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", default="a100-sxm4-40gb")
    args = parser.parse_args()
    spec = gpu(args.gpu)
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

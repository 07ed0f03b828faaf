"""Does the overlap schedule overlap? Step time of a 2-rank gloo model, side by side.

Compute is a stand-in op that sleeps (kareus.testing.sleepy), so the cores stay free and
gloo's all-reduces can run during it, as NCCL's do during GPU kernels. Both settings split
every layer into two nanobatches; "no overlap" issues each all-reduce where its input is
ready and waits at once, "overlap" launches it at the start of the other nanobatch's
compute (kareus's default). Prints measured median step times and their ratio.

Run: python benchmarks/overlap_sleep.py [--steps 6] [--ms 20] [--width 262144]
"""

import argparse
import statistics
import time

import torch

import kareus
from kareus import Decision
from kareus.testing import SleepyStack, run_ranks


def measure(rank, steps, ms, width):
    results = {}
    for name, decisions in (
        ("no overlap", {"*": Decision(launch_slot=None)}),
        ("overlap", {"*": Decision(launch_slot=0)}),
    ):
        torch._dynamo.reset()
        model = kareus.compile(SleepyStack(4, width, ms), strict=True, decisions=decisions)
        x = torch.randn(8, width)
        model(x).backward()  # compile, warm up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(x).backward()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ms", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=1 << 18)
    args = parser.parse_args()
    results = run_ranks(measure, args.steps, args.ms, args.width)[0]
    print("measured on this machine (2 gloo ranks, sleeping compute), median step time:")
    for name, t in results.items():
        print(f"  {name:11} {t * 1e3:8.1f} ms")
    print(f"  ratio overlap / no overlap: {results['overlap'] / results['no overlap']:.3f}")


if __name__ == "__main__":
    main()

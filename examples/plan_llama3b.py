"""Plan Llama 3.2 3B (TP 8, PP 2, 8 micro-batches of 8 x 4096 tokens) on an emulated A100.

Prints the frontier of kareus and of the baselines (all modelled), and writes the plan
JSON and a frontier plot. The partition set is built from the model's shapes
(kareus.testing.megatron_partition_set) until tracing presets at scale lands.

Run: python examples/plan_llama3b.py [--gpu a100-sxm4-40gb] [--select iso_time] [--out kareus-out]
"""

import argparse
import pathlib
import time

from kareus.hardware import gpu
from kareus.planner import POLICIES, Parallelism, plan_for_gpu
from kareus.planner.plot import plot_frontiers
from kareus.testing import megatron_partition_set

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--gpu", default="a100-sxm4-40gb")
parser.add_argument("--select", default="iso_time", choices=POLICIES)
parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("kareus-out"))
args = parser.parse_args()

spec = gpu(args.gpu)
# Llama 3.2 3B: 28 layers, hidden 3072, FFN 8192, 24 heads; 14 layers per stage at PP 2.
pset = megatron_partition_set(
    hidden=3072, ffn=8192, heads=24, seq=4096, microbatch=8, layers=14, tp=8, vocab=128256
)
start = time.perf_counter()
result = plan_for_gpu(
    pset,
    spec,
    parallel=Parallelism(tp=8, pp=2, microbatches=8),
    policy=args.select,
    progress=lambda step: print(f"  {step} ...", flush=True),
)
print(f"planned in {time.perf_counter() - start:.1f} s (measured wall time)\n")
print(result.plan.to_text())
args.out.mkdir(parents=True, exist_ok=True)
result.plan.save(args.out / "plan.json")
png = plot_frontiers(result.plan, args.out / "frontier.png")
print(f"\nwrote {args.out / 'plan.json'} and {png}")

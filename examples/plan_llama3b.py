"""Plan Llama 3.2 3B from Python (what `kareus plan` does), then print and save the result.

Traces the preset on fake tensors (TP 8, PP 2, 8 micro-batches of 8 x 4096 tokens), plans
it on an emulated A100 (all figures modelled) and writes plan, report and plot.

Run: python examples/plan_llama3b.py [--gpu a100-40gb] [--select iso_time] [--out kareus-out]
"""

import argparse
import pathlib

from kareus.jobs.report import write_outputs
from kareus.jobs.trace import Workload
from kareus.jobs.workload import plan_workload
from kareus.planner import POLICIES

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--gpu", default="a100-40gb")
parser.add_argument("--select", default="iso_time", choices=POLICIES)
parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("kareus-out"))
args = parser.parse_args()

work = Workload(model="llama3.2-3b", tp=8, pp=2, microbatch_size=8, seq_len=4096, microbatches=8)
planned = plan_workload(
    work, args.gpu, policy=args.select, progress=lambda s: print(f"  {s} ...", flush=True)
)
print(f"traced in {planned.trace_s:.1f} s, planned in {planned.plan_s:.1f} s (measured)\n")
print(planned.plan.to_text())
paths = write_outputs(planned, args.out)
print("\nwrote " + ", ".join(str(p) for p in paths.values()))

"""First call of ``kareus.compile`` against ``torch.compile``: cold, and on a warm restart.

Each measurement is a fresh process that builds the model and times its first forward and
backward, where all compilation happens. *Cold*: Inductor's cache directory is empty (a
new one per run). *Warm restart*: a second process on the same cache directory, as a job
restarted on the same machine has it (Inductor's FX graph cache holds the generated code;
the kernels are not generated again). The variants run interleaved, run after run, so a
machine's drift hits all alike; the medians and their ratios to torch.compile's are
printed. Every figure is measured on this machine.

The model is ``kareus.models`` Llama (preset ``tiny-4l`` by default) with tensor
parallelism over a gloo group of one, as ``train_step.py --tp 1`` runs it.

Run: python benchmarks/first_call.py [--runs 3] [--preset tiny-4l]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
dist.init_process_group("gloo", rank=0, world_size=1)
import kareus
from kareus.models import PRESETS, Llama
torch.manual_seed(0)
model = Llama(PRESETS[{preset!r}], tp_group=dist.group.WORLD)
compiled = torch.compile(model) if {variant!r} == "torch.compile" else kareus.compile(model)
ids = torch.randint(0, 128, (8, 64))
start = time.perf_counter()
compiled(ids, ids).backward()
print(time.perf_counter() - start)
dist.destroy_process_group()
"""

VARIANTS = ("torch.compile", "kareus")


def _first_call(variant: str, preset: str, cache: str) -> float:
    from kareus.testing import free_port

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, KAREUS_CODEGEN="inductor")
    code = CHILD.format(variant=variant, preset=preset, port=str(free_port()))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Measure and print the first calls."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--preset", default="tiny-4l")
    args = parser.parse_args(argv)
    times: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory(prefix="kareus-first-call-") as cache:
                cold = _first_call(variant, args.preset, cache)
                warm = _first_call(variant, args.preset, cache)
            times.setdefault((variant, "cold"), []).append(cold)
            times.setdefault((variant, "warm"), []).append(warm)
            print(f"  run {run + 1}: {variant}: cold {cold:.2f} s, warm {warm:.2f} s",
                  file=sys.stderr)  # fmt: skip
    print(f"first call, measured: preset {args.preset}, TP 1 (gloo), {args.runs} runs, "
          "fresh processes (median s; ratio to torch.compile's)")  # fmt: skip
    for when in ("cold", "warm"):
        ref = statistics.median(times[("torch.compile", when)])
        cells = []
        for variant in VARIANTS:
            mid = statistics.median(times[(variant, when)])
            cells.append(f"{variant} {mid:.2f} s ({mid / ref:.2f}x)")
        label = "cold (empty Inductor cache)" if when == "cold" else "warm restart"
        print(f"  {label}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile-time overhead of the nanobatch split against kareus's passthrough.

Each measurement is a whole fresh process (import, build, compile, one forward and backward),
so it includes everything a user waits for. Prints the median of --runs runs per setting.
"passthrough" disables kareus's passes (static shapes, graphs unchanged); "split" is the
default (symbolic batch, every block split into two nanobatches).

Run: python benchmarks/compile_overhead.py [--runs 3] [--presets tiny-4l tiny-16l]
"""

import argparse
import statistics
import subprocess
import sys
import time

CHILD = """
import torch, kareus
from kareus.models import PRESETS, Llama
torch.manual_seed(0)
model = Llama(PRESETS[{preset!r}])
compiled = kareus.compile(model, **{cfg!r})
ids = torch.randint(0, 128, (8, 64))
compiled(ids, ids).backward()
bs = kareus.explain(compiled).regions[0].findings.get("find_blocks")
print(len(bs.split) if bs else 0)
"""

SETTINGS = {
    "passthrough": dict(nanobatches=1, disable_passes=("find_blocks", "split_nanobatches")),
    "split": dict(nanobatches=2),
}


def run_once(preset: str, cfg: dict) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(preset=preset, cfg=cfg)],
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - start, out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--presets", nargs="+", default=["tiny-4l", "tiny-16l"])
    args = parser.parse_args()
    print(f"measured: whole-process wall time, median of {args.runs} runs")
    print(f"{'model':10} {'setting':12} {'median s':>9} {'runs s':>24} {'blocks split':>13}")
    for preset in args.presets:
        medians = {}
        for name, cfg in SETTINGS.items():
            times, split = [], ""
            for _ in range(args.runs):
                t, split = run_once(preset, cfg)
                times.append(t)
            medians[name] = statistics.median(times)
            runs = " ".join(f"{t:.1f}" for t in times)
            print(f"{preset:10} {name:12} {medians[name]:9.1f} {runs:>24} {split:>13}")
        ratio = medians["split"] / medians["passthrough"]
        print(f"{preset:10} {'ratio':12} {ratio:9.2f}  (split / passthrough)")


if __name__ == "__main__":
    main()

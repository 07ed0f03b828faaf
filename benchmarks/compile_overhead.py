"""First-call time of ``kareus.compile`` against ``torch.compile(backend="aot_eager")``.

Each measurement is a fresh process (no warm Dynamo or AOTAutograd cache) that builds the
model and times its first forward and backward, where all compilation happens. Settings:

- ``aot_eager``: ``torch.compile(model, backend="aot_eager")``, the same capture and
  autograd lowering as kareus's python codegen, with no kareus pass;
- ``kareus``: ``kareus.compile(model)``, the default (every block split into two
  nanobatches, partitions cut, clock switches inserted);
- ``kareus-whole``: ``kareus.compile(model, nanobatches=1)`` (passes run, no split).

Prints the median of --runs runs per setting and the ratio kareus / aot_eager, measured
side by side in one run (the machine's load moves both).

Run: python benchmarks/compile_overhead.py [--runs 3] [--presets tiny-4l tiny-16l]
"""

import argparse
import statistics
import subprocess
import sys

CHILD = """
import time, torch, kareus
from kareus.models import PRESETS, Llama
torch.manual_seed(0)
model = Llama(PRESETS[{preset!r}])
setting = {setting!r}
if setting == "aot_eager":
    compiled = torch.compile(model, backend="aot_eager")
elif setting == "kareus":
    compiled = kareus.compile(model)
else:
    compiled = kareus.compile(model, nanobatches=1)
ids = torch.randint(0, 128, (8, 64))
start = time.perf_counter()
compiled(ids, ids).backward()
first = time.perf_counter() - start
split = ""
if setting != "aot_eager":
    bs = kareus.explain(compiled).regions[0].findings.get("find_blocks")
    split = len(bs.split) if bs else 0
print(first, split)
"""

SETTINGS = ("aot_eager", "kareus", "kareus-whole")


def run_once(preset: str, setting: str) -> tuple[float, str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(preset=preset, setting=setting)],
        capture_output=True,
        text=True,
        check=True,
    )
    first, split = [*out.stdout.strip().splitlines()[-1].split(" "), ""][:2]
    return float(first), split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--presets", nargs="+", default=["tiny-4l", "tiny-16l"])
    args = parser.parse_args()
    print(f"measured: first forward+backward, fresh process, median of {args.runs} runs")
    print(f"{'model':10} {'setting':13} {'median s':>9} {'runs s':>24} {'blocks split':>13}")
    for preset in args.presets:
        medians = {}
        for setting in SETTINGS:
            times, split = [], ""
            for _ in range(args.runs):
                t, split = run_once(preset, setting)
                times.append(t)
            medians[setting] = statistics.median(times)
            runs = " ".join(f"{t:.1f}" for t in times)
            print(f"{preset:10} {setting:13} {medians[setting]:9.1f} {runs:>24} {split:>13}")
        for setting in SETTINGS[1:]:
            ratio = medians[setting] / medians["aot_eager"]
            print(f"{preset:10} {'ratio':13} {ratio:9.2f}  ({setting} / aot_eager)")


if __name__ == "__main__":
    main()

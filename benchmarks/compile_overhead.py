"""First-call and step time of ``kareus.compile`` against ``torch.compile(backend="aot_eager")``.

First call: each measurement is a fresh process (no warm Dynamo or AOTAutograd cache) that
builds the model and times its first forward and backward, where all compilation happens.
Step time: one process compiles the model in every setting and times 10 forward+backward
steps of each in turn, 8 rounds; the least per setting, per step (steps of separate
processes at different times moved by up to 1.35x on this kind of machine). Settings:

- ``aot_eager``: ``torch.compile(model, backend="aot_eager")``, the same capture and
  autograd lowering as kareus's python codegen, with no kareus pass;
- ``kareus``: ``kareus.compile(model)``, the default (blocks that hold a collective split
  into two nanobatches — these tiny single-process models hold none, so none is split —,
  partitions cut, clock switches inserted);
- ``kareus-split``: ``kareus.compile(model, nanobatches=2)``, every block split, as
  blocks with collectives are;
- ``kareus-whole``: ``kareus.compile(model, nanobatches=1)`` (passes run, no split);
- ``kareus-split-each`` (first call only: its graphs are kareus-split's):
  ``nanobatches=2, trace_blocks_once=False``, every op traced through AOTAutograd, where
  the default traces a block called at least 16 times once for all its copies.

Prints the median of --runs runs per setting and the ratios to aot_eager, measured
side by side in one run (the machine's load moves all of them).

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
elif setting == "kareus-split":
    compiled = kareus.compile(model, nanobatches=2)
elif setting == "kareus-split-each":
    compiled = kareus.compile(model, nanobatches=2, trace_blocks_once=False)
else:
    compiled = kareus.compile(model, nanobatches=1)
ids = torch.randint(0, 128, (8, 64))
start = time.perf_counter()
compiled(ids, ids).backward()
first = time.perf_counter() - start
split = ""
if setting != "aot_eager":
    bs = kareus.explain(compiled).regions[0].findings.blocks
    split = len(bs.split) if bs else 0
print(first, split)
"""

STEPS = """
import copy, time, torch, kareus
from kareus.models import PRESETS, Llama
torch.manual_seed(0)
base = Llama(PRESETS[{preset!r}])
ids = torch.randint(0, 128, (8, 64))
fns = {{
    "aot_eager": torch.compile(copy.deepcopy(base), backend="aot_eager"),
    "kareus": kareus.compile(copy.deepcopy(base)),
    "kareus-split": kareus.compile(copy.deepcopy(base), nanobatches=2),
    "kareus-whole": kareus.compile(copy.deepcopy(base), nanobatches=1),
}}
for f in fns.values():
    for _ in range(3):
        f(ids, ids).backward()
best = dict.fromkeys(fns, float("inf"))
for _ in range(8):
    for name, f in fns.items():
        start = time.perf_counter()
        for _ in range(10):
            f(ids, ids).backward()
        best[name] = min(best[name], (time.perf_counter() - start) / 10)
print(" ".join(str(best[name]) for name in fns))
"""

SETTINGS = ("aot_eager", "kareus", "kareus-split", "kareus-whole")
FIRST_ONLY = ("kareus-split-each",)


def _child(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def run_once(preset: str, setting: str) -> tuple[float, str]:
    first, split = [*_child(CHILD.format(preset=preset, setting=setting)).split(" "), ""][:2]
    return float(first), split


def step_times(preset: str) -> dict[str, float]:
    """Seconds per steady step of each setting, measured side by side in one process."""
    got = _child(STEPS.format(preset=preset)).split(" ")
    return dict(zip(SETTINGS, map(float, got), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--presets", nargs="+", default=["tiny-4l", "tiny-16l"])
    args = parser.parse_args()
    print(
        f"measured: first forward+backward (fresh process each, median of {args.runs} runs) "
        "and steady step (every setting in one process, least of 8 x 10 steps)"
    )
    print(
        f"{'model':10} {'setting':17} {'first s':>8} {'runs s':>18} {'step ms':>8} "
        f"{'blocks split':>13}"
    )
    for preset in args.presets:
        firsts = {}
        steps = step_times(preset)
        for setting in SETTINGS + FIRST_ONLY:
            got = [run_once(preset, setting) for _ in range(args.runs)]
            firsts[setting] = statistics.median(g[0] for g in got)
            runs = " ".join(f"{g[0]:.1f}" for g in got)
            step = f"{steps[setting] * 1e3:8.1f}" if setting in steps else f"{'-':>8}"
            print(
                f"{preset:10} {setting:17} {firsts[setting]:8.1f} {runs:>18} "
                f"{step} {got[-1][1]:>13}"
            )
        for setting in SETTINGS[1:] + FIRST_ONLY:
            first = f"first call {firsts[setting] / firsts['aot_eager']:.2f}"
            step = f", step {steps[setting] / steps['aot_eager']:.2f}" if setting in steps else ""
            print(f"{preset:10} {'ratio':17} {first}{step}  ({setting} / aot_eager)")


if __name__ == "__main__":
    main()

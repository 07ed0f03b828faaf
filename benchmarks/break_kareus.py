"""Break kareus on purpose, one way at a time, and count the tests that notice.

Each break keeps kareus's own records and loses one effect (``kareus.testing.breaks``,
``KAREUS_BREAK``): ``split`` (the split pass records its split, the graph stays whole),
``overlap`` (the schedule decisions stay, the graph's order does not change), ``clocks`` (the
runtime records each switch, no clock is set), ``serial`` (the rewritten graphs stay, the
python codegen waits on each collective right after its launch). The break reaches the
test's own process and every rank ``run_ranks`` starts. For each, the test files that claim
that effect run under the break; the break is caught when at least one fails, and it is
reported apart for the multi-rank tests (marked ``distributed``), which must catch each
break too. The suite also runs a sample of this (``tests/test_effects.py``).

Run: python benchmarks/break_kareus.py [--files tests/test_x.py ...]   (about 10 minutes)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

MULTI_RANK = ["tests/test_tensor_parallel.py", "tests/test_stacks.py", "tests/test_models.py"]
"""Files of multi-rank tests that claim a split, an overlap and clocks on several ranks."""

CLAIMS = {
    "split": [
        "tests/test_effects.py", "tests/test_split_nanobatches.py", "tests/test_per_sample.py",
        "tests/test_outline.py", "tests/test_inductor.py", "tests/test_moe.py", *MULTI_RANK,
    ],
    "overlap": [
        "tests/test_effects.py", "tests/test_inductor.py", "tests/test_collectives.py",
        "tests/test_moe.py", *MULTI_RANK,
    ],
    "clocks": [
        "tests/test_effects.py", "tests/test_runtime.py", "tests/test_bad_input.py",
        "tests/test_api.py", *MULTI_RANK,
    ],
    "serial": ["tests/test_effects.py", "tests/test_tensor_parallel.py"],
}  # fmt: skip


def multi_rank(files: list[str]) -> set[str]:
    """The ids of the tests marked ``distributed`` (several ranks) in ``files``."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "distributed",
         "-p", "no:cacheprovider", *files],
        capture_output=True, text=True,
    )  # fmt: skip
    return {line.split("[")[0] for line in out.stdout.splitlines() if "::" in line}


def run(how: str, files: list[str]) -> tuple[int, list[str], float]:
    """Run ``files`` under ``KAREUS_BREAK=how``; return passed count, failed tests, seconds."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rf", "-p", "no:cacheprovider",
         "-n", "2", "--dist", "loadfile", *files],
        capture_output=True,
        text=True,
        env={**os.environ, "KAREUS_BREAK": how},
    )  # fmt: skip
    failed = re.findall(r"^FAILED (\S+)", out.stdout, flags=re.M)
    passed = re.search(r"(\d+) passed", out.stdout)
    return int(passed.group(1)) if passed else 0, failed, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="*", help="test files for every break")
    args = parser.parse_args(argv)
    missed = []
    for how, files in CLAIMS.items():
        files = args.files or files
        ranks = multi_rank(files)
        passed, failed, seconds = run(how, files)
        by_ranks = [name for name in failed if name.split("[")[0] in ranks]
        print(
            f"KAREUS_BREAK={how}: {len(failed)} failed ({len(by_ranks)} multi-rank), "
            f"{passed} passed ({seconds:.0f} s)"
        )
        for name in failed:
            print(f"  caught by {name}{' (multi-rank)' if name in by_ranks else ''}")
        if not failed:
            missed.append(how)
        elif not by_ranks:
            missed.append(f"{how} (by a multi-rank test)")
    if missed:
        print(f"NOT caught: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep PyTorch's OpInfo database: is kareus's per-sample verdict sound, and how complete?

For every op PyTorch describes (``torch.testing._internal.common_methods_invocations.op_db``)
that runs in float32 on the CPU, each sample input whose first tensor has a batch of 4 or
more is put to :func:`kareus.testing.per_sample_verdict`: kareus says whether it would
split the op along dimension 0, and where it says yes the op is run on the two halves and on
the whole and the outputs compared. A claim the numbers refute is **unsound** (a wrong
split: a bug); an op kareus never claims is a gap in coverage (a block left whole).

Run: python benchmarks/opinfo_sweep.py [--samples N] [--every K] [--ops NAME ...]
(the whole database takes several minutes; the suite runs every 12th op, tests/test_opinfo.py)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Row:
    """One sample of one op and kareus's verdict on it."""

    op: str
    sample: int
    claimed: bool
    holds: bool | None
    reason: str


def float32_ops(every: int = 1, names: Sequence[str] = ()) -> list[Any]:
    """Return the OpInfos that run in float32 on the CPU (every ``every``-th, by name)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = sorted(
        (o for o in op_db if torch.float32 in o.supported_dtypes("cpu")),
        key=lambda o: (o.name, o.variant_test_name),
    )
    if names:
        return [o for o in ops if o.name in names]
    return ops[::every]


def _samples(op: Any, limit: int) -> Iterator[Any]:
    count = 0
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        t = sample.input
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] >= 4:
            yield sample
            count += 1
            if count >= limit:
                return


def sweep(ops: Sequence[Any], samples: int = 2) -> list[Row]:
    """Return kareus's verdict on up to ``samples`` batched samples of each op."""
    from kareus.testing import per_sample_verdict

    rows = []
    for op in ops:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        try:
            batch = list(_samples(op, samples))
        except Exception as err:  # an OpInfo whose samples cannot be built here
            rows.append(Row(name, -1, False, None, f"no samples: {type(err).__name__}"))
            continue
        for i, sample in enumerate(batch):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                verdict = per_sample_verdict(op.op, sample.input, *sample.args, **sample.kwargs)
            rows.append(Row(name, i, verdict.claimed, verdict.holds, verdict.reason))
    return rows


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Counts by op: unsound, split (claimed and confirmed), left whole."""
    by_op: dict[str, list[Row]] = collections.defaultdict(list)
    for r in rows:
        by_op[r.op].append(r)
    unsound = sorted({r.op for r in rows if r.claimed and r.holds is False})
    split = sorted(op for op, rs in by_op.items() if any(r.claimed and r.holds for r in rs))
    whole = sorted(op for op, rs in by_op.items() if not any(r.claimed for r in rs))
    return {
        "ops": len(by_op),
        "samples": len(rows),
        "unsound": unsound,
        "split": split,
        "whole": whole,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2, help="batched samples per op")
    parser.add_argument("--every", type=int, default=1, help="every K-th op by name")
    parser.add_argument("--ops", nargs="*", default=(), help="only these ops")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = sweep(float32_ops(args.every, args.ops), args.samples)
    s = summary(rows)
    print(
        f"{s['ops']} ops, {s['samples']} samples in {time.perf_counter() - start:.0f} s "
        f"(measured wall time, this machine): {len(s['split'])} ops split and confirmed, "
        f"{len(s['whole'])} left whole, {len(s['unsound'])} unsound"
    )
    reasons = collections.Counter(
        r.reason.split(" (")[0] if "not known" not in r.reason else "not known to act per sample"
        for r in rows
        if not r.claimed
    )
    for reason, n in reasons.most_common(8):
        print(f"  left whole: {n:4d} samples: {reason[:100]}")
    for op in s["unsound"]:
        bad = [r for r in rows if r.op == op and r.claimed and r.holds is False]
        print(f"UNSOUND: {op} (sample {bad[0].sample})")
    return 1 if s["unsound"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate a GPU from a run of ``benchmarks/gpu_check.py`` on it, reproducibly.

Run ``python -m kareus.hardware.calibrate_check --check DIR --gpu h200 [--ran-at MHZ]
[--out JSON]``. It reads the check's ``ops.csv``, ``sizes.csv`` and ``energy.csv`` and fits,
each from its own measurement, the factors of :class:`~kareus.hardware.specs.Calibration`
that the borrowed (A100) calibration only guessed for this GPU:

- ``static_power_w``: the power of the idle window (``energy.csv``, row ``idle``).
- ``eff_gemm`` and ``eff_attention``: so that the median of measured / modelled time over
  the GEMM (attention) rows is 1 at the clock the kernels ran at; the model applies its
  power cap, so a GEMM asked to run at the top clock is priced at the clock it throttles to.
- ``activity["gemm"]``: so that the model's GEMM of the busy window (8192 x 8192 x 8192,
  bf16) runs at the clock NVML read under that load (the power cap's clock).

The rest (collective, contention, voltage) stays the borrowed calibration's: one GPU's
check measures no collective. The fit is in-sample: the report gives each factor's source
and the ratios it reaches on the rows it was fitted to, nothing more.

The check's rows carry the clock read while they ran (``clock_mhz``); runs made before
gpu_check read it there recorded the idle clock in that column, and ``--ran-at`` says the
clock they ran at instead (the 2026-12-04 H200 run: 1980 MHz, the README beside its CSVs).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import pathlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from kareus.hardware.emulator import Emulator
from kareus.hardware.specs import Calibration, GPUSpec, gpu
from kareus.ir.costs import OpClass, OpCost

SHAPES = {  # hidden, intermediate, heads, kv heads: gpu_check's TP 8 layers (head dim 128)
    "llama3.2-3b": (3072, 8192, 24, 8),
    "llama3.1-8b": (4096, 14336, 32, 8),
    "llama3.3-70b": (8192, 28672, 64, 8),
}
_TOKENS, _TP = 4 * 4096, 8
BUSY_GEMM = OpCost("gemm", 2 * 8192**3, 3 * 8192 * 8192 * 2, "bf16", "busy", (1, 8192, 8192, 8192))
"""The busy window's GEMM (``a @ a``, bf16, 8192 square)."""


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One timed op of the check: its kareus cost, the time measured and the clock."""

    name: str
    op_class: str
    ops: tuple[OpCost, ...]
    measured_s: float
    clock_mhz: float


def _mm(name: str, m: int, n: int, k: int, row: dict[str, str]) -> tuple[OpCost, ...]:
    return (
        OpCost("gemm", 2.0 * m * n * k, float(row["mbytes"]) * 1e6, "bf16", name, (1, m, n, k)),
    )


def _gemm_dims(row: dict[str, str]) -> tuple[int, int, int] | None:
    """(M, N, K) of a GEMM row of ``ops.csv`` or ``sizes.csv``, from its name."""
    op = row["op"]
    if "model" in row and op.startswith("gemm "):
        h, i, heads, kv = SHAPES[row["model"]]
        return {
            "gemm qkv": (_TOKENS, (heads + 2 * kv) * 128 // _TP, h),
            "gemm out_proj": (_TOKENS, h, heads * 128 // _TP),
            "gemm fc1": (_TOKENS, 2 * i // _TP, h),
            "gemm fc2": (_TOKENS, h, i // _TP),
        }[op]
    words = op.replace(":", "").split()
    if op.startswith("square "):
        n = int(words[1])
        return n, n, n
    if op.startswith("fc1 tokens "):
        return int(words[2]), 4096, 3072
    if op.startswith("one wave"):
        return int(words[-3]), 128, 4096
    if op.startswith("key projection"):
        return 16384, 128, 3072
    if op.startswith("its weight gradient"):
        return 128, 3072, 16384
    return None


def load_rows(directory: pathlib.Path, ran_at: float | None = None) -> list[CheckRow]:
    """Read the GEMM, attention and memory rows of a check's ``ops.csv`` and ``sizes.csv``."""
    rows = []
    for name in ("ops.csv", "sizes.csv"):
        with (directory / name).open() as fh:
            for row in csv.DictReader(fh):
                cls = row["class"]
                flops, nbytes = float(row["gflop"]) * 1e9, float(row["mbytes"]) * 1e6
                if cls == "gemm":
                    dims = _gemm_dims(row)
                    if dims is None:
                        continue
                    ops = _mm(row["op"], *dims, row)
                elif cls in ("attention", "memory"):
                    k = int(row.get("kernels_costed") or 1)  # its kernels, alike
                    kind: OpClass = "attention" if cls == "attention" else "memory"
                    ops = tuple(
                        OpCost(kind, flops / k, nbytes / k, "bf16", row["op"]) for _ in range(k)
                    )
                else:
                    continue
                clock = ran_at if ran_at is not None else float(row["clock_mhz"])
                rows.append(CheckRow(row["op"], cls, ops, float(row["measured_s"]), clock))
    return rows


def load_energy(directory: pathlib.Path) -> dict[str, dict[str, float]]:
    """Return the check's energy windows by name (``power_w``, ``clock_mhz``)."""
    with (directory / "energy.csv").open() as fh:
        return {
            r["window"]: {"power_w": float(r["power_w"]), "clock_mhz": float(r["clock_mhz"] or 0)}
            for r in csv.DictReader(fh)
        }


def ratios(spec: GPUSpec, rows: Sequence[CheckRow], op_class: str) -> list[float]:
    """Measured / modelled time of the rows of ``op_class`` at the clock each ran at."""
    emu = Emulator(spec)
    return [
        r.measured_s / emu.ops(r.ops, r.clock_mhz).time_s for r in rows if r.op_class == op_class
    ]


def _solve(f: Callable[[float], float], lo: float, hi: float, target: float) -> float:
    """Return the x in [lo, hi] where the monotone ``f`` reaches ``target`` (bisection)."""
    rising = f(hi) > f(lo)
    for _ in range(50):
        mid = (lo + hi) / 2
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _with(base: GPUSpec, cal: Calibration, **changes: Any) -> GPUSpec:
    return dataclasses.replace(base, calibration=dataclasses.replace(cal, **changes))


def _fit_round(
    base: GPUSpec, cal: Calibration, rows: Sequence[CheckRow], capped_mhz: float
) -> Calibration:
    """Fit the GEMM and attention efficiencies, then the GEMM's activity, once."""
    eff_gemm = _solve(
        lambda e: statistics.median(ratios(_with(base, cal, eff_gemm=e), rows, "gemm")),
        0.2, 1.0, 1.0,
    )  # fmt: skip
    cal = dataclasses.replace(cal, eff_gemm=eff_gemm)
    eff_att = _solve(
        lambda e: statistics.median(ratios(_with(base, cal, eff_attention=e), rows, "attention")),
        0.2, 1.0, 1.0,
    )  # fmt: skip
    cal = dataclasses.replace(cal, eff_attention=eff_att)
    top = float(base.clock_max_mhz)
    act = _solve(
        lambda a: Emulator(
            _with(base, cal, activity={**cal.activity, "gemm": a})
        ).running_clock(BUSY_GEMM, top),
        0.3, 3.0, capped_mhz,
    )  # fmt: skip
    return dataclasses.replace(cal, activity={**cal.activity, "gemm": act})


def fit_check(
    name: str, directory: pathlib.Path, ran_at: float | None = None
) -> tuple[Calibration, dict[str, object]]:
    """Fit ``name``'s calibration to the check in ``directory``; return it and a report."""
    base = gpu(name, own_calibration=False)  # the borrowed factors, whatever is shipped
    rows = load_rows(directory, ran_at)
    energy = load_energy(directory)
    cal = dataclasses.replace(base.calibration, static_power_w=energy["idle"]["power_w"])
    capped = energy["busy-gemm"]["clock_mhz"]
    top = float(base.clock_max_mhz)

    for _round in range(3):  # the efficiencies and the GEMM's power move each other
        cal = _fit_round(base, cal, rows, capped)
    spec = dataclasses.replace(base, calibration=cal)
    emu = Emulator(spec)
    busy_clock = emu.running_clock(BUSY_GEMM, top)
    busy = emu.ops((BUSY_GEMM,), top)
    report: dict[str, object] = {
        "rows": len(rows),
        "median_ratio": {
            c: statistics.median(ratios(spec, rows, c)) for c in ("gemm", "attention", "memory")
        },
        "ratio_range": {
            c: [min(ratios(spec, rows, c)), max(ratios(spec, rows, c))]
            for c in ("gemm", "attention", "memory")
        },
        "idle_power_w": {"measured": energy["idle"]["power_w"], "modelled": emu.idle(1.0).energy_j},
        "busy_gemm_clock_mhz": {"measured": capped, "modelled": busy_clock},
        "busy_gemm_power_w": {
            "measured": energy["busy-gemm"]["power_w"],
            "modelled": busy.energy_j / busy.time_s,
        },
        "in_sample": True,
    }
    return cal, report


def main(argv: Sequence[str] | None = None) -> None:
    """Fit from the command line and write the calibration file (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", type=pathlib.Path, required=True, help="gpu_check's CSVs")
    parser.add_argument("--gpu", required=True, help="kareus GPU type the check ran on")
    parser.add_argument("--ran-at", type=float, help="the clock the rows ran at (old checks)")
    parser.add_argument("--out", type=pathlib.Path, help="calibration JSON to write")
    parser.add_argument("--source", default="", help="what the check was (for provenance)")
    args = parser.parse_args(argv)
    cal, report = fit_check(args.gpu, args.check, args.ran_at)
    provenance = (
        f"fitted by kareus.hardware.calibrate_check to {report['rows']} timed ops and the "
        f"idle and busy-GEMM energy windows of a gpu_check run ({args.source or args.check})"
        f"{f', rows at {args.ran_at:g} MHz' if args.ran_at else ''}; static power, GEMM "
        "and attention efficiency and GEMM activity measured on this GPU, the rest borrowed "
        f"from the A100's calibration; on {datetime.date.today().isoformat()}"
    )
    cal = dataclasses.replace(cal, source=provenance)
    out = {"provenance": provenance, "calibration": cal.to_dict(), "fit": report}
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

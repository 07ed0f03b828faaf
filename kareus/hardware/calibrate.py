"""Fit the hardware model's free factors to measured partitions, reproducibly.

Run ``python -m kareus.hardware.calibrate [--data CSV] [--clock-data CSV] [--out JSON]``. It
reads the measured forward-attention partition of two A100-SXM4 GPUs at tensor parallelism 2
(shared/data) at the default clock and locked at 1200 MHz, fits the
:class:`~kareus.hardware.specs.Calibration` factors that no datasheet gives (the collective's
per-SM copy rate, thread and contention factors, the activity of stalled kernels and of the
collective, the share of static power that is clock switching, the voltage floor) by least
squares on log time and log energy of every row and on the log ratios between rows that
kareus plans on (:func:`differences`), and writes them with their provenance to
``kareus/hardware/calibration/a100_sxm4.json``. Datasheet numbers (peaks, bandwidths, TDP, SM
count) and the priors of :data:`kareus.hardware.specs.PRIORS` are not fitted.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
from collections.abc import Sequence

from kareus.hardware.emulator import Emulator, Harness
from kareus.hardware.specs import GPUS, PRIORS, Calibration, GPUSpec
from kareus.ir.costs import CollectiveCost, Knobs, OpCost, PartitionWork


def shared_data_dir() -> pathlib.Path:
    """Return the directory of the reference measurements kareus is checked against.

    ``$KAREUS_SHARED_DATA``, else ``shared/data`` next to the repository (where the project
    keeps them; they are not copied into the repository).
    """
    env = os.environ.get("KAREUS_SHARED_DATA")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"


DEFAULT_DATA = shared_data_dir() / "a100_fwd_attention_tp2" / "default_clock.csv"
CLOCK_DATA = shared_data_dir() / "a100_fwd_attention_tp2" / "clock_1200mhz.csv"
"""The same partition with the SM clock locked at 1200 MHz: the clock response."""
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "calibration" / "a100_sxm4.json"


def attention_partition() -> PartitionWork:
    """Return the measured partition: Megatron forward attention, hidden 2048, TP 2.

    One nanobatch (2 sequences of 4096 tokens) in fp16; per rank 16 heads of 64, QKV output
    3072 columns; overlapped with an all-reduce of the other nanobatch's 2 x 4096 x 2048 fp16
    activation across 2 GPUs. FLOPs and bytes follow from the shapes (see the data README).
    """
    tokens, hidden, qkv, heads, head_dim, seq, batch = 8192, 2048, 3072, 16, 64, 4096, 2
    act = tokens * hidden * 2  # one [tokens, hidden] fp16 activation, bytes
    ops = (
        OpCost(
            "memory", 3 * tokens * hidden, 3 * act + tokens * hidden, "fp16", "bias_dropout_add"
        ),
        OpCost("memory", 8 * tokens * hidden, 2 * act, "fp16", "layer_norm"),
        OpCost(
            "gemm",
            2 * tokens * hidden * qkv,
            act + hidden * qkv * 2 + tokens * qkv * 2,
            "fp16",
            "qkv_linear",
        ),
        OpCost("memory", 0, 2 * tokens * qkv * 2, "fp16", "split_heads"),
        OpCost(
            "memory",
            6 * tokens * 2 * heads * head_dim,
            4 * tokens * heads * head_dim * 2,
            "fp16",
            "rotary",
        ),
        OpCost(
            "attention",
            4 * batch * heads * seq * seq * head_dim / 2,  # causal: half the square
            4 * tokens * heads * head_dim * 2,
            "fp16",
            "flash_attention",
        ),
        OpCost(
            "gemm",
            2 * tokens * heads * head_dim * hidden,
            tokens * heads * head_dim * 2 + heads * head_dim * hidden * 2 + act,
            "fp16",
            "out_proj",
        ),
    )
    return PartitionWork(ops, CollectiveCost("all_reduce", act, 2, "tp_all_reduce"))


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration: knobs, median time (s) and median total energy (J)."""

    knobs: Knobs
    time_s: float
    energy_j: float  # both GPUs


def load_rows(path: pathlib.Path, freq_mhz: float = 1410) -> list[Row]:
    """Read the measured CSV; each row's value is the median of its repeats."""
    if not path.is_file():
        raise FileNotFoundError(
            f"no reference measurements at {path}: set KAREUS_SHARED_DATA to the project's "
            "shared/data directory (or pass --data)"
        )
    rows = []
    with open(path) as fh:
        for rec in csv.DictReader(fh):
            start, end = int(rec["overlap_start"]), int(rec["overlap_end"])
            repeats = sorted({k.split(":")[0] for k in rec if ":" in k})
            knobs = Knobs(
                freq_mhz=freq_mhz,
                sm_share=int(rec["comm_sm_number"]),
                launch_slot=None if start < 0 else start,
                wait_after=None if end < 0 else end,
                threads_per_block=int(rec["comm_block_size"]),
            )
            rows.append(
                Row(
                    knobs,
                    statistics.median(float(rec[f"{r}:time (s)"]) for r in repeats),
                    statistics.median(float(rec[f"{r}:total energy (J)"]) for r in repeats),
                )
            )
    return rows


def calibration_rows(
    data: pathlib.Path = DEFAULT_DATA, clock_data: pathlib.Path = CLOCK_DATA
) -> list[Row]:
    """Return the rows the calibration is fitted to: default clocks, then 1200 MHz."""
    return load_rows(data) + load_rows(clock_data, 1200)


# Fitted factors: (name, lower bound, upper bound). Activity entries are "activity.<class>".
# The compute efficiencies, launch overhead and collective latency are not fitted: the data
# vary communication knobs only and cannot identify them (kareus.hardware.specs.PRIORS).
FREE = (
    ("comm_gbs_per_sm", 0.5, 50.0),
    ("comm_thread_exponent", 0.0, 2.0),
    ("contention", 0.0, 3.0),
    ("activity.memory", 0.0, 1.0),
    ("activity.comm", 0.0, 1.5),
    # The clock response (identified by the 1200 MHz rows): the share of static power that
    # is clock switching, and the voltage floor below the knee (Ampere's core voltage runs
    # about 0.65-1.08 V: a floor of 0.60-0.95 of the top).
    ("static_clock_share", 0.0, 0.9),
    ("v_floor", 0.6, 0.95),
)

HARNESS = (
    ("compute_slowdown", 1.0, 4.0),
    ("issue_ms_per_op", 0.0, 2.0),
    ("stall_clock_share", 0.0, 1.0),
)
"""Factors of the measuring harness, not of the GPU: fitted with :data:`FREE` to this data set
and never used in planning (:class:`~kareus.hardware.emulator.Harness`)."""


def shipped_harness() -> Harness:
    """Return the harness factors fitted with the shipped calibration (:data:`HARNESS`)."""
    fitted = json.loads(DEFAULT_OUT.read_text()).get("fit", {})
    issue_ms = fitted.get("issue_ms_per_op")
    return Harness(
        float(fitted.get("compute_slowdown", 1.0)),
        None if issue_ms is None else float(issue_ms) * 1e-3,
        float(fitted.get("stall_clock_share", 1.0)),
    )


def with_params(base: Calibration, values: Sequence[float], source: str) -> Calibration:
    """Return ``base`` with the :data:`FREE` factors set to ``values``."""
    plain, activity = {}, dict(base.activity)
    for (name, _lo, _hi), value in zip(FREE, values, strict=True):
        if name.startswith("activity."):
            activity[name.split(".", 1)[1]] = float(value)
        else:
            plain[name] = float(value)
    return dataclasses.replace(base, activity=activity, source=source, **plain)


def predict(
    spec: GPUSpec, rows: Sequence[Row], gpus: int = 2, harness: Harness | None = None
) -> list[tuple[float, float]]:
    """Return (time_s, energy_j of all ``gpus``) the model predicts for each row.

    ``harness`` describes how the rows were measured (:class:`Harness`); None is a training
    job's.
    """
    emu, work = Emulator(spec, harness), attention_partition()
    out = []
    for row in rows:
        est = emu.partition(work, row.knobs)
        out.append((est.time_s, est.energy_j * gpus))
    return out


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted calibration, the data set's harness factors, and the factors at a bound."""

    calibration: Calibration
    harness: Harness
    at_bound: tuple[str, ...]


DIFFERENCE_WEIGHT = 2.0
"""Weight of a difference between two rows against a row's level in the fit's criterion."""


def differences(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """Return (row, baseline row) index pairs: the differences kareus plans on.

    Each overlapped row against the serial row of its clock, SM count and CTA size (what
    overlap saves), and each row at another clock against the same knobs at the highest
    clock in ``rows`` (what the clock saves). The fit weighs these log ratios beside the
    rows' levels: a model right per row but wrong on differences would plan wrongly.
    """
    top = max(r.knobs.freq_mhz for r in rows)
    index = {r.knobs: i for i, r in enumerate(rows)}
    out = []
    for i, row in enumerate(rows):
        k = row.knobs
        if k.launch_slot is not None:
            serial = dataclasses.replace(k, launch_slot=None, wait_after=None)
            if serial in index:
                out.append((i, index[serial]))
        if k.freq_mhz != top and (j := index.get(dataclasses.replace(k, freq_mhz=top))) is not None:
            out.append((i, j))
    return out


def _initial(base: Calibration, spec: GPUSpec) -> list[float]:
    x0 = []
    for name, lo, hi in FREE:
        if name.startswith("activity."):
            v = base.activity[name.split(".", 1)[1]]
        elif name == "v_floor":
            v = base.v_floor if base.v_floor is not None else spec.v_floor
        else:
            v = getattr(base, name)
        x0.append(min(max(v, lo), hi))
    return [*x0, 2.0, 0.1, 0.5]


def fit(spec: GPUSpec, rows: Sequence[Row]) -> Fit:
    """Fit the :data:`FREE` factors and the :data:`HARNESS` factors by least squares.

    On log time and log energy of every row and, weighted by :data:`DIFFERENCE_WEIGHT`,
    on the log ratios of :func:`differences`; the :data:`~kareus.hardware.specs.PRIORS`
    stay as they are.
    """
    import numpy as np
    from scipy.optimize import least_squares

    base = spec.calibration
    x0 = _initial(base, spec)
    meas = np.log([[r.time_s, r.energy_j] for r in rows])
    pairs = np.array(differences(rows) or [(0, 0)])
    meas_diff = meas[pairs[:, 0]] - meas[pairs[:, 1]]
    n = len(FREE)

    def harness(x: np.ndarray) -> Harness:
        return Harness(float(x[n]), float(x[n + 1]) * 1e-3, float(x[n + 2]))

    def residuals(x: np.ndarray) -> np.ndarray:
        cal = with_params(base, list(x[:n]), "fit in progress")
        pred = np.log(predict(spec.with_calibration(cal, ""), rows, harness=harness(x)))
        diff = pred[pairs[:, 0]] - pred[pairs[:, 1]] - meas_diff
        return np.concatenate([(pred - meas).ravel(), DIFFERENCE_WEIGHT * diff.ravel()])

    names = [*FREE, *HARNESS]
    bounds = ([b[1] for b in names], [b[2] for b in names])
    result = least_squares(residuals, x0, bounds=bounds, x_scale="jac", max_nfev=120)
    at_bound = tuple(
        name
        for (name, lo, hi), v in zip(names, result.x, strict=True)
        if min(v - lo, hi - v) <= 1e-3 * (hi - lo)
    )
    return Fit(with_params(base, list(result.x[:n]), ""), harness(result.x), at_bound)


def main(argv: Sequence[str] | None = None) -> None:
    """Fit and write the A100 calibration; print the fitted factors."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--clock-data",
        type=pathlib.Path,
        default=CLOCK_DATA,
        help="the same partition at a locked 1200 MHz (the clock response)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in (args.data, args.clock_data):
        if not path.exists():
            raise SystemExit(f"measured data not found at {path}; pass --data/--clock-data PATH")
    rows = calibration_rows(args.data, args.clock_data)
    spec = GPUS["a100-sxm4-40gb"]
    fitted = fit(spec, rows)
    cal = fitted.calibration
    provenance = (
        f"fitted by kareus.hardware.calibrate to {len(rows)} measured configurations of "
        "shared/data/a100_fwd_attention_tp2 (Kareus research code, commit 9b64d9e9; two "
        "A100-SXM4, fp16 forward-attention partition at TP 2; default clocks and locked "
        f"1200 MHz), levels and differences, on {datetime.date.today().isoformat()}"
    )
    cal = dataclasses.replace(cal, source=provenance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "provenance": provenance,
        "calibration": cal.to_dict(),
        "fit": {
            "compute_slowdown": fitted.harness.compute_slowdown,
            "issue_ms_per_op": (fitted.harness.issue_s_per_op or 0.0) * 1e3,
            "stall_clock_share": fitted.harness.stall_clock_share,
            "at_bound": list(fitted.at_bound),
        },
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    fitted_names = {n.removeprefix("activity.") for n, _lo, _hi in FREE}
    for key, value in cal.to_dict().items():
        if key != "source":
            how = "prior" if key in PRIORS else "fitted" if key in fitted_names else ""
            if key == "activity":
                how = ", ".join(f"{c} {'fitted' if c in fitted_names else 'prior'}" for c in value)
            print(f"{key:26} {value}  {how}")
    issue_ms = (fitted.harness.issue_s_per_op or 0.0) * 1e3
    for name, value in (
        ("compute_slowdown", fitted.harness.compute_slowdown),
        ("issue_ms_per_op", issue_ms),
        ("stall_clock_share", fitted.harness.stall_clock_share),
    ):
        print(f"{name:26} {value}  harness (this data set only)")
    print("fitted factors at a bound: " + (", ".join(fitted.at_bound) or "none"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

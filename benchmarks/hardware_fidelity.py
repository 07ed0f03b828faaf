"""How well the hardware model reproduces measured partitions (figures are printed).

Compares the calibrated A100 model with every row of the measured forward-attention
partition (shared/data/a100_fwd_attention_tp2, next to the repository), at the default clock
and locked at 1200 MHz: absolute percentage errors of time and energy per clock, Spearman
rank correlation of configurations; the differences kareus plans on (each overlapped row
against its serial row, each 1200 MHz row against its default-clock row: time, energy and
power ratios, measured and modelled); and the qualitative facts (collective time
saturating at a handful of SMs; which overlap windows are best). Also checks GEMM time at
max clock against the spec's peak and idle power against static power.

These figures are **in-sample**: the shipped calibration was fitted to these very rows.
``--cross-validate K`` also refits the calibration K times, each time without one fold of
whole SM counts (every row of a held-out SM count left out), and scores the held-out rows:
the **cross-validated** figures, printed beside the in-sample ones.

Run: python benchmarks/hardware_fidelity.py [--data CSV] [--clock-data CSV] [--cross-validate K]
"""

import argparse
import collections
import pathlib
import statistics

from scipy.stats import spearmanr

from kareus.hardware import Emulator, gpu
from kareus.hardware.calibrate import (
    CLOCK_DATA,
    DEFAULT_DATA,
    calibration_rows,
    differences,
    fit,
    predict,
    shipped_harness,
)
from kareus.ir.costs import OpCost


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def fidelity(rows, pred):
    """Per clock: absolute percentage errors and rank correlations of the rows."""
    out = {}
    for clock in sorted({r.knobs.freq_mhz for r in rows}, reverse=True):
        pairs = [(r, p) for r, p in zip(rows, pred, strict=True) if r.knobs.freq_mhz == clock]
        t_err = [abs(p[0] - r.time_s) / r.time_s * 100 for r, p in pairs]
        e_err = [abs(p[1] - r.energy_j) / r.energy_j * 100 for r, p in pairs]
        at = f"{clock:.0f} MHz ({len(pairs)} rows)"
        out |= {
            f"{at}: time APE median %": statistics.median(t_err),
            f"{at}: time APE p90 %": percentile(t_err, 0.9),
            f"{at}: energy APE median %": statistics.median(e_err),
            f"{at}: energy APE p90 %": percentile(e_err, 0.9),
            f"{at}: Spearman rho time": spearmanr(
                [r.time_s for r, _ in pairs], [p[0] for _, p in pairs]
            ).statistic,
            f"{at}: Spearman rho energy": spearmanr(
                [r.energy_j for r, _ in pairs], [p[1] for _, p in pairs]
            ).statistic,
        }
    return out


def _ratios(rows, pred, pairs, which):
    """Measured and modelled ratios of row i to row j for (i, j) in ``pairs``."""
    pick = {
        "time": lambda r, p: (r.time_s, p[0]),
        "energy": lambda r, p: (r.energy_j, p[1]),
        "power": lambda r, p: (r.energy_j / r.time_s, p[1] / p[0]),
    }[which]
    out = []
    for i, j in pairs:
        (mi, pi), (mj, pj) = pick(rows[i], pred[i]), pick(rows[j], pred[j])
        out.append((mi / mj, pi / pj))
    return out


def differences_figures(rows, pred):
    """What kareus plans on: overlap against serial, and the clock's response.

    Medians over the pairs of :func:`kareus.hardware.calibrate.differences` of the measured
    and the modelled ratio, and of the absolute difference between the two.
    """
    out = {}
    pairs = differences(rows)
    groups = {
        "overlapped / serial": [
            (i, j) for i, j in pairs if rows[i].knobs.freq_mhz == rows[j].knobs.freq_mhz
        ],
        "lower clock / default": [
            (i, j) for i, j in pairs if rows[i].knobs.freq_mhz != rows[j].knobs.freq_mhz
        ],
    }
    for label, group in groups.items():
        if not group:
            continue
        clocks = sorted({rows[i].knobs.freq_mhz for i, _ in group})
        if label.startswith("lower"):
            label = f"{'/'.join(f'{c:.0f}' for c in clocks)} MHz / default"
        for which in ("time", "energy", "power"):
            ratios = _ratios(rows, pred, group, which)
            out[f"{label} {which} ratio, median measured"] = statistics.median(m for m, _ in ratios)
            out[f"{label} {which} ratio, median modelled"] = statistics.median(p for _, p in ratios)
            out[f"{label} {which} ratio, median |modelled - measured|"] = statistics.median(
                abs(p - m) for m, p in ratios
            )
    return out


def saturation_sms(series, tol=0.10):
    """Smallest SM count whose no-overlap time is within tol of the largest count's."""
    last = series[max(series)]
    return min(n for n, t in series.items() if t <= last * (1 + tol))


def qualitative(rows, pred):
    out = {}
    meas_noov, model_noov = {}, {}
    by_sms = collections.defaultdict(dict)
    for r, p in zip(rows, pred, strict=True):
        k = r.knobs
        if k.threads_per_block != 1024:
            continue
        if k.launch_slot is None:
            meas_noov[k.sm_share], model_noov[k.sm_share] = r.time_s, p[0]
        else:
            by_sms[k.sm_share][(k.launch_slot, k.wait_after)] = (r.time_s, p[0])
    out["collective saturates at (SMs, within 10%): measured"] = saturation_sms(meas_noov)
    out["collective saturates at (SMs, within 10%): model"] = saturation_sms(model_noov)
    hits, regrets = 0, []
    for windows in by_sms.values():
        meas_rank = sorted(windows, key=lambda w: windows[w][0])
        model_best = min(windows, key=lambda w: windows[w][1])
        hits += model_best in meas_rank[:3]
        regrets.append(windows[model_best][0] / windows[meas_rank[0]][0] - 1)
    out["model's best window in measured top 3 (share of SM counts)"] = hits / len(by_sms)
    out["measured slowdown of model's best window vs measured best, median %"] = (
        statistics.median(regrets) * 100
    )
    best_meas = min(zip(rows, pred, strict=True), key=lambda rp: rp[0].time_s)
    best_model = min(zip(rows, pred, strict=True), key=lambda rp: rp[1][0])
    out["fastest configuration measured (start,end,SMs,threads)"] = _knobs(best_meas[0].knobs)
    out["fastest configuration by the model"] = _knobs(best_model[0].knobs)
    out["measured time of the model's pick vs measured fastest, %"] = (
        best_model[0].time_s / best_meas[0].time_s - 1
    ) * 100
    return out


def _at_default(rows, pred):
    top = max(r.knobs.freq_mhz for r in rows)
    kept = [(r, p) for r, p in zip(rows, pred, strict=True) if r.knobs.freq_mhz == top]
    return [r for r, _ in kept], [p for _, p in kept]


def _knobs(k):
    return (k.launch_slot, k.wait_after, k.sm_share, k.threads_per_block)


def spec_checks():
    spec = gpu("a100-sxm4-40gb")
    emu = Emulator(spec)
    n = 8192
    gemm = OpCost("gemm", 2 * n**3, 3 * n * n * 2, "fp16")
    est = emu.ops((gemm,), spec.clock_max_mhz)
    achieved = gemm.flops / est.time_s / 1e12
    idle = emu.idle(1.0)
    return {
        "GEMM 8192^3 fp16 at max clock, TFLOP/s (model)": achieved,
        "  / datasheet peak": achieved / spec.peak_tflops["fp16"],
        "idle power W (model)": idle.avg_power_w,
        "static power W (calibrated)": spec.calibration.static_power_w,
    }


def folds_by_sm_share(rows, k):
    """Split the rows into ``k`` folds of whole SM counts (round-robin over sorted counts)."""
    shares = sorted({r.knobs.sm_share for r in rows})
    fold_of = {share: i % k for i, share in enumerate(shares)}
    return [[i for i, r in enumerate(rows) if fold_of[r.knobs.sm_share] == f] for f in range(k)]


def cross_validated(spec, rows, k):
    """Predict every row with a calibration fitted without its fold; print each fold's fit."""
    pred = [None] * len(rows)
    for f, held in enumerate(folds_by_sm_share(rows, k)):
        held_set = set(held)
        train = [r for i, r in enumerate(rows) if i not in held_set]
        fitted = fit(spec, train)
        model = spec.with_calibration(fitted.calibration, f"cross-validation fold {f}")
        held_pred = predict(model, [rows[i] for i in held], harness=fitted.harness)
        for i, p in zip(held, held_pred, strict=True):
            pred[i] = p
        shares = sorted({rows[i].knobs.sm_share for i in held})
        bound = ", ".join(fitted.at_bound) or "none"
        print(f"  fold {f}: held out SM counts {shares} ({len(held)} rows); at a bound: {bound}")
    return pred


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA)
    parser.add_argument("--clock-data", type=pathlib.Path, default=CLOCK_DATA)
    parser.add_argument(
        "--cross-validate",
        type=int,
        metavar="K",
        help="also refit without each of K folds of whole SM counts and score the held-out rows",
    )
    args = parser.parse_args()
    rows = calibration_rows(args.data, args.clock_data)
    spec = gpu("a100-sxm4-40gb")
    harness = shipped_harness()  # how the data set was measured, fitted with it
    pred = predict(spec, rows, harness=harness)
    name = args.data.parent.name
    print(f"hardware model (modelled) vs {len(rows)} measured configurations of {name}")
    print(f"calibration: {spec.calibration_source}")
    sections = [
        ("fidelity, in-sample (the calibration was fitted to these rows)", fidelity(rows, pred)),
        ("differences, in-sample", differences_figures(rows, pred)),
    ]
    if args.cross_validate:
        print(f"\nrefitting {args.cross_validate} times, each without one fold of SM counts")
        held = cross_validated(spec, rows, args.cross_validate)
        sections.append(
            (
                f"fidelity, cross-validated ({args.cross_validate} folds of SM counts held out)",
                fidelity(rows, held),
            )
        )
        sections.append(("differences, cross-validated", differences_figures(rows, held)))
    for title, figures in (
        *sections,
        ("qualitative facts (default clocks)", qualitative(*_at_default(rows, pred))),
        ("spec checks", spec_checks()),
    ):
        print(f"\n{title}")
        for key, value in figures.items():
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"  {key:72} {shown}")


if __name__ == "__main__":
    main()

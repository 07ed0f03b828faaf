"""kareus's hardware model against the reference A100 pipeline plans, plan by plan (printed).

The reference (``shared/data/a100_llama_pipeline_plans``, next to the repository): Llama 3.2
3B on 16 A100-SXM4-40GB, PP 2 with 15/13 layers, 8 micro-batches, synchronous 1F1B, bf16,
full activation recompute; 85 per-instruction clock plans (Perseus, and nanobatching +
Perseus) with the iteration time and energy the research artifact predicted for each from
instruction profiles measured in situ. Each plan's clocks are priced by ``kareus evaluate``
(:func:`kareus.jobs.evaluate.evaluate_clock_plans`) on kareus's A100 model — the same workload,
recompute, stage split, clocks and 1F1B order; ``megatron`` for the Perseus plans,
``nanobatch`` for the nanobatching ones — and compared with the reference: per
configuration and method, the median and largest absolute error of time and of energy (one
GPU per stage, the reference's unit), and the Spearman correlation of the plans by energy;
then the same over all plans, and the partition data set's errors
(``a100_fwd_attention_tp2``, as ``hardware_fidelity.py`` computes them).

kareus's figures are **modelled**; the reference's are the artifact's predictions from
**measured** profiles.

The plans' energies are **in-sample** for the A100 voltage curve, which was chosen on these
85 plans; their times are held out but for the nanobatching sets' clock response, on which
the contended clock exponent was chosen (``--fit-contended-clock``, which also says what
each configuration left out chooses). ``--cross-validate`` chooses the curve without each
configuration in turn and scores the configuration left out, beside the in-sample figures.

Run: python benchmarks/pipeline_fidelity.py [--recompute full|none|selective] [--configs N]
     python benchmarks/pipeline_fidelity.py --set mem_clock_knee=1.0   (a factor changed,
         the others refitted: what a candidate cause does to the figures)
     python benchmarks/pipeline_fidelity.py --fit-voltage-curve   (the A100 curve's grid)
     python benchmarks/pipeline_fidelity.py --cross-validate      (leave one configuration out)
     python benchmarks/pipeline_fidelity.py --fit-contended-clock (the exponent's grid)
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from scipy.stats import spearmanr

from kareus.hardware import GPUS, GPUSpec, gpu
from kareus.hardware.calibrate import (
    DEFAULT_DATA,
    FREE,
    calibration_rows,
    fit,
    predict,
    shared_data_dir,
    shipped_harness,
)
from kareus.hardware.emulator import Harness
from kareus.jobs.evaluate import ClockPlan, evaluate_clock_plans, stage_orders
from kareus.jobs.trace import Workload
from kareus.planner.dag import makespan, schedule_iteration

METHODS = {"perseus": "megatron", "nanobatch_perseus": "nanobatch"}
"""The reference's methods, and the ``evaluate`` method that runs each plan's graphs."""

CONFIG = ("tp", "cp", "pp", "microbatch_size", "seq_len", "microbatches")

KNEES = (0.70, 0.75, 0.78, 0.80, 0.82, 0.85)
MEM_POWERS = (40.0,)
"""The grid of the A100 factors the partition data cannot identify (``--fit-voltage-curve``):
the voltage curve's knee as a fraction of the maximum clock, and the power of memory traffic
in W per TB/s (the shipped prior only: more fits the plans' energy levels better without
end, to 80 and beyond, and widens the TP 8 savings gap; docs/fidelity.md). The floor is not a
grid axis: the partition measured at 1200 MHz fixes the voltage there, so the calibration
refitted for each knee gives it."""


CONTENDED_EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The grid of the A100's contended clock exponent (``--fit-contended-clock``): how a
collective's rate beside compute scales with the SM clock. The partition data (a custom
TP 2 kernel) barely tell it apart; the nanobatching plans' clock response does."""

RELIABLE_RMS = 0.01
"""A plan set's clock response counts where it explains the set's times this well (rms of
the log errors): elsewhere one response per set does not describe the plans."""

FLAGGED = ((4, 2, 2, 8, 8192, 8), "perseus")
"""The plan set the data's README flags: its frontier spans 2.2x in time, more than the
clock range allows, so the profile behind it may be off at low clocks."""


def reference() -> dict[tuple, dict[str, dict[str, tuple[ClockPlan, float, float]]]]:
    """Per configuration, method and plan id: the plan's clocks and its (time, energy)."""
    path = shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv"
    rows: dict[tuple, dict[str, dict[str, list[dict[str, str]]]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list))
    )
    with path.open() as fh:
        for row in csv.DictReader(fh):
            key = tuple(int(row[k]) for k in CONFIG)
            rows[key][row["method"]][row["plan_id"]].append(row)
    out: dict[tuple, dict[str, dict[str, tuple[ClockPlan, float, float]]]] = {}
    for key, by_method in rows.items():
        out[key] = {}
        for method, plans in by_method.items():
            out[key][method] = {}
            for plan_id, plan_rows in plans.items():
                stages = sorted({int(r["stage"]) for r in plan_rows})
                freqs = tuple(
                    tuple(
                        float(r["freq_mhz"])
                        for r in sorted(plan_rows, key=lambda r: int(r["position"]))
                        if int(r["stage"]) == s
                    )
                    for s in stages
                )
                first = plan_rows[0]
                out[key][method][plan_id] = (
                    ClockPlan(plan_id, freqs),
                    float(first["plan_time_s"]),
                    float(first["plan_energy_j"]),
                )
    return out


def _errors(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Median and largest |ours / reference - 1|, in %."""
    errs = [abs(ours / ref - 1) * 100 for ours, ref in pairs]
    return statistics.median(errs), max(errs)


def _rho(pairs: list[tuple[float, float]]) -> float:
    return float(spearmanr([p[0] for p in pairs], [p[1] for p in pairs]).statistic)


def _workload(key: tuple, recompute: str) -> Workload:
    tp, cp, pp, mbs, seq, micro = key
    return Workload(
        model="llama3.2-3b",
        tp=tp,
        cp=cp,
        pp=pp,
        microbatch_size=mbs,
        seq_len=seq,
        microbatches=micro,
        recompute=recompute,
        layers_per_stage=(15, 13),
    )


Profiles = dict[tuple[int, str], dict[float, float]]
"""Per (stage, kind), its time in kareus at each clock a plan set uses."""


def priced(
    key: tuple,
    plans: dict[str, tuple[ClockPlan, float, float]],
    method: str,
    recompute: str,
    evaluator: Any = None,
    profiles: dict[tuple[tuple, str], Profiles] | None = None,
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Price one plan set with ``kareus evaluate``: (ours, reference) time and energy pairs.

    Energy is per GPU column (one GPU per stage), the reference's unit. ``profiles``, if
    given, receives kareus's instruction times under ``(key, method)``.
    """
    result = evaluate_clock_plans(
        _workload(key, recompute),
        "a100-40gb",
        [p for p, _, _ in plans.values()],
        method=method,
        evaluator=evaluator,
    )
    if profiles is not None:
        profiles[(key, method)] = result.instruction_times_s
    times = [(c.time_s, plans[c.plan_id][1]) for c in result.plans]
    energies = [(c.energy_per_gpu_column_j, plans[c.plan_id][2]) for c in result.plans]
    return times, energies


@dataclasses.dataclass(frozen=True)
class ClockResponse:
    """One plan set's instructions as its iteration times show them (:func:`clock_response`).

    Attributes:
        stage0_s: stage 0's forward and backward of one micro-batch at the maximum clock.
        fixed: the share of an instruction's time at the maximum clock that does not grow as
            the clock falls (the rest grows as 1 / clock).
        later_stages: the later stages' time against stage 0's, relative to kareus's.
        rms: root mean square of the fit's log errors over the plan set.
    """

    stage0_s: float
    fixed: float
    later_stages: float
    rms: float


def clock_response(
    key: tuple, recompute: str, plans: list[ClockPlan], times: list[float], shape: Profiles
) -> ClockResponse:
    """Fit one clock response to a plan set's iteration times (1F1B makespans).

    Every instruction of stage ``s`` and kind ``k`` at clock ``f`` is taken to last
    ``T · w(s, k) · L(s) · (a + (1 - a) · f_max / f)``: ``w`` is its time at the top clock
    relative to stage 0's forward + backward in kareus's profiles ``shape`` (a plan set
    cannot tell a stage's forward from its backward: only their sum is on the critical
    path), ``L`` is 1 for stage 0 and a fitted ``l`` for the others; ``T``, ``a`` and ``l``
    are fitted by least squares on the log makespans. Fitted the same way to the
    reference's times and to kareus's prices of the same plans, the two ``a`` compare how
    each side's instructions respond to the clock, the two ``T`` their time at the top.
    """
    from scipy.optimize import minimize

    work = _workload(key, recompute)
    iteration = schedule_iteration(work.schedule, work.pp, work.microbatches)
    position = {
        (i.stage, i.kind, i.microbatch): (rank, p)
        for rank, order in enumerate(stage_orders(work))
        for p, i in enumerate(order)
    }
    top = max(set.intersection(*(set(by_clock) for by_clock in shape.values())))
    unit = shape[(0, "forward")][top] + shape[(0, "backward")][top]
    weights = [shape[(i.stage, i.kind)][top] / unit for i in iteration.instructions]
    later = [i.stage > 0 for i in iteration.instructions]
    clocks = []
    for plan in plans:
        where = (position[i.stage, i.kind, i.microbatch] for i in iteration.instructions)
        clocks.append([plan.freqs_mhz[rank][p] for rank, p in where])
    f_max = gpu("a100-40gb").clock_max_mhz

    def log_ratios(x: Any) -> list[float]:
        """log(makespan / time) per plan at (a, l) with ``T`` = 1."""
        fixed, stages = x
        out = []
        for fs, t in zip(clocks, times, strict=True):
            durations = [
                w * (stages if s else 1.0) * (fixed + (1 - fixed) * f_max / f)
                for w, s, f in zip(weights, later, fs, strict=True)
            ]
            out.append(math.log(makespan(iteration, durations) / t))
        return out

    def residuals(x: Any) -> list[float]:
        """Log errors at (a, l), ``T`` at its optimum (every duration scales with it)."""
        logs = log_ratios(x)
        shift = statistics.fmean(logs)
        return [v - shift for v in logs]

    def loss(x: Any) -> float:
        return statistics.fmean(r * r for r in residuals(x))

    # The makespan is piecewise linear in the durations (the critical path changes), so a
    # local search stops in the valley it starts in: search from the best points of a
    # coarse grid and keep the best end.
    grid = itertools.product([i / 20 for i in range(-10, 21)], [j / 20 for j in range(10, 31)])
    starts = sorted(grid, key=loss)[:8]
    options = {"xatol": 1e-6, "fatol": 1e-16}
    bounds = [(-1.0, 1.0), (0.25, 4.0)]
    ends = [minimize(loss, x, method="Nelder-Mead", bounds=bounds, options=options) for x in starts]
    fit = min(ends, key=lambda e: e.fun)
    fixed, stages = (float(v) for v in fit.x)
    t0 = math.exp(-statistics.fmean(log_ratios(fit.x)))
    return ClockResponse(t0, fixed, stages, math.sqrt(loss(fit.x)))


def responses(
    recompute: str,
    sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]],
    profiles: dict[tuple[tuple, str], Profiles],
) -> Iterator[tuple[tuple, str, ClockResponse, ClockResponse]]:
    """Per plan set: its key, method and the clock responses of the reference and kareus."""
    ref = reference()
    for (key, ref_method), (t_pairs, _e) in sets.items():
        shape = profiles[(key, METHODS[ref_method])]
        plans = [p for p, _t, _e in ref[key][ref_method].values()]
        theirs = clock_response(key, recompute, plans, [r for _o, r in t_pairs], shape)
        ours = clock_response(key, recompute, plans, [o for o, _r in t_pairs], shape)
        yield key, ref_method, theirs, ours


def clock_response_rows(
    recompute: str,
    sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]],
    profiles: dict[tuple[tuple, str], Profiles],
) -> list[tuple[str, ...]]:
    """Per plan set: the clock response of the reference's instructions and of kareus's."""
    out: list[tuple[str, ...]] = []
    for key, ref_method, theirs, ours in responses(recompute, sets, profiles):
        tp, cp, _pp, mbs, seq, _micro = key
        out.append(
            (
                f"TP{tp} CP{cp} mbs{mbs} seq{seq}",
                ref_method,
                f"{theirs.stage0_s * 1e3:.1f} / {ours.stage0_s * 1e3:.1f}",
                f"{theirs.fixed:.2f} / {ours.fixed:.2f}",
                f"{theirs.later_stages:.2f} / {ours.later_stages:.2f}",
                f"{theirs.rms * 100:.1f} / {ours.rms * 100:.1f}",
            )
        )
    return out


def _growth(fastest: dict[tuple[tuple, str], tuple[float, float]]) -> list[str]:
    """How each method's fastest plan grows with the micro-batch, in kareus and the reference.

    For two configurations that differ only in micro-batch size, the reference's times are
    fitted as ``a * kareus's + c``: ``c`` is time the reference spends that does not grow with
    the micro-batch (per iteration), ``a`` how much more it spends per unit of modelled work.
    """
    out = []
    for (key, method), (k1, r1) in sorted(fastest.items()):
        tp, cp, pp, mbs, seq, micro = key
        bigger = fastest.get(((tp, cp, pp, 2 * mbs, seq, micro), method))
        if bigger is None:
            continue
        k2, r2 = bigger
        a = (r2 - r1) / (k2 - k1)
        c = r1 - a * k1
        out.append(
            f"{method} TP{tp} CP{cp} seq{seq}, micro-batch {mbs} -> {2 * mbs}, fastest plan: "
            f"reference (predicted from measured profiles) {r1:.3f} -> {r2:.3f} s "
            f"({r2 / r1:.2f}x), kareus (modelled) {k1:.3f} -> {k2:.3f} s ({k2 / k1:.2f}x); "
            f"reference = {a:.3f} x kareus + {c:.3f} s"
        )
    return out


Points = list[tuple[float, float]]
"""Plans as (time s, energy J) points."""


def _fastest(points: Points) -> tuple[float, float]:
    return min(points)


def iso_time_saving(base: Points, other: Points) -> float | None:
    """The least energy of ``other`` no slower than ``base``'s fastest plan, as a saving.

    1 - E / E(base's fastest plan); None when no plan of ``other`` is that fast.
    """
    t0, e0 = _fastest(base)
    energies = [e for t, e in other if t <= t0 * (1 + 1e-9)]
    return 1 - min(energies) / e0 if energies else None


def iso_energy_saving(base: Points, other: Points) -> float | None:
    """The shortest time of ``other`` at no more energy than ``base``'s fastest plan.

    1 - T / T(base's fastest plan); None when every plan of ``other`` uses more.
    """
    t0, e0 = _fastest(base)
    times = [t for t, e in other if e <= e0 * (1 + 1e-9)]
    return 1 - min(times) / t0 if times else None


def fastest_energy_ratio(base: Points, other: Points) -> float:
    """Energy of ``other``'s fastest plan against ``base``'s, minus 1."""
    return _fastest(other)[1] / _fastest(base)[1] - 1


def frontier_slope(points: Points, stretch: float) -> float | None:
    """Energy change along the frontier from the fastest plan to ``stretch`` more time.

    The (time, energy) frontier of ``points`` interpolated linearly: E(T0 (1 + stretch)) /
    E(T0) - 1; None when the slowest plan is faster than that.
    """
    frontier: Points = []
    for t, e in sorted(points):
        if not frontier or e < frontier[-1][1]:
            frontier.append((t, e))
    t0, e0 = frontier[0]
    target = t0 * (1 + stretch)
    for (ta, ea), (tb, eb) in itertools.pairwise(frontier):
        if ta <= target <= tb:
            return (ea + (eb - ea) * (target - ta) / (tb - ta)) / e0 - 1
    return None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:+.1f}"


def savings_rows(
    points: dict[tuple, dict[str, dict[str, Points]]],
) -> list[tuple[str, ...]]:
    """Per configuration: what nanobatching + Perseus saves over Perseus, both ways.

    ``points[config][method][side]``, side ``reference`` or ``kareus`` (the same plans).
    Each cell is reference / kareus (gap in points where both are defined).
    """
    out = []
    for key, by_method in points.items():
        if set(by_method) != set(METHODS):
            continue
        tp, cp, _pp, mbs, seq, _micro = key
        cells = []
        for fn in (iso_time_saving, iso_energy_saving, fastest_energy_ratio):
            ref = fn(by_method["perseus"]["reference"], by_method["nanobatch_perseus"]["reference"])
            ours = fn(by_method["perseus"]["kareus"], by_method["nanobatch_perseus"]["kareus"])
            gap = "" if ref is None or ours is None else f" ({(ours - ref) * 100:+.1f})"
            cells.append(f"{_pct(ref)} / {_pct(ours)}{gap}")
        for stretch in (0.05, 0.10):
            ref = frontier_slope(by_method["perseus"]["reference"], stretch)
            ours = frontier_slope(by_method["perseus"]["kareus"], stretch)
            cells.append(f"{_pct(ref)} / {_pct(ours)}")
        out.append((f"TP{tp} CP{cp} mbs{mbs} seq{seq}", *cells))
    return out


Pairs = list[tuple[float, float]]
"""(kareus's, the reference's) figures of each plan of a set."""


def recalibrated(spec: GPUSpec, changes: dict[str, float], label: str) -> tuple[GPUSpec, Harness]:
    """``spec`` with the calibration's ``changes`` made and its free factors refitted.

    ``changes`` names factors of :class:`~kareus.hardware.specs.Calibration` (an activity as
    ``activity.<class>``); the rest are refitted to the partition data with them, as
    ``python -m kareus.hardware.calibrate`` fits the shipped ones. Returns the spec and the
    measuring harness fitted with it (for the partition's own figures).
    """
    activity = dict(spec.calibration.activity)
    plain: dict[str, Any] = {}
    for name, value in changes.items():
        if name.startswith("activity."):
            activity[name.removeprefix("activity.")] = value
        else:
            plain[name] = value
    cal = dataclasses.replace(spec.calibration, activity=activity, **plain)
    fitted = fit(spec.with_calibration(cal, ""), calibration_rows())
    return spec.with_calibration(fitted.calibration, label), fitted.harness


def voltage_curve_spec(knee: float, mem_power: float) -> GPUSpec:
    """The A100 with voltage knee ``knee`` and memory power ``mem_power``, recalibrated.

    The calibration is refitted to the partition data for that curve (the 1200 MHz rows fix
    the voltage there, so the floor follows the knee).
    """
    base = dataclasses.replace(GPUS["a100-sxm4-40gb"], vf_knee=knee)
    label = f"knee {knee}, memory {mem_power} W/(TB/s)"
    return recalibrated(base, {"mem_power_w_per_tbs": mem_power}, label)[0]


def price_all(
    recompute: str, spec: GPUSpec, profiles: dict[tuple[tuple, str], Profiles] | None = None
) -> dict[tuple[tuple, str], tuple[Pairs, Pairs]]:
    """Every reference plan set priced on ``spec``'s model: (configuration, method) -> the
    (ours, reference) time pairs and energy pairs; ``profiles`` as :func:`priced`'s."""
    from kareus.hardware import Emulator

    emulator = Emulator(spec)
    return {
        (key, ref_method): priced(key, plans, method, recompute, emulator, profiles)
        for key, by_method in reference().items()
        for ref_method, method in METHODS.items()
        if (plans := by_method.get(ref_method))
    }


def _grid_point(
    recompute: str, knee: float, mem_power: float
) -> tuple[tuple[float, float, float], dict[tuple[tuple, str], tuple[Pairs, Pairs]]]:
    spec = voltage_curve_spec(knee, mem_power)
    sets = price_all(recompute, spec)
    print(f"  priced knee {knee:.2f}, memory {mem_power:.0f} W/(TB/s)", file=sys.stderr, flush=True)
    return (knee, mem_power, spec.v_floor), sets


def _grid(
    recompute: str, knees: tuple[float, ...], mem_powers: tuple[float, ...], jobs: int
) -> dict[tuple[float, float, float], dict[tuple[tuple, str], tuple[Pairs, Pairs]]]:
    """Price every reference plan at each point of the grid, ``jobs`` points at a time.

    Returns, per (knee, memory power, fitted floor), per (configuration, method): the
    (ours, reference) time pairs and energy pairs.
    """
    from concurrent.futures import ProcessPoolExecutor

    points = list(itertools.product(knees, mem_powers))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = pool.map(_grid_point, [recompute] * len(points), *zip(*points, strict=True))
        return dict(done)


def _points(sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]]) -> dict:
    points: dict[tuple, dict[str, dict[str, Points]]] = collections.defaultdict(dict)
    for (key, method), (times, energies) in sets.items():
        points[key][method] = {
            "reference": [(t[1], e[1]) for t, e in zip(times, energies, strict=True)],
            "kareus": [(t[0], e[0]) for t, e in zip(times, energies, strict=True)],
        }
    return points


SLOPE_TOLERANCE = 0.20
"""A frontier slope counts as reproduced within this share of the reference's (issue 39)."""


def slopes_reproduced(sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]], keep: set[tuple]) -> int:
    """Count the Perseus frontier slopes (+5 % and +10 % time) within tolerance, per config."""
    count = 0
    for key, by_method in _points(sets).items():
        perseus = by_method.get("perseus")
        if key not in keep or perseus is None:
            continue
        for stretch in (0.05, 0.10):
            ref = frontier_slope(perseus["reference"], stretch)
            ours = frontier_slope(perseus["kareus"], stretch)
            if ref and ours is not None and abs(ours / ref - 1) <= SLOPE_TOLERANCE:
                count += 1
    return count


def _rank(sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]], keep: set[tuple]) -> tuple:
    """The choice: most frontier slopes reproduced, then the least plan energy error.

    Differences first (what a clock choice saves along the frontier), levels second.
    """
    errs = [abs(o / r - 1) for (k, _m), (_t, e) in sets.items() if k in keep for o, r in e]
    return (-slopes_reproduced(sets, keep), statistics.median(errs))


def voltage_curve(
    recompute: str,
    knees: tuple[float, ...],
    mem_powers: tuple[float, ...],
    cross_validate: bool,
    jobs: int = 1,
) -> None:
    """Print, per A100 voltage knee and memory power, how well the plans' energies match.

    The grid behind the curve in ``kareus.hardware.specs``: per curve the Perseus frontier
    slopes reproduced (:func:`slopes_reproduced`), the plans' energy errors, the worst
    Spearman correlation and the savings, the flagged plan set aside; :func:`_rank` chooses.
    With
    ``cross_validate``, each configuration is also scored with the curve chosen without it.
    """
    grid = _grid(recompute, knees, mem_powers, jobs)
    configs = sorted({key for sets in grid.values() for key, _m in sets})
    usable = {g: {s: v for s, v in sets.items() if s != FLAGGED} for g, sets in grid.items()}
    print(
        f"A100 voltage curve against the energies of every reference plan ({recompute} "
        "recompute; the flagged plan set aside; modelled vs the reference's predictions; "
        "in-sample: the curve is chosen on these plans, the floor on the partition data)"
    )
    for (knee, mem, floor), sets in usable.items():
        errs = [abs(o / r - 1) * 100 for _t, e in sets.values() for o, r in e]
        rhos = [_rho(e) for _t, e in sets.values()]
        print(
            f"  knee {knee:.2f} ({knee * 1410:.0f} MHz), memory {mem:.0f} W/(TB/s), fitted floor "
            f"{floor:.3f}: slopes within 20 % {slopes_reproduced(sets, set(configs))}; "
            "energy |error| median "
            f"{statistics.median(errs):.1f} %, max {max(errs):.1f} %; Spearman min "
            f"{min(rhos):.2f}",
            flush=True,
        )
        for row in savings_rows(_points(sets)):
            print("    " + " | ".join(row))
    chosen = min(usable, key=lambda g: (_rank(usable[g], set(configs)), g))
    knee, mem, floor = chosen
    print(f"chosen: knee {knee:.2f}, memory {mem:.0f} W/(TB/s), floor {floor:.3f}")
    if not cross_validate:
        return
    held: dict[tuple[tuple, str], tuple[Pairs, Pairs]] = {}
    for key in configs:
        g = min(usable, key=lambda g: (_rank(usable[g], set(configs) - {key}), g))
        held |= {s: v for s, v in usable[g].items() if s[0] == key}
        tp, cp, _pp, mbs, seq, _micro = key
        print(
            f"  without TP{tp} CP{cp} mbs{mbs} seq{seq}: knee {g[0]:.2f}, "
            f"memory {g[1]:.0f} W/(TB/s)"
        )
    for label, sets in (("in-sample", usable[chosen]), ("held out (cross-validated)", held)):
        (em, ex) = _errors([pair for _t, e in sets.values() for pair in e])
        rhos = [_rho(e) for _t, e in sets.values()]
        print(
            f"energy per plan, {label}, without the flagged set: |error| median {em:.1f} %, "
            f"max {ex:.1f} %; Spearman min {min(rhos):.2f}, median {statistics.median(rhos):.2f}"
        )
        for row in savings_rows(_points(sets)):
            print(f"  savings, {label}: " + " | ".join(row))


def _contended_point(
    recompute: str, exponent: float
) -> tuple[float, dict[tuple[tuple, str], tuple[Pairs, Pairs]], dict[tuple[tuple, str], Profiles]]:
    label = f"contended clock exponent {exponent}"
    spec, _harness = recalibrated(
        GPUS["a100-sxm4-40gb"], {"contended_clock_exponent": exponent}, label
    )
    profiles: dict[tuple[tuple, str], Profiles] = {}
    sets = price_all(recompute, spec, profiles)
    print(f"  priced {label}", file=sys.stderr, flush=True)
    return exponent, sets, profiles


def fixed_share_gaps(
    recompute: str,
    sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]],
    profiles: dict[tuple[tuple, str], Profiles],
) -> dict[tuple, float]:
    """Per configuration: kareus's minus the reference's share of a nanobatched instruction's
    time that does not scale with the clock, where the reference's set fits one response
    (:data:`RELIABLE_RMS`)."""
    nanobatching = {s: v for s, v in sets.items() if s[1] == "nanobatch_perseus"}
    return {
        key: ours.fixed - theirs.fixed
        for key, _m, theirs, ours in responses(recompute, nanobatching, profiles)
        if theirs.rms <= RELIABLE_RMS
    }


def contended_clock(recompute: str, exponents: tuple[float, ...], jobs: int) -> None:
    """Print, per contended clock exponent, the nanobatching sets' clock response gaps and
    the savings; choose the exponent whose gaps are least (mean absolute), and say which
    each configuration left out would choose.

    The exponent only changes overlapped partitions, which only the nanobatching plans
    run; the partition data are refitted for each exponent.
    """
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(_contended_point, [recompute] * len(exponents), exponents))
    print(
        "A100 contended clock exponent against the reference's nanobatching plans (modelled "
        "vs predicted from measured profiles; in-sample: the exponent is chosen on these "
        "plans): kareus's minus the reference's share of a nanobatched instruction's time "
        "that does not scale with the clock, per configuration whose set one response fits"
    )
    gaps = {}
    for exponent, sets, profiles in done:
        gaps[exponent] = fixed_share_gaps(recompute, sets, profiles)
        listed = ", ".join(
            f"TP{k[0]} CP{k[1]} mbs{k[3]} seq{k[4]} {g:+.2f}"
            for k, g in sorted(gaps[exponent].items())
        )
        mean = statistics.fmean(abs(g) for g in gaps[exponent].values())
        print(f"  exponent {exponent:.2f}: {listed}; mean |gap| {mean:.3f}", flush=True)
        for row in savings_rows(_points(sets)):
            print("    savings " + " | ".join(row))

    def choose(configs: set[tuple]) -> float:
        return min(
            exponents,
            key=lambda x: (statistics.fmean(abs(gaps[x][k]) for k in configs), x),
        )

    configs = set.intersection(*(set(g) for g in gaps.values()))
    print(f"chosen: exponent {choose(configs):.2f}")
    for key in sorted(configs):
        tp, cp, _pp, mbs, seq, _micro = key
        held = choose(configs - {key})
        print(
            f"  without TP{tp} CP{cp} mbs{mbs} seq{seq}: exponent {held:.2f}, its gap there "
            f"{gaps[held][key]:+.2f} (held out)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recompute", default="full", choices=("none", "full", "selective"))
    parser.add_argument("--configs", type=int, help="only the first N configurations")
    parser.add_argument(
        "--fit-voltage-curve",
        action="store_true",
        help="instead: the A100 voltage-curve grid its calibration was chosen on (~1 min)",
    )
    parser.add_argument(
        "--fit-contended-clock",
        action="store_true",
        help="instead: the grid the A100's contended clock exponent was chosen on (~7 min)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="grid points priced at a time")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FACTOR=VALUE",
        help="price with a prior of the calibration changed and the fitted factors refitted "
        "to the partition data (e.g. mem_clock_knee=1.0, activity.gemm=1.15); repeatable",
    )
    parser.add_argument(
        "--cross-validate",
        action="store_true",
        help="instead: the voltage curve chosen without each configuration, scored on it",
    )
    args = parser.parse_args()
    if args.fit_contended_clock:
        contended_clock(args.recompute, CONTENDED_EXPONENTS, args.jobs)
        return
    if args.fit_voltage_curve or args.cross_validate:
        voltage_curve(args.recompute, KNEES, MEM_POWERS, args.cross_validate, args.jobs)
        return
    evaluator = None
    spec, harness = gpu("a100-sxm4-40gb"), shipped_harness()
    if args.set:
        from kareus.hardware import Emulator

        known = {f.name for f in dataclasses.fields(spec.calibration)} - {"activity", "source"}
        known |= {f"activity.{c}" for c in spec.calibration.activity}
        known -= {name for name, _lo, _hi in FREE}  # (refitted whatever they are set to)
        changes = {}
        for item in args.set:
            name, sep, value = item.partition("=")
            if not sep or name not in known:
                parser.error(
                    f"--set {item!r}: expected FACTOR=VALUE, FACTOR one of {sorted(known)}"
                )
            try:
                changes[name] = float(value)
            except ValueError:
                parser.error(f"--set {item!r}: {value!r} is not a number")
        label = ", ".join(args.set)
        spec, harness = recalibrated(spec, changes, label)
        evaluator = Emulator(spec)
        print(f"calibration changed: {label}; the free factors refitted (modelled)")
    all_t: list[tuple[float, float]] = []
    all_e: list[tuple[float, float]] = []
    rest_t: list[tuple[float, float]] = []
    rest_e: list[tuple[float, float]] = []
    rest_rhos: list[float] = []
    table = []
    rhos = []
    fastest: dict[tuple[tuple, str], tuple[float, float]] = {}
    priced_sets: dict[tuple[tuple, str], tuple[Pairs, Pairs]] = {}
    profiles: dict[tuple[tuple, str], Profiles] = {}
    for key, by_method in list(reference().items())[: args.configs]:
        tp, cp, _pp, mbs, seq, _micro = key
        start = time.perf_counter()
        config_e: list[tuple[float, float]] = []
        for ref_method, method in METHODS.items():
            plans = by_method.get(ref_method, {})
            if not plans:
                continue
            t_pairs, e_pairs = priced(key, plans, method, args.recompute, evaluator, profiles)
            priced_sets[(key, ref_method)] = (t_pairs, e_pairs)
            fastest[(key, ref_method)] = min(t_pairs, key=lambda p: p[1])
            all_t += t_pairs
            all_e += e_pairs
            config_e += e_pairs
            (tm, tx), (em, ex) = _errors(t_pairs), _errors(e_pairs)
            rho = _rho(e_pairs)
            rhos.append(rho)
            if (key, ref_method) != FLAGGED:
                rest_t += t_pairs
                rest_e += e_pairs
                rest_rhos.append(rho)
            ratio_t = statistics.median(o / r for o, r in t_pairs)
            ratio_e = statistics.median(o / r for o, r in e_pairs)
            table.append(
                (
                    f"TP{tp} CP{cp} mbs{mbs} seq{seq}",
                    ref_method,
                    str(len(t_pairs)),
                    f"{tm:.1f} / {tx:.1f}",
                    f"{ratio_t:.3f}",
                    f"{em:.1f} / {ex:.1f}",
                    f"{ratio_e:.3f}",
                    f"{rho:.2f}",
                )
            )
        table.append(
            (
                f"TP{tp} CP{cp} mbs{mbs} seq{seq}",
                "both",
                str(len(config_e)),
                "",
                "",
                "",
                "",
                f"{_rho(config_e):.2f}",
            )
        )
        wall = time.perf_counter() - start
        print(
            f"priced {_workload(key, args.recompute).describe()} in {wall:.0f} s (measured wall "
            "time)",
            file=sys.stderr,
        )
    plans_header = (
        "config",
        "method",
        "plans",
        "time |err| % median / max",
        "time ratio (median)",
        "energy |err| % median / max",
        "energy ratio (median)",
        "Spearman (energy)",
    )
    print(
        f"\nreference A100 pipeline plans, recompute {args.recompute}: kareus modelled, "
        "reference predicted from measured profiles; energies in-sample (the voltage curve "
        "was chosen on these plans); times held out but for how the nanobatching sets' times "
        "respond to the clock, on which the contended clock exponent was chosen"
    )
    _table(plans_header, table)
    (tm, tx), (em, ex) = _errors(all_t), _errors(all_e)
    print(
        f"\nall {len(all_t)} plans: time |error| median {tm:.1f} %, max {tx:.1f} %; energy "
        f"|error| median {em:.1f} %, max {ex:.1f} %; Spearman by energy within each "
        f"(configuration, method): min {min(rhos):.2f}, median {statistics.median(rhos):.2f}"
    )
    (tm, tx), (em, ex) = _errors(rest_t), _errors(rest_e)
    print(
        f"without the plan set the data's README flags (Perseus TP4 CP2 mbs8 seq8192), "
        f"{len(rest_t)} plans: time |error| median {tm:.1f} %, max {tx:.1f} %; energy |error| "
        f"median {em:.1f} %, max {ex:.1f} %; Spearman min {min(rest_rhos):.2f}, median "
        f"{statistics.median(rest_rhos):.2f}"
    )
    for line in _growth(fastest):
        print(line)
    print(
        "\nwhat nanobatching + Perseus saves over Perseus, reference (predicted from measured "
        "profiles) / kareus's prices of the same plans (modelled; points of difference in "
        "brackets), %: iso-time = least energy no slower "
        "than Perseus's fastest plan; iso-energy = least time at no more energy than it; "
        "fastest-plan energy = the two fastest plans' energies; Perseus frontier = energy "
        "change for 5 % and 10 % more time than its fastest plan"
    )
    savings_header = (
        "config",
        "iso-time saving",
        "iso-energy saving",
        "fastest-plan energy",
        "Perseus frontier +5 % time",
        "+10 % time",
    )
    _table(savings_header, savings_rows(_points(priced_sets)))
    print(
        "\nhow each plan set's instructions respond to the clock, reference (predicted from "
        "measured profiles) / kareus's prices of the same plans (modelled): one response "
        "fitted to each side's iteration times (clock_response: stage 0's forward + backward "
        "of a micro-batch at 1410 MHz, and the share of an instruction's time that does not "
        "grow as the clock falls; a stage's forward and backward shares of its time from kareus, "
        "the later stages' weight against stage 0 fitted, 1 = kareus's)"
    )
    clock_header = (
        "config",
        "method",
        "stage 0 F+B at 1410 MHz, ms",
        "share not scaling with the clock",
        "later stages' weight",
        "fit rms %",
    )
    _table(clock_header, clock_response_rows(args.recompute, priced_sets, profiles))
    rows = calibration_rows()
    pred = predict(spec, rows, harness=harness)
    pt = [(p[0], r.time_s) for r, p in zip(rows, pred, strict=True)]
    pe = [(p[1], r.energy_j) for r, p in zip(rows, pred, strict=True)]
    (ptm, ptx), (pem, pex) = _errors(pt), _errors(pe)
    print(
        f"partition data ({DEFAULT_DATA.parent.name}, {len(rows)} measured configurations; "
        "in-sample, the calibration was fitted to them: hardware_fidelity.py --cross-validate "
        "5 prints held-out figures): "
        f"time |error| median {ptm:.1f} %, max {ptx:.1f} %; energy |error| median {pem:.1f} "
        f"%, max {pex:.1f} %; Spearman by energy {_rho(pe):.2f}"
    )
    print(
        "targets (issue 15): pipeline plans median <= 10 %, max <= 20 % for time and energy, "
        "Spearman >= 0.9; partition data median <= 10 %"
    )


if __name__ == "__main__":
    main()

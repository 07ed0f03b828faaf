"""Price given per-instruction clock schedules without planning (``kareus evaluate``).

A *clock plan* gives each instruction of one iteration (one forward or backward of one
micro-batch on one pipeline stage) an SM clock. This module reads clock plans — kareus's
CSV (``plan_id,stage,position,kind,microbatch,freq_mhz``; ``stage`` is the pipeline rank,
``position`` the index in its order under the workload's pipeline schedule; other columns
are ignored) or a Perseus / Zeus pipeline-frequency-optimizer frequency file (a Python
literal: per stage, the ``(instruction, MHz)`` pairs in order) — checks each row against
the schedule, and predicts the iteration time and energy of every plan from the workload's
traced partition sets on one evaluator (the GPU's hardware model unless another is given),
with each collective run as the method says: ``megatron`` (the original graphs: no
nanobatching or overlap) or ``nanobatch`` (two nanobatches, each collective launched at its
partition's start on the default communicator). The workload is traced once for all plans.
"""

from __future__ import annotations

import ast
import collections
import csv
import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.hardware import Emulator, GPUSpec, gpu
from kareus.ir.costs import Evaluator
from kareus.ir.partitions import PartitionSet
from kareus.jobs.trace import Workload
from kareus.planner.compose import Composer, Problem
from kareus.planner.dag import STEP, Instruction, Iteration, Option, schedule_iteration
from kareus.planner.dp_pricing import add_data_parallel, data_parallel_planning
from kareus.planner.instruction_options import default_profiles, instruction_options
from kareus.planner.knobs import CountingEvaluator
from kareus.planner.settings import Parallelism, PlannerSettings

PROFILES = {"megatron": "no-overlap", "nanobatch": "nanobatch"}
"""Each method ``evaluate`` prices, and the decision profile its instructions run with."""

NANOBATCHES = {"megatron": 1, "nanobatch": 2}
"""The nanobatches of the graphs each method runs (1: the original graphs)."""

COLUMNS = ("plan_id", "stage", "position", "kind", "freq_mhz")
"""Columns a clocks CSV must have (``microbatch`` is checked when present)."""


class ClockPlanError(KareusError, ValueError):
    """A clocks file that cannot be read or does not fit the workload; says where and why."""


@dataclasses.dataclass(frozen=True)
class ClockPlan:
    """One iteration's clocks: ``freqs_mhz[stage][position]`` in each stage's order."""

    plan_id: str
    freqs_mhz: tuple[tuple[float, ...], ...]


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """A clock plan's predicted iteration.

    Attributes:
        plan_id: the plan's id in its file.
        time_s: iteration time (the makespan of the pipeline's instructions).
        energy_j: energy of one iteration, every GPU of one pipeline.
        energy_per_gpu_column_j: the same for one GPU per stage (``energy_j / (TP x CP)``).
    """

    plan_id: str
    time_s: float
    energy_j: float
    energy_per_gpu_column_j: float


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Every clock plan's predicted iteration, and where the figures come from.

    Attributes:
        plans: one :class:`PlanCost` per plan, in the order given.
        source: ``modelled`` (the hardware model) or ``measured`` (a replay of measured
            partitions); ``mixed`` when a replay holds both.
        method: ``megatron`` or ``nanobatch``.
        gpu: the GPU the plans were priced on.
        instruction_times_s: per (stage, kind), its time at each clock the plans use: the
            instruction profiles the plans were priced from (a kind that carries data
            parallelism's traffic beside it is named with it: :attr:`Instruction.key`).
    """

    plans: tuple[PlanCost, ...]
    source: str
    method: str
    gpu: str
    instruction_times_s: dict[tuple[int, str], dict[float, float]] = dataclasses.field(
        default_factory=dict
    )

    def to_dict(self) -> dict[str, object]:
        """Return ``{"plans": [{"plan_id", "time_s", "energy_j", ...}], "source": ...}``."""
        return {
            "plans": [dataclasses.asdict(p) for p in self.plans],
            "source": self.source,
            "method": self.method,
            "gpu": self.gpu,
            "instructions": [
                {"stage": stage, "kind": kind, "times_s": sorted(times.items())}
                for (stage, kind), times in sorted(self.instruction_times_s.items())
            ],
        }


def _iteration(work: Workload) -> Iteration:
    return schedule_iteration(work.schedule, work.pp, work.microbatches, work.virtual_stages)


def stage_orders(work: Workload) -> list[list[Instruction]]:
    """Return each pipeline rank's instructions in the order it runs them.

    The instructions of an iteration are listed rank by rank in execution order; a rank's
    are those whose stage is ``rank`` modulo the pipeline size (one stage per rank unless
    the schedule is interleaved).
    """
    orders: list[list[Instruction]] = [[] for _ in range(work.pp)]
    for instr in _iteration(work).instructions:
        orders[instr.stage % work.pp].append(instr)
    return orders


def read_clock_plans(
    path: str | pathlib.Path, work: Workload, clock_range_mhz: tuple[float, float]
) -> list[ClockPlan]:
    """Read and check every clock plan of ``path`` for ``work``'s schedule.

    A ``.csv`` is kareus's format; any other file is read as a Perseus / Zeus frequency file
    (its plan id is the file's name without suffix).

    Raises:
        ClockPlanError: the file cannot be read, lacks a column, or a row names an unknown
            kind, a clock outside ``clock_range_mhz``, a position that is not in the
            stage's order or runs another instruction there; or a plan misses instructions.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ClockPlanError(f"cannot read the clocks file {path}: {err}") from None
    orders = stage_orders(work)
    if path.suffix.lower() == ".csv":
        rows = _csv_rows(path, text, work, orders, clock_range_mhz)
    else:
        rows = _frequency_file_rows(path, text, orders, clock_range_mhz)
    by_plan: dict[str, dict[tuple[int, int], float]] = collections.defaultdict(dict)
    for where, plan_id, stage, position, freq in rows:
        if (stage, position) in by_plan[plan_id]:
            raise ClockPlanError(
                f"{where}: plan {plan_id} gives stage {stage} position {position} a clock twice "
                "(a file with the plans of several configurations or methods, such as the "
                "reference plans.csv, must be filtered to one)"
            )
        by_plan[plan_id][(stage, position)] = freq
    if not by_plan:
        raise ClockPlanError(f"{path} holds no clock plan")
    plans = []
    for plan_id, freqs in by_plan.items():
        for stage, order in enumerate(orders):
            missing = [p for p in range(len(order)) if (stage, p) not in freqs]
            if missing:
                raise ClockPlanError(
                    f"{path}: plan {plan_id} has no clock for stage {stage} position(s) "
                    f"{_ranges(missing)} (each stage runs {len(order)} instructions under "
                    f"{work.schedule} with {work.microbatches} micro-batches)"
                )
        plans.append(
            ClockPlan(
                plan_id,
                tuple(
                    tuple(freqs[(s, p)] for p in range(len(order)))
                    for s, order in enumerate(orders)
                ),
            )
        )
    return plans


def _ranges(values: Sequence[int]) -> str:
    """Return ``0-3, 7`` for [0, 1, 2, 3, 7]."""
    out: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


Row = tuple[str, str, int, int, float]  # where, plan id, stage, position, MHz


def _check(
    where: str,
    orders: list[list[Instruction]],
    clock_range_mhz: tuple[float, float],
    stage: int,
    position: int,
    kind: str,
    freq: float,
    microbatch: int | None = None,
) -> None:
    """Raise :class:`ClockPlanError` unless the row fits the schedule and the GPU."""
    if kind not in ("forward", "backward"):
        raise ClockPlanError(f"{where}: unknown kind {kind!r} (forward or backward)")
    if not 0 <= stage < len(orders):
        raise ClockPlanError(
            f"{where}: stage {stage} does not exist (the pipeline has stages 0-{len(orders) - 1})"
        )
    order = orders[stage]
    if not 0 <= position < len(order):
        raise ClockPlanError(
            f"{where}: stage {stage} runs {len(order)} instructions (positions "
            f"0-{len(order) - 1}), not position {position}"
        )
    instr = order[position]
    if instr.kind != kind or (microbatch is not None and microbatch != instr.microbatch):
        said = f"{kind}" + (f" of micro-batch {microbatch}" if microbatch is not None else "")
        raise ClockPlanError(
            f"{where}: stage {stage} position {position} runs the {instr.kind} of micro-batch "
            f"{instr.microbatch} in the pipeline's order, the row says {said} (positions count "
            "each stage's instructions in the order its schedule runs them)"
        )
    low, high = clock_range_mhz
    if not low <= freq <= high:
        raise ClockPlanError(
            f"{where}: clock {freq:g} MHz is outside the GPU's range ({low:g}-{high:g} MHz)"
        )


def _csv_rows(
    path: pathlib.Path,
    text: str,
    work: Workload,
    orders: list[list[Instruction]],
    clock_range_mhz: tuple[float, float],
) -> list[Row]:
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ClockPlanError(
            f"{path}: missing column(s) {', '.join(missing)}; a clocks file has the columns "
            "plan_id,stage,position,kind,microbatch,freq_mhz (microbatch optional, others "
            "ignored)"
        )
    # Columns that name the configuration (as the reference plans.csv has) must match it.
    config = {
        "tp": work.tp,
        "cp": work.cp,
        "pp": work.pp,
        "microbatch_size": work.microbatch_size,
        "seq_len": work.seq_len,
        "microbatches": work.microbatches,
    }
    rows: list[Row] = []
    for record in reader:
        where = f"{path} line {reader.line_num}"
        other = [
            f"{k} {record[k]} (the workload's: {v})"
            for k, v in config.items()
            if (record.get(k) or "").strip().isdigit() and int(record[k]) != v
        ]
        if other:
            raise ClockPlanError(
                f"{where}: a plan for another configuration: {', '.join(other)}; filter the "
                "file to this workload's rows, or evaluate the workload it was made for"
            )
        try:
            stage, position = int(record["stage"]), int(record["position"])
            freq = float(record["freq_mhz"])
            mb_text = (record.get("microbatch") or "").strip()
            microbatch = int(mb_text) if mb_text else None
        except (TypeError, ValueError):
            raise ClockPlanError(
                f"{where}: stage, position and microbatch must be integers and freq_mhz a "
                f"number, got {dict(record)}"
            ) from None
        kind = (record["kind"] or "").strip()
        _check(where, orders, clock_range_mhz, stage, position, kind, freq, microbatch)
        rows.append((where, str(record["plan_id"]).strip(), stage, position, freq))
    return rows


def _frequency_file_rows(
    path: pathlib.Path,
    text: str,
    orders: list[list[Instruction]],
    clock_range_mhz: tuple[float, float],
) -> list[Row]:
    """Rows of a Perseus frequency file: ``[[("forward", 1410), ...], ...]``, one list per stage.

    That is the file lowtime writes and Zeus's ``PointSolution`` scheduler runs (only its
    forward and backward instructions carry clocks); JSON lists of pairs are read as well.
    """
    try:
        data = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        try:
            data = json.loads(text)
        except ValueError:
            raise ClockPlanError(
                f"{path} is neither a clocks CSV (name it *.csv) nor a Perseus frequency file "
                '(a Python list per stage of ("forward" | "backward", MHz) pairs)'
            ) from None
    if not isinstance(data, list | tuple) or not all(isinstance(s, list | tuple) for s in data):
        raise ClockPlanError(f"{path}: a frequency file is a list of per-stage lists")
    if len(data) != len(orders):
        raise ClockPlanError(
            f"{path}: the frequency file has {len(data)} stage(s), the pipeline {len(orders)}"
        )
    rows: list[Row] = []
    for stage, pairs in enumerate(data):
        for position, pair in enumerate(pairs):
            where = f"{path} stage {stage} entry {position}"
            if not (isinstance(pair, list | tuple) and len(pair) == 2):
                raise ClockPlanError(f"{where}: expected an (instruction, MHz) pair, got {pair!r}")
            kind, freq = pair
            if not isinstance(freq, int | float):
                raise ClockPlanError(f"{where}: the clock {freq!r} is not a number")
            _check(where, orders, clock_range_mhz, stage, position, str(kind), float(freq))
            rows.append((where, path.stem, stage, position, float(freq)))
    return rows


def _check_plans(
    plans: Sequence[ClockPlan], orders: Sequence[Sequence[Any]], clock_range: tuple[int, int]
) -> None:
    """Raise ClockPlanError for a plan (built in Python, say) that a file would not pass."""
    low, high = clock_range
    for plan in plans:
        if [len(f) for f in plan.freqs_mhz] != [len(o) for o in orders]:
            raise ClockPlanError(
                f"plan {plan.plan_id}: {[len(f) for f in plan.freqs_mhz]} clocks per stage, "
                f"the schedule runs {[len(o) for o in orders]}"
            )
        outside = [f for column in plan.freqs_mhz for f in column if not low <= f <= high]
        if outside:
            raise ClockPlanError(
                f"plan {plan.plan_id}: clock {outside[0]:g} MHz is outside the GPU's range "
                f"({low}-{high} MHz)"
            )


def _stages(
    work: Workload,
    method: str,
    partitions: str | pathlib.Path | None,
    *,
    layers: int,
    cache: bool,
    progress: Callable[[str], None] | None,
) -> list[PartitionSet]:
    """Return the partition sets ``method`` runs: read from ``partitions``, else traced."""
    from kareus.jobs.cache import traced_stages
    from kareus.jobs.stages_file import load_partitions

    if partitions is not None:
        split, originals = load_partitions(work, partitions)
        # (a file without the original graphs is priced as it is, whatever the method)
        return originals if NANOBATCHES[method] == 1 and originals is not None else split
    return traced_stages(
        work, layers=layers, cache=cache, progress=progress, nanobatches=NANOBATCHES[method]
    )[0]


def _priced(
    work: Workload,
    spec: GPUSpec,
    stages: list[PartitionSet],
    method: str,
    evaluator: Evaluator,
    freqs: Sequence[float],
) -> tuple[Iteration, dict[tuple[int, str], list[Option]]]:
    """Return the iteration and every instruction's option at each of ``freqs``.

    With the workload's data parallelism, the same traffic and step as `kareus plan --dp`.
    """
    settings = PlannerSettings()
    profile = PROFILES[method]
    profiles = {
        group: {profile: by_name[profile]}
        for group, by_name in default_profiles(stages, settings).items()
    }
    ev = CountingEvaluator(evaluator)
    static_w = spec.calibration.static_power_w
    options = instruction_options(stages, ev, freqs, static_w, settings, profiles)
    iteration = _iteration(work)
    layout = work.data_parallel()
    if layout is not None:
        share = settings.no_overlap_sm_share
        dpp = data_parallel_planning(spec, evaluator, layout, work.stage_weights(), share)
        iteration, _record = add_data_parallel(
            iteration, options, stages, dpp, freqs, spec.clock_max_mhz
        )
    return iteration, options


def evaluate_clock_plans(
    work: Workload,
    gpu_name: str,
    plans: Sequence[ClockPlan] | str | pathlib.Path,
    *,
    method: str = "megatron",
    evaluator: Evaluator | None = None,
    layers: int = 4,
    partitions: str | pathlib.Path | None = None,
    cache: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Evaluation:
    """Predict the iteration time and energy of each clock plan, in the order given.

    Args:
        work: the workload the plans are for (its schedule fixes each stage's order).
        gpu_name: a GPU of :data:`kareus.hardware.GPUS`; its hardware model prices the plans
            unless ``evaluator`` is given.
        plans: clock plans, or a clocks file (:func:`read_clock_plans`).
        method: ``megatron`` (no nanobatching or overlap) or ``nanobatch`` (two nanobatches,
            default overlap).
        evaluator: times and energies (say a replay of measured partitions).
        layers: layers traced per pipeline stage.
        partitions: an earlier run's ``partitions.json`` of this workload (no tracing).
            ``kareus plan`` writes both graphs there: ``megatron`` prices the original ones,
            ``nanobatch`` the split ones; a file with the split graphs only (older, or from
            ``kareus profile``) is priced as it is, whatever the method.
        cache: read and write the trace cache.
        progress: called with a short description before each long step.

    Raises:
        ClockPlanError: a bad clocks file. KareusError: an unknown method or GPU.
    """
    from kareus.jobs.workload import with_recompute

    if method not in PROFILES:
        raise KareusError(f"unknown method {method!r}: evaluate prices {sorted(PROFILES)}")
    spec = gpu(gpu_name)
    clocks = spec.clocks_mhz()
    if isinstance(plans, str | pathlib.Path):
        plans = read_clock_plans(plans, work, (min(clocks), max(clocks)))
    orders = stage_orders(work)
    _check_plans(plans, orders, (min(clocks), max(clocks)))
    stages = _stages(work, method, partitions, layers=layers, cache=cache, progress=progress)
    stages = with_recompute(stages, work.recompute)
    freqs = sorted({f for plan in plans for column in plan.freqs_mhz for f in column})
    inner = evaluator if evaluator is not None else Emulator(spec)
    iteration, options = _priced(work, spec, stages, method, inner, freqs)
    static_w = spec.calibration.static_power_w
    by_clock = {group: {o.freq_mhz: o for o in opts} for group, opts in options.items()}
    parallel = Parallelism(tp=work.tp, cp=work.cp, pp=work.pp)
    composer = Composer(
        Problem(iteration, options, static_w, parallel.gpus, parallel.gpus_per_stage)
    )
    position = {  # (data parallelism's traffic tags some of the iteration's instructions)
        (i.stage, i.kind, i.microbatch): (rank, p)
        for rank, order in enumerate(orders)
        for p, i in enumerate(order)
    }
    out = []
    for plan in plans:
        choices: list[Option] = []
        for instr in iteration.instructions:
            if instr.kind == STEP:  # at the clock the rank's last instruction leaves
                choices.append(by_clock[instr.key][plan.freqs_mhz[instr.stage][-1]])
                continue
            rank, p = position[instr.stage, instr.kind, instr.microbatch]
            choices.append(by_clock[instr.key][plan.freqs_mhz[rank][p]])
        time_s, energy_j = composer.evaluate(choices)
        per_column = energy_j / parallel.gpus_per_stage
        out.append(PlanCost(plan.plan_id, time_s, energy_j, per_column))
    times = {key: {f: o.time_s for f, o in opts.items()} for key, opts in by_clock.items()}
    source = str(getattr(inner, "source", "modelled"))
    return Evaluation(tuple(out), source, method, spec.name, times)

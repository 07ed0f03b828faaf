"""From a partition set to a plan: search each type, compose, compare, select.

Every method is computed by the same machinery on the same evaluator, so comparisons are
side by side: ``megatron`` (max clock, no overlap), ``perseus`` (clock per instruction, no
overlap), ``nanobatch+perseus`` (overlap at the partition start with the default
communicator, then clocks) and ``kareus`` (clocks and overlap jointly).

Given the original graphs' partition sets too (blocks left whole), Megatron-LM and Perseus
are priced on them, as those systems run, and kareus's frontier holds every Perseus plan
that no split plan beats: a plan never loses to the simpler plan of not splitting at all
(such a point has ``nanobatches == 1``; ``kareus.compile`` then leaves the graphs unsplit
and applies the plan's clocks only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kareus.errors import KareusError
from kareus.hardware import Emulator, GPUSpec
from kareus.ir.costs import Evaluator
from kareus.ir.partitions import Decision, PartitionSet
from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction
from kareus.planner.compose import Composer
from kareus.planner.dag import (
    SCHEDULES,
    STEP,
    Iteration,
    Option,
    SwitchCost,
    schedule_iteration,
    switches,
)
from kareus.planner.data_parallel import IN_GRAPH, STEP_ORIGINAL
from kareus.planner.dp_pricing import (
    DataParallelPlanning,
    add_data_parallel,
    blind_gain,
    data_parallel_planning,
)
from kareus.planner.frontiers import compose_frontiers
from kareus.planner.instruction_options import ORIGINAL, Evaluated, Pair, evaluate_options
from kareus.planner.knobs import CountingEvaluator
from kareus.planner.problem import Problem, Solution
from kareus.planner.search import SearchResult
from kareus.planner.select import Pick, select
from kareus.planner.settings import Parallelism, PlannerSettings


@dataclasses.dataclass
class PlanningResult:
    """Everything the planner computed (the plan plus per-type and per-method detail)."""

    plan: Plan
    searches: dict[str, SearchResult]
    frontiers: dict[str, list[Solution]]
    evaluations: int
    grid_size: int
    settings: PlannerSettings = PlannerSettings()


@dataclasses.dataclass(frozen=True, kw_only=True)
class IterationInputs:
    """What one training iteration is planned from: its graphs, the GPU and the layout.

    Attributes:
        stages: the partition set of each pipeline stage (one set: every stage's).
        gpu: GPU name, recorded in the plan.
        clocks_mhz: the GPU's supported clocks.
        static_power_w: static power of one GPU.
        parallel: tensor/pipeline parallel sizes and micro-batches per iteration.
        original: the same as ``stages`` for the original graphs (no block split). Given,
            the Megatron-LM and Perseus baselines are priced on them and their Perseus
            plans join kareus's frontier where no split plan beats them; None prices the
            baselines on the split graphs, each collective alone (one nanobatch's launches
            more per kernel).
        data_parallel: the data-parallel layout, stage parameters and pricing; None: no
            data-parallel traffic or optimizer step (as before data parallelism was
            modelled).
        skip_reasons: reasons recorded by the passes, kept in the plan.
        workload: what was planned (model, batch shape...), recorded in the plan.
    """

    stages: PartitionSet | Sequence[PartitionSet]
    gpu: str
    clocks_mhz: Sequence[int]
    static_power_w: float
    parallel: Parallelism = Parallelism()
    original: PartitionSet | Sequence[PartitionSet] | None = None
    data_parallel: DataParallelPlanning | None = None
    skip_reasons: Sequence[str] = ()
    workload: Mapping[str, Any] | None = None

    @functools.cached_property
    def graphs(self) -> tuple[list[PartitionSet], list[PartitionSet] | None]:
        """The split and the original graphs' sets, one per pipeline stage."""
        stages = self.parallel.stages
        originals = None if self.original is None else _per_stage(self.original, stages)
        return _per_stage(self.stages, stages), originals


def plan_iteration(
    inputs: IterationInputs,
    evaluator: Evaluator,
    *,
    settings: PlannerSettings = PlannerSettings(),
    pick: Pick = Pick(),
    progress: Callable[[str], None] | None = None,
) -> PlanningResult:
    """Plan one training iteration.

    Args:
        inputs: the graphs, the GPU and the layout planned.
        evaluator: times and energies (the emulator, a replay, a profiler).
        settings: planner knobs.
        pick: how to pick the plan (see :func:`kareus.planner.select.select`).
        progress: optional callable ``progress(step: str)`` for long steps (one call per
            type searched, one for the options, two for composing).

    Raises:
        InfeasiblePlanError: the policy's budget or deadline cannot be met.
        KareusError: an unknown pipeline schedule.
    """
    parallel, data_parallel = inputs.parallel, inputs.data_parallel
    _check_schedule(parallel)
    graphs = inputs.graphs
    ev = CountingEvaluator(evaluator)
    note = progress or (lambda _step: None)

    plan_on = functools.partial(_one_pass, inputs, ev, settings, pick.deadline_s, note)
    # (a data-parallel step is one instruction more per rank)
    instructions = parallel.instructions + (parallel.pp if data_parallel is not None else 0)
    run = _two_passes(plan_on, settings, inputs.clocks_mhz, instructions, note)
    freqs, evaluated, blind_options, iteration, dp_record, comps, frontiers, counts = run
    # (every evaluation made, in either pass; the solves are the kept pass's)
    counts = {**counts, "total": ev.evaluations, "clocks": len(freqs)}
    chosen = _choose(frontiers, pick)
    if data_parallel is not None and data_parallel.layout.mode not in IN_GRAPH:  # else planned
        dp_record["blind"] = _seeing_data_parallel(
            inputs, blind_options, comps["kareus"], freqs, settings, pick, note
        )
    meta = {
        "gpu": inputs.gpu, "source": getattr(evaluator, "source", "modelled"),
        "policy": pick.policy, "skip_reasons": tuple(inputs.skip_reasons),
        "static_power_w": inputs.static_power_w, "workload": dict(inputs.workload or {}),
        "data_parallel": dp_record,
        "clock_switch": dataclasses.asdict(settings.switch or SwitchCost()),
    }  # fmt: skip
    plan = _plan_file(chosen, frontiers, evaluated, iteration, graphs, parallel, counts, meta)
    return PlanningResult(
        plan, evaluated.searches, frontiers, ev.evaluations, evaluated.grid, settings
    )


def _one_pass(
    inputs: IterationInputs,
    ev: CountingEvaluator,
    settings: PlannerSettings,
    deadline_s: float | None,
    note: Callable[[str], None],
    freqs: tuple[float, ...],
) -> _Planned:
    """Evaluate, compose and solve the frontiers on one clock grid."""
    graphs = inputs.graphs
    stages, originals = graphs
    static_power_w, parallel = inputs.static_power_w, inputs.parallel
    evaluated = evaluate_options(stages, ev, freqs, static_power_w, settings, note, originals)
    blind = dict(evaluated.options)  # the data-parallel traffic replaces its lists
    iteration, dp_record = _iteration_for(
        parallel, evaluated.options, graphs, inputs.data_parallel, freqs, note
    )
    comps = _composers(
        iteration, evaluated.options, max(freqs), static_power_w, parallel, settings, originals
    )
    frontiers = compose_frontiers(comps, settings, deadline_s, note, with_originals=bool(originals))
    counts = {"search": evaluated.searched, "total": ev.evaluations, "grid": evaluated.grid}
    counts |= _solve_counts(comps.values(), settings.solver_gap_limit)
    return _Planned(freqs, evaluated, blind, iteration, dp_record, comps, frontiers, counts)


def _two_passes(
    plan_on: Callable[[tuple[float, ...]], _Planned],
    settings: PlannerSettings,
    clocks_mhz: Sequence[int],
    instructions: int,
    note: Callable[[str], None],
) -> _Planned:
    """Plan on the default clocks; past the dive, plan every clock where solves stay unproven.

    The pass with fewer unproven solves is kept (the first on a tie: same inputs, same plan).
    """
    run = plan_on(settings.planned_clocks(clocks_mhz))
    finer = settings.finer_clocks(clocks_mhz, instructions)
    unproven = run.counts["solves_not_proven_optimal"]
    if finer is not None and unproven and finer != run.freqs:
        note(f"{unproven} solves not proven within the gap limit: planning every clock")
        again = plan_on(finer)
        if again.counts["solves_not_proven_optimal"] < unproven:
            run = again
    return run


class _Planned(NamedTuple):
    """One planning pass on one clock grid (:func:`plan_iteration`)."""

    freqs: tuple[float, ...]
    evaluated: Evaluated
    blind_options: dict[tuple[int, str], list[Option]]
    iteration: Iteration
    dp_record: dict[str, Any]
    comps: dict[str, Composer]
    frontiers: dict[str, list[Solution]]
    counts: dict[str, int]


def _seeing_data_parallel(
    inputs: IterationInputs,
    blind_options: dict[tuple[int, str], list[Option]],
    aware: Composer,
    freqs: Sequence[float],
    settings: PlannerSettings,
    pick: Pick,
    note: Callable[[str], Any],
) -> dict[str, Any]:
    """Return what planning with the data-parallel traffic in view gained (:func:`blind_gain`).

    ``blind_options``: the options before the traffic was added.
    """
    note("planning blind to the data-parallel traffic, to price what seeing it gained")
    parallel, graphs = inputs.parallel, inputs.graphs
    iteration = _iteration_for(parallel, blind_options, graphs, None, freqs, lambda _s: None)[0]
    blind = _composers(
        iteration, blind_options, max(freqs), inputs.static_power_w, parallel, settings, graphs[1]
    )
    return blind_gain(
        blind["kareus"],
        aware,
        pick.policy,
        baseline_time_s=blind["megatron"].fastest_choice().time_s,
        sweep_points=settings.sweep_points,
        energy_budget_j=pick.energy_budget_j,
        deadline_s=pick.deadline_s,
    )


def _iteration_for(
    parallel: Parallelism,
    options: dict[tuple[int, str], list[Option]],
    graphs: tuple[Sequence[PartitionSet], Sequence[PartitionSet] | None],
    data_parallel: DataParallelPlanning | None,
    freqs: Sequence[float],
    note: Callable[[str], Any],
) -> tuple[Iteration, dict[str, Any]]:
    """Return the schedule's iteration, with data parallelism's traffic and steps if given.

    ``graphs``: the split and the original graphs' sets (the options of profile
    :data:`ORIGINAL` run the latter).
    """
    iteration = schedule_iteration(
        parallel.schedule, parallel.pp, parallel.microbatches, parallel.virtual_stages
    )
    if data_parallel is None:
        return iteration, {}
    note("pricing the data-parallel communication")
    stages, originals = graphs
    return add_data_parallel(
        iteration, options, stages, data_parallel, freqs, originals=(originals, ORIGINAL)
    )


def _choose(frontiers: dict[str, list[Solution]], pick: Pick) -> Solution:
    """Return kareus's plan that ``pick`` picks (Megatron-LM's time is its baseline)."""
    chosen = select(
        frontiers["kareus"],  # type: ignore[arg-type]
        pick.policy,
        baseline_time_s=frontiers["megatron"][0].time_s,
        energy_budget_j=pick.energy_budget_j,
        deadline_s=pick.deadline_s,
    )
    assert isinstance(chosen, Solution)
    return chosen


def _plan_file(
    chosen: Solution,
    frontiers: dict[str, list[Solution]],
    evaluated: Evaluated,
    iteration: Iteration,
    graphs: tuple[Sequence[PartitionSet], Sequence[PartitionSet] | None],
    parallel: Parallelism,
    counts: dict[str, int],
    meta: dict[str, Any],
) -> Plan:
    """Return the plan file's record of the chosen plan and of what planning found.

    ``graphs``: the split and the original graphs' sets; ``counts``: evaluations and solves;
    ``meta``: the fields that say where the plan comes from (GPU, source, policy, notes,
    static power, workload).
    """
    stages, originals = graphs
    # the split graphs are the original ones where nothing could be split (micro-batches
    # too small): every plan then runs the original graphs
    whole = originals is not None and all(a is b for a, b in zip(stages, originals, strict=True))
    unsplit = whole or _nanobatches(chosen) == 1
    point = functools.partial(_point, iteration=iteration, whole=whole)
    return Plan(
        # The fingerprint is that of the graphs the chosen plan runs.
        fingerprint={
            f"{i}/{kind}": pset.fingerprint(kind)
            for i, pset in enumerate(originals if unsplit and originals else stages)
            for kind in ("forward", "backward")
        },
        pipeline_schedule=parallel.schedule,
        parallel=_parallel_record(parallel),
        frontier=tuple(point(s) for s in frontiers["kareus"]),
        chosen=point(chosen),
        schedule=_clock_schedule(iteration, chosen),
        decisions=_decisions(iteration, chosen, evaluated.profiles, unsplit),
        baselines={
            m: tuple(point(s) for s in sols) for m, sols in frontiers.items() if m != "kareus"
        },
        evaluations=counts,
        **meta,
    )


def _check_schedule(parallel: Parallelism) -> None:
    """Raise :class:`KareusError` for a schedule kareus cannot plan as given."""
    if parallel.schedule not in SCHEDULES:
        raise KareusError(
            f"unknown pipeline schedule {parallel.schedule!r}: kareus plans {sorted(SCHEDULES)}"
        )
    if (parallel.schedule == "Interleaved1F1B") != (parallel.virtual_stages > 1):
        raise KareusError(
            f"schedule {parallel.schedule} with {parallel.virtual_stages} stage(s) per rank: "
            "Interleaved1F1B needs 2 or more stages per rank, the other schedules one"
        )


def _composers(
    iteration: Iteration,
    options: dict[tuple[int, str], list[Option]],
    fmax: float,
    static_power_w: float,
    parallel: Parallelism,
    settings: PlannerSettings,
    originals: Sequence[PartitionSet] | None,
) -> dict[str, Composer]:
    """Return each method's composer over the same options, restricted to the method's.

    Megatron-LM's and Perseus's run the original graphs' options where they were given.
    """
    alone = ORIGINAL if originals is not None else "no-overlap"
    # A data-parallel step (:mod:`kareus.planner.data_parallel`) has one profile per graphs;
    # only kareus clocks it (the baselines' plans cover the pipeline's compute).
    step = STEP_ORIGINAL if originals is not None else STEP
    restrict: dict[str, Callable[[Option], bool]] = {
        "megatron": lambda o: o.freq_mhz == fmax and o.profile in (alone, step),
        "perseus": lambda o: o.profile == alone or (o.profile == step and o.freq_mhz == fmax),
        "nanobatch+perseus": lambda o: (
            o.profile == "nanobatch" or (o.profile == STEP and o.freq_mhz == fmax)
        ),
        "kareus": lambda o: o.profile not in (ORIGINAL, STEP_ORIGINAL),
    }
    return {
        method: Composer(
            Problem(
                iteration,
                {g: tuple(o for o in opts if keep(o)) for g, opts in options.items()},
                static_power_w,
                parallel.gpus,
                parallel.gpus_per_stage,
            ),
            settings.solve_knobs(),
        )
        for method, keep in restrict.items()
    }


def _clock_schedule(iteration: Iteration, chosen: Solution) -> tuple[ScheduledInstruction, ...]:
    """Return each instruction with the clock, time and energy of its chosen option."""
    return tuple(
        ScheduledInstruction(
            instr.stage,
            instr.kind,
            instr.microbatch,
            opt.freq_mhz,
            opt.time_s,
            opt.dynamic_energy_j,
        )
        for instr, opt in zip(iteration.instructions, chosen.choices, strict=True)
    )


def _decisions(
    iteration: Iteration,
    chosen: Solution,
    profiles_by_group: dict[tuple[int, str], dict[str, dict[str, Pair]]],
    unsplit: bool,
) -> dict[str, dict[str, Decision]]:
    """Return the overlap decisions per "stage/kind" (none where the graphs stay whole)."""
    decisions: dict[str, dict[str, Decision]] = {}
    for instr, opt in zip(iteration.instructions, chosen.choices, strict=True):
        if instr.kind == STEP:
            continue
        pairs = {} if unsplit else profiles_by_group[instr.group][opt.profile]
        decisions[f"{instr.stage}/{instr.kind}"] = {
            key: Decision(slot, share) for key, (slot, share) in pairs.items()
        }
    return decisions


def _parallel_record(parallel: Parallelism) -> dict[str, int]:
    return {
        "tp": parallel.tp,
        "cp": parallel.cp,
        "pp": parallel.pp,
        "microbatches": parallel.microbatches,
        **({"virtual_stages": parallel.virtual_stages} if parallel.virtual_stages > 1 else {}),
    }


def _solve_counts(comps: Iterable[Composer], gap_limit: float) -> dict[str, int]:
    comps = list(comps)
    return {
        "solves": sum(len(c.solves) for c in comps),
        # solves the relaxation left outside the gap limit, searched by CP-SAT
        "cp_sat_solves": sum(c.searches - c.branch_searches for c in comps),
        # of them, searched by SCIP's branch and bound (iterations of up to
        # PlannerSettings.branch_max_instructions)
        "branch_solves": sum(c.branch_searches for c in comps),
        # not proven within the gap limit (CP-SAT stopped at its work limit)
        "solves_not_proven_optimal": sum(not s.proven(gap_limit) for c in comps for s in c.solves),
    }


def _per_stage(psets: PartitionSet | Sequence[PartitionSet], stages: int) -> list[PartitionSet]:
    """Return one set per pipeline stage (a single set, or too few, repeat the first)."""
    out = list(psets) if isinstance(psets, Sequence) else [psets] * stages
    return out if len(out) == stages else [out[0]] * stages


def _nanobatches(s: Solution) -> int:
    """Return 1 for a plan of the original graphs, 2 for one of the split graphs."""
    return 1 if s.choices and s.choices[0].profile == ORIGINAL else 2


def _point(s: Solution, iteration: Iteration, whole: bool = False) -> FrontierPoint:
    changes = len(switches(iteration, s.choices))
    nanobatches = 1 if whole else _nanobatches(s)
    return FrontierPoint(s.time_s, s.energy_j, s.bound_j, nanobatches, changes)


def plan_for_gpu(
    psets: PartitionSet | Sequence[PartitionSet],
    spec: GPUSpec,
    evaluator: Evaluator | None = None,
    **kwargs: Any,
) -> PlanningResult:
    """Plan for a GPU spec: its name, clocks, static power and clock-change cost.

    The emulator prices the options by default. ``data_parallel`` (a
    :class:`~kareus.planner.data_parallel.DataParallel`) with ``weights`` (each stage's
    :class:`~kareus.planner.data_parallel.StageWeights`) adds data-parallel traffic, priced
    by the emulator on the GPU's NVLink or its network. ``policy``, ``energy_budget_j`` and
    ``deadline_s`` make the :class:`~kareus.planner.select.Pick`; ``settings`` and
    ``progress`` are :func:`plan_iteration`'s; the other keyword arguments are
    :class:`IterationInputs`' fields.
    """
    settings = kwargs.pop("settings", None) or PlannerSettings()
    if settings.switch is None:
        switch = SwitchCost(spec.clock_switch_s, spec.clock_switch_source)
        settings = dataclasses.replace(settings, switch=switch)
    local = evaluator if evaluator is not None else Emulator(spec)
    layout, weights = kwargs.pop("data_parallel", None), kwargs.pop("weights", None)
    if layout is not None:
        share = settings.no_overlap_sm_share
        kwargs["data_parallel"] = data_parallel_planning(spec, local, layout, weights, share)
    picked = {k: kwargs.pop(k) for k in ("policy", "energy_budget_j", "deadline_s") if k in kwargs}
    pick = Pick(**picked)
    progress = kwargs.pop("progress", None)
    inputs = IterationInputs(
        stages=psets,
        gpu=spec.name,
        clocks_mhz=spec.clocks_mhz(),
        static_power_w=spec.calibration.static_power_w,
        **kwargs,
    )
    return plan_iteration(inputs, local, settings=settings, pick=pick, progress=progress)

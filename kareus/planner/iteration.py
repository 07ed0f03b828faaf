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
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.hardware import Emulator, GPUSpec
from kareus.ir.costs import Evaluator, Knobs, PartitionWork
from kareus.ir.partitions import Decision, PartitionSet
from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction
from kareus.planner.compose import Composer, Solution
from kareus.planner.dag import (
    SCHEDULES,
    Iteration,
    Option,
    SwitchCost,
    schedule_iteration,
    switches,
)
from kareus.planner.data_parallel import (
    IN_GRAPH,
    STEP,
    STEP_ORIGINAL,
    DataParallelPlanning,
    add_data_parallel,
    blind_gain,
    data_parallel_planning,
)
from kareus.planner.knobs import CountingEvaluator, KnobSpace, Setting, default_clocks, knobs_of
from kareus.planner.pareto import TIME_RESOLUTION_S, pareto_front
from kareus.planner.search import SearchResult, exhaustive, search
from kareus.planner.select import select
from kareus.planner.sweep import REFINE_GAP, best_within

METHODS = ("megatron", "perseus", "nanobatch+perseus", "kareus")
Pair = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerSettings:
    """Knobs of the planner itself.

    Attributes:
        clocks_mhz: clocks to consider; None takes a spread of the top of the GPU's range
            (:data:`~kareus.planner.knobs.DEFAULT_CLOCK_COUNT` of them).
        sm_shares: SM shares of the collective to consider.
        no_overlap_sm_share: SMs of a collective that runs alone: NCCL's defaults, which
            reach its published bus bandwidth (about 230 GB/s on 8 A100s, with 24 channels:
            NCCL's init log on an HGX A100, NVIDIA/nccl-tests#100), in the hardware model
            32 CTAs of the measured copy rate.
        default_sm_share: SMs of a collective that the nanobatching baseline overlaps on
            the default communicator: NCCL's defaults again, hence the same 32. With 16
            (an SM limit the baseline does not set) its plans priced 10 % slower than the
            reference A100 nanobatching plans at TP 8 (``benchmarks/pipeline_fidelity.py``).
        exhaustive: evaluate every setting instead of searching.
        budget_fraction: search budget as a fraction of each type's grid.
        sweep_points: bounds swept to trace each frontier.
        solver_time_limit_s: CP-SAT's deterministic work limit per solve and 64
            instructions (in its deterministic time units, roughly seconds of one core): a
            limit of work, not of wall-clock time, so plans never depend on machine load.
        solver_workers: CP-SAT workers; more than one are interleaved in one thread (that
            keeps the search deterministic).
        solver_gap_limit: a solve stops once its plan is proven within this fraction of
            the least energy at its time bound: by the linear relaxation alone, or else by
            CP-SAT's search (each point's proven gap is reported).
        search_max_instructions: CP-SAT searches only iterations of at most this many
            instructions; larger ones keep the relaxation's plan (improved by its dive) with
            its proven gap. On the traced Llama 3.3 70B PP 8 x 16 with full recompute (256
            instructions) CP-SAT's five searches took 102 s of the 127 s planning and
            improved one point by 0.04 %. Smaller iterations (the README's main job has 32
            instructions) keep it for the points the relaxation and dive leave loose.
        dive_max_instructions: the relaxation's dive (re-solving with mixed instructions
            fixed, round by round) improves the rounded plan only in iterations of at most
            this many instructions; larger ones keep the rounded plan with its proven gap.
            At 2,048 instructions (the traced Llama 3.3 70B, PP 16 x 64) each round
            re-solves a program of about 100,000 variables: with dives planning took more
            than 15 minutes, without them 24-47 s with every point within 0.92 % (the
            chosen one within 0.43 %).
        flow_min_instructions: iterations of at least this many instructions solve the
            relaxation as a min-cost flow (:mod:`kareus.planner.flow`: the simplex's bound,
            a plan rounded about as well, a solve in 0.1-2 s at 4,096 instructions) rather
            than by the simplex (None: always the simplex). Where the flow's plan is not
            proven within the gap limit and the iteration has at most
            ``dive_max_instructions``, the simplex dives as well and the better plan and
            bound are kept. The default starts past CP-SAT's search limit, so small
            iterations plan as before. On Llama 3.3 70B shapes, TP 8 (``python
            benchmarks/planner.py --scale 8x16,8x64,16x64,16x128``, 2026-12-03, 2 cores,
            on the ten clocks then planned by default): PP 8 x 64 (1,024 instructions)
            plans in 7.9 s instead of 16.9 s, PP 16 x 64 in 23 s instead of 63 s, PP 16 x
            128 in 77 s instead of 661 s, gaps no larger.
        switch: what one clock change costs; None takes the GPU spec's
            (:func:`plan_for_gpu`), or none where no spec is given.
    """

    clocks_mhz: tuple[float, ...] | None = None
    sm_shares: tuple[int, ...] = (2, 4, 8, 16, 32)
    no_overlap_sm_share: int = 32
    default_sm_share: int = 32
    exhaustive: bool = False
    budget_fraction: float = 0.2
    sweep_points: int = 10
    solver_time_limit_s: float = 1.0
    solver_workers: int = 1
    solver_gap_limit: float = 0.005
    search_max_instructions: int | None = 128
    dive_max_instructions: int | None = 1024
    flow_min_instructions: int | None = 129
    switch: SwitchCost | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How the job is parallelised: tensor, context, pipeline stages, micro-batches."""

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    cp: int = 1
    schedule: str = "1F1B"  # the pipeline schedule: a key of compose.SCHEDULES
    virtual_stages: int = 1  # stages per pipeline rank (Interleaved1F1B: 2 or more)

    @property
    def stages(self) -> int:
        """Pipeline stages: ranks times stages per rank (stage ``v * pp + r`` on rank r)."""
        return self.pp * self.virtual_stages

    @property
    def gpus_per_stage(self) -> int:
        """GPUs of one pipeline stage (tensor x context parallel)."""
        return self.tp * self.cp

    @property
    def gpus(self) -> int:
        """GPUs of one pipeline replica (its ranks, not its stages)."""
        return self.gpus_per_stage * self.pp


@dataclasses.dataclass
class PlanningResult:
    """Everything the planner computed (the plan plus per-type and per-method detail)."""

    plan: Plan
    searches: dict[str, SearchResult]
    frontiers: dict[str, list[Solution]]
    evaluations: int
    grid_size: int
    settings: PlannerSettings = PlannerSettings()


def plan_iteration(
    psets: PartitionSet | Sequence[PartitionSet],
    evaluator: Evaluator,
    *,
    gpu: str,
    clocks_mhz: Sequence[int],
    static_power_w: float,
    parallel: Parallelism = Parallelism(),
    settings: PlannerSettings = PlannerSettings(),
    policy: str = "iso_time",
    energy_budget_j: float | None = None,
    deadline_s: float | None = None,
    skip_reasons: Sequence[str] = (),
    progress: Any = None,
    workload: dict[str, Any] | None = None,
    original: PartitionSet | Sequence[PartitionSet] | None = None,
    data_parallel: DataParallelPlanning | None = None,
) -> PlanningResult:
    """Plan one training iteration.

    Args:
        psets: the partition set of each pipeline stage (one set is used for every stage).
        original: the same for the original graphs (no block split). Given, the Megatron-LM
            and Perseus baselines are priced on them and their Perseus plans join kareus's
            frontier where no split plan beats them; None prices the baselines on the split
            graphs, each collective alone (one nanobatch's launches more per kernel).
        evaluator: times and energies (the emulator, a replay, a profiler).
        gpu: GPU name, recorded in the plan.
        clocks_mhz: the GPU's supported clocks.
        static_power_w: static power of one GPU.
        parallel: tensor/pipeline parallel sizes and micro-batches per iteration.
        settings: planner knobs.
        policy: how to pick the plan (see :func:`kareus.planner.select.select`).
        energy_budget_j: the budget of policy ``energy_budget_j``.
        deadline_s: the deadline of policy ``deadline_s``.
        skip_reasons: reasons recorded by the passes, kept in the plan.
        progress: optional callable ``progress(step: str)`` for long steps (one call per
            type searched, one for the options, two for composing).
        workload: what was planned (model, batch shape...), recorded in the plan.
        data_parallel: the data-parallel layout, stage parameters and pricing; None: no
            data-parallel traffic or optimizer step (as before data parallelism was modelled).

    Raises:
        InfeasiblePlanError: the policy's budget or deadline cannot be met.
        KareusError: an unknown pipeline schedule.
    """
    _check_schedule(parallel)
    stages = _per_stage(psets, parallel.stages)
    originals = None if original is None else _per_stage(original, parallel.stages)
    ev = CountingEvaluator(evaluator)
    freqs = tuple(settings.clocks_mhz or default_clocks(clocks_mhz))
    note = progress or (lambda _step: None)
    evaluated = evaluate_options(stages, ev, freqs, static_power_w, settings, note, originals)
    blind_options = dict(evaluated.options)  # the data-parallel traffic replaces its lists
    iteration, dp_record = _iteration_for(
        parallel, evaluated.options, (stages, originals), data_parallel, freqs, note
    )
    comps = _composers(
        iteration, evaluated.options, max(freqs), static_power_w, parallel, settings, originals
    )
    frontiers = _frontiers(comps, settings, deadline_s, note, with_originals=bool(originals))
    chosen = _choose(frontiers, policy, energy_budget_j, deadline_s)
    counts = {"search": evaluated.searched, "total": ev.evaluations, "grid": evaluated.grid}
    counts |= _solve_counts(comps.values(), settings.solver_gap_limit)
    graphs = (stages, originals)
    if data_parallel is not None and data_parallel.layout.mode not in IN_GRAPH:  # else planned
        dp_record["blind"] = _seeing_data_parallel(
            parallel, blind_options, graphs, comps["kareus"], freqs, static_power_w, settings,
            (policy, energy_budget_j, deadline_s), note,
        )  # fmt: skip
    meta = {
        "gpu": gpu, "source": getattr(evaluator, "source", "modelled"), "policy": policy,
        "skip_reasons": tuple(skip_reasons), "static_power_w": static_power_w,
        "workload": dict(workload or {}), "data_parallel": dp_record,
        "clock_switch": dataclasses.asdict(settings.switch or SwitchCost()),
    }  # fmt: skip
    plan = _plan_file(chosen, frontiers, evaluated, iteration, graphs, parallel, counts, meta)
    return PlanningResult(
        plan, evaluated.searches, frontiers, ev.evaluations, evaluated.grid, settings
    )


def _seeing_data_parallel(
    parallel: Parallelism,
    blind_options: dict[tuple[int, str], list[Option]],
    graphs: tuple[Sequence[PartitionSet], Sequence[PartitionSet] | None],
    aware: Composer,
    freqs: Sequence[float],
    static_power_w: float,
    settings: PlannerSettings,
    request: tuple[str, float | None, float | None],
    note: Callable[[str], Any],
) -> dict[str, Any]:
    """Return what planning with the data-parallel traffic in view gained (:func:`blind_gain`).

    ``blind_options``: the options before the traffic was added; ``request``: the policy,
    its energy budget and deadline.
    """
    note("planning blind to the data-parallel traffic, to price what seeing it gained")
    policy, energy_budget_j, deadline_s = request
    iteration = _iteration_for(parallel, blind_options, graphs, None, freqs, lambda _s: None)[0]
    blind = _composers(
        iteration, blind_options, max(freqs), static_power_w, parallel, settings, graphs[1]
    )
    return blind_gain(
        blind["kareus"],
        aware,
        policy,
        baseline_time_s=blind["megatron"].fastest_choice().time_s,
        sweep_points=settings.sweep_points,
        energy_budget_j=energy_budget_j,
        deadline_s=deadline_s,
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


def _choose(
    frontiers: dict[str, list[Solution]],
    policy: str,
    energy_budget_j: float | None,
    deadline_s: float | None,
) -> Solution:
    """Return kareus's plan that ``policy`` picks (Megatron-LM's time is its baseline)."""
    chosen = select(
        frontiers["kareus"],  # type: ignore[arg-type]
        policy,
        baseline_time_s=frontiers["megatron"][0].time_s,
        energy_budget_j=energy_budget_j,
        deadline_s=deadline_s,
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
    unsplit = _nanobatches(chosen) == 1
    return Plan(
        # The fingerprint is that of the graphs the chosen plan runs.
        fingerprint={
            f"{i}/{kind}": pset.fingerprint(kind)
            for i, pset in enumerate(originals if unsplit and originals else stages)
            for kind in ("forward", "backward")
        },
        pipeline_schedule=parallel.schedule,
        parallel=_parallel_record(parallel),
        frontier=tuple(_point(s, iteration) for s in frontiers["kareus"]),
        chosen=_point(chosen, iteration),
        schedule=_clock_schedule(iteration, chosen),
        decisions=_decisions(iteration, chosen, evaluated.profiles, unsplit),
        baselines={
            m: tuple(_point(s, iteration) for s in sols)
            for m, sols in frontiers.items()
            if m != "kareus"
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
            iteration,
            {g: [o for o in opts if keep(o)] for g, opts in options.items()},
            static_power_w=static_power_w,
            gpus=parallel.gpus,
            gpus_per_stage=parallel.gpus_per_stage,
            time_limit_s=settings.solver_time_limit_s,
            workers=settings.solver_workers,
            gap_limit=settings.solver_gap_limit,
            search_max_instructions=settings.search_max_instructions,
            dive_max_instructions=settings.dive_max_instructions,
            flow_min_instructions=settings.flow_min_instructions,
            switch=settings.switch,
        )
        for method, keep in restrict.items()
    }


def _frontiers(
    comps: dict[str, Composer],
    settings: PlannerSettings,
    deadline_s: float | None,
    note: Callable[[str], Any],
    *,
    with_originals: bool,
) -> dict[str, list[Solution]]:
    """Compose every method's frontier; kareus's is proven against the baselines' plans."""
    # kareus is also solved at each baseline's fastest time (every instruction at its
    # fastest option: known without a solve) and at the policy's deadline, the times it is
    # compared and selected at.
    anchors = [comps[m].fastest_choice().time_s for m in METHODS if m != "kareus"]
    anchors += [deadline_s] if deadline_s is not None else []

    def compose(method: str) -> list[Solution]:
        comp = comps[method]
        if method == "megatron":
            return [comp.solve(minimise="time")]
        return comp.frontier(settings.sweep_points, anchors if method == "kareus" else ())

    # The baselines are composed in a second thread while kareus is composed in this one:
    # the linear solver releases the GIL, and no composer reads another's results, so the
    # plan is the same as one thread's (at PP 16 x 64 this saves the baselines' ~25 s).
    note("composing kareus (the baselines alongside)")
    frontiers = _alongside(
        lambda: {m: compose(m) for m in METHODS if m != "kareus"},
        lambda: compose("kareus"),
    )
    note("proving kareus's frontier against the baselines")

    # Every baseline plan on the split graphs is also a kareus plan (its options are a
    # subset of kareus's): a point kareus's solves missed (CP-SAT stopped at its work limit)
    # must not make kareus look worse.
    # Its lower bounds are those kareus's own solves proved (a baseline's hold for its
    # options only); a baseline point left on it between kareus's bounds is solved at its
    # time by kareus's composer, so that it is improved or proven.
    split = [s for sols in frontiers.values() for s in sols if s.choices[0].profile != ORIGINAL]
    frontiers["kareus"] = comps["kareus"].prove(split)
    if with_originals:
        # A Perseus plan leaves the graphs unsplit; where no split plan beats it, it is
        # kareus's plan too (on a tie the simpler plan stays), proven by either bound.
        frontiers["kareus"] = _with_unsplit(
            frontiers["kareus"], frontiers["perseus"], comps["kareus"], comps["perseus"]
        )
    return frontiers


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
        "cp_sat_solves": sum(c.searches for c in comps),
        # not proven within the gap limit (CP-SAT stopped at its work limit)
        "solves_not_proven_optimal": sum(not s.proven(gap_limit) for c in comps for s in c.solves),
    }


def _alongside(
    baselines: Callable[[], dict[str, list[Solution]]], kareus: Callable[[], list[Solution]]
) -> dict[str, list[Solution]]:
    """Run ``baselines`` in a daemon thread and ``kareus`` in this one; return both.

    The thread is a daemon so that an interrupt need not wait for it. What either raised is
    raised here, this thread's first; the baselines' frontiers come first in the result.
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["baselines"] = baselines()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="kareus-baselines", daemon=True)
    thread.start()
    mine = kareus()
    thread.join()
    if "error" in out:
        raise out["error"]
    return {**out["baselines"], "kareus": mine}


ORIGINAL = "original"
"""The decision profile of the original graphs' options: blocks whole, collectives alone."""


def _per_stage(psets: PartitionSet | Sequence[PartitionSet], stages: int) -> list[PartitionSet]:
    """Return one set per pipeline stage (a single set, or too few, repeat the first)."""
    out = list(psets) if isinstance(psets, Sequence) else [psets] * stages
    return out if len(out) == stages else [out[0]] * stages


def _nanobatches(s: Solution) -> int:
    """Return 1 for a plan of the original graphs, 2 for one of the split graphs."""
    return 1 if s.choices and s.choices[0].profile == ORIGINAL else 2


UNSPLIT_REFINE_ROUNDS = 4
"""Rounds of solving interleaved split and unsplit points at their own times (a solve's
plan can itself land between the other composer's bounds)."""


def _with_unsplit(
    split: Sequence[Solution], unsplit: Sequence[Solution], mine: Composer, theirs: Composer
) -> list[Solution]:
    """Return the front of both frontiers, each point with the lower of both proven bounds.

    A split point's bound holds for split plans only; the least energy of any plan within
    its time is the lower of that and what the Perseus solves proved for unsplit plans
    (none is faster than Perseus's fastest: no bound is needed below it). Unsplit points
    come first, so that of two equal points the one that does not split stays. Where the
    two frontiers interleave, a point's time falls between the other composer's swept
    bounds, whose proof there is loose: a point left outside the refine gap is solved at
    its own time by each composer whose bound is loose there (once per composer and time),
    and what those solves find joins the front, for up to :data:`UNSPLIT_REFINE_ROUNDS`
    rounds (a solve's plan can itself land between the other composer's bounds).
    """
    known_split, known_unsplit = list(split), list(unsplit)
    # (no plan of a family is faster than its least time: no bound is needed below it)
    fastest_split = mine.fastest_choice().time_s
    fastest_unsplit = theirs.fastest_choice().time_s if unsplit else float("inf")

    def bounds(p: Solution) -> tuple[float | None, float | None]:
        ours = Composer.lower_bounds([p], mine.solves)[0]
        other = Composer.lower_bounds([p], theirs.solves)[0]
        return (
            float("inf") if p.time_s < fastest_split else ours,
            float("inf") if p.time_s < fastest_unsplit else other,
        )

    def front() -> list[Solution]:
        return pareto_front(
            [*known_unsplit, *known_split],
            key=lambda s: (s.time_s, s.energy_j),
            time_resolution=TIME_RESOLUTION_S,
        )

    def solved_at(comp: Composer, at: float) -> bool:
        return any(s.within_s is not None and abs(s.within_s - at) < 1e-9 for s in comp.solves)

    for _round in range(UNSPLIT_REFINE_ROUNDS):
        solved = False
        for p in front():
            ours, other = bounds(p)
            if ours is None or other is None:
                continue
            loose = max(REFINE_GAP, mine.gap_limit) * p.energy_j
            if p.energy_j - min(ours, other) <= loose:
                continue
            at = p.time_s + 1e-6
            split_loose = p.energy_j - ours > loose and p.time_s >= fastest_split
            if split_loose and not solved_at(mine, at):
                known_split.append(mine.solve(bound_s=at, hint=best_within(at, known_split)))
                solved = True
            unsplit_loose = p.energy_j - other > loose and p.time_s >= fastest_unsplit
            if unsplit_loose and not solved_at(theirs, at):
                hint = best_within(at, known_unsplit)
                known_unsplit.append(theirs.solve(bound_s=at, hint=hint))
                solved = True
        if not solved:
            break
    out = []
    for p in front():
        ours, other = bounds(p)
        bound = None if ours is None or other is None else min(ours, other)
        out.append(dataclasses.replace(p, within_s=p.time_s, bound_j=bound))
    return out


def _point(s: Solution, iteration: Iteration) -> FrontierPoint:
    changes = len(switches(iteration, s.choices))
    return FrontierPoint(s.time_s, s.energy_j, s.bound_j, _nanobatches(s), changes)


@dataclasses.dataclass
class Evaluated:
    """What planning evaluates before it composes (:func:`evaluate_options`).

    Attributes:
        searches: each type's search, by ``"stage/type"``.
        options: each (stage, kind)'s instruction options (clock x decision profile).
        profiles: each (stage, kind)'s decision profiles, by name.
        grid: the knob grid's size over the first stage's types.
        searched: evaluations the searches made.
    """

    searches: dict[str, SearchResult]
    options: dict[tuple[int, str], list[Option]]
    profiles: dict[tuple[int, str], dict[str, dict[str, Pair]]]
    grid: int
    searched: int


def evaluate_options(
    stages: Sequence[PartitionSet],
    ev: CountingEvaluator,
    freqs: Sequence[float],
    static_power_w: float,
    settings: PlannerSettings,
    note: Any = None,
    originals: Sequence[PartitionSet] | None = None,
) -> Evaluated:
    """Search each partition type and build every instruction's options.

    Every evaluation planning needs happens here (composing evaluates nothing), so a
    profiler that runs this records everything a later replay is asked for. ``originals``
    (the original graphs' sets, one per stage) add each instruction's options on them, at
    every clock with every collective alone (profile :data:`ORIGINAL`).
    """
    note = note or (lambda _step: None)
    freqs = tuple(freqs)

    # Per partition type: the frontier over the knob space.
    searches: dict[str, SearchResult] = {}
    for si, pset in enumerate(stages):
        for key, ptype in pset.types.items():
            name = f"{si}/{key}"
            if stages.index(pset) != si:  # the same set as an earlier stage
                searches[name] = searches[f"{stages.index(pset)}/{key}"]
                continue
            note(f"searching {name}")
            space = KnobSpace(
                freqs,
                settings.sm_shares,
                len(ptype.slot_labels) if ptype.collective else 0,
                settings.no_overlap_sm_share,
            )
            fn = exhaustive if settings.exhaustive else search
            kwargs = {} if settings.exhaustive else {"budget_fraction": settings.budget_fraction}
            work = PartitionWork(ptype.compute, ptype.collective)
            searches[name] = fn(work, space, ev, **kwargs)  # type: ignore[operator]
    grid = sum(r.grid_size for n, r in searches.items() if n.startswith("0/"))
    searched = ev.evaluations

    note("building instruction options")
    profiles_by_group = default_profiles(stages, settings)
    for (si, kind), profiles in profiles_by_group.items():
        for name, prof in _searched_profiles(si, kind, stages[si], searches).items():
            if prof not in profiles.values():  # a profile is tried once, by its first name
                profiles[name] = prof
    options = instruction_options(stages, ev, freqs, static_power_w, settings, profiles_by_group)
    if originals is not None:
        note("building the original graphs' options")
        alone = {
            group: {ORIGINAL: profiles["no-overlap"]}
            for group, profiles in default_profiles(originals, settings).items()
        }
        extra = instruction_options(originals, ev, freqs, static_power_w, settings, alone)
        for group, opts in extra.items():
            options[group] = options[group] + opts
    return Evaluated(searches, options, profiles_by_group, grid, searched)


def default_profiles(
    stages: Sequence[PartitionSet], settings: PlannerSettings
) -> dict[tuple[int, str], dict[str, dict[str, Pair]]]:
    """Return each (stage, kind)'s two fixed decision profiles (no search needed).

    ``no-overlap``: every collective alone, as Megatron-LM and Perseus run; ``nanobatch``:
    each collective launched at its partition's start on the default communicator.
    """
    out: dict[tuple[int, str], dict[str, dict[str, Pair]]] = {}
    for si, pset in enumerate(stages):
        for kind in ("forward", "backward"):
            with_coll = [
                k
                for k, t in pset.types.items()
                if t.instruction == kind and t.collective is not None
            ]
            out[(si, kind)] = {
                "no-overlap": {k: (None, None) for k in with_coll},
                "nanobatch": {k: (0, settings.default_sm_share) for k in with_coll},
            }
    return out


def instruction_options(
    stages: Sequence[PartitionSet],
    ev: CountingEvaluator,
    freqs: Sequence[float],
    static_power_w: float,
    settings: PlannerSettings,
    profiles: dict[tuple[int, str], dict[str, dict[str, Pair]]],
) -> dict[tuple[int, str], list[Option]]:
    """Each (stage, kind)'s options: every clock of ``freqs`` x every decision profile.

    An option's time and dynamic energy are those of the work outside partitions (with what
    activation recompute re-runs) plus each partition type's, under the profile's (slot,
    SM share), times the type's count in the instruction.
    """
    options: dict[tuple[int, str], list[Option]] = {}
    for si, pset in enumerate(stages):
        for kind in ("forward", "backward"):
            counts = pset.counts(kind)
            types = [k for k in pset.types if pset.types[k].instruction == kind]
            spaces = {
                key: KnobSpace(
                    tuple(freqs),
                    settings.sm_shares,
                    len(pset.types[key].slot_labels) if pset.types[key].collective else 0,
                    settings.no_overlap_sm_share,
                )
                for key in types
            }
            works = {
                key: PartitionWork(pset.types[key].compute, pset.types[key].collective)
                for key in types
            }
            opts = []
            for f in freqs:
                base_t, base_e = _base(pset, kind, f, ev, settings, static_power_w)
                for pname, pairs in profiles[(si, kind)].items():
                    t, e = base_t, base_e
                    for key in types:
                        pair = pairs[key] if pset.types[key].collective else (None, None)
                        est = ev.partition(works[key], knobs_of(Setting(f, *pair), spaces[key]))
                        t += counts.get(key, 0) * est.time_s
                        e += counts.get(key, 0) * (est.energy_j - static_power_w * est.time_s)
                    opts.append(Option(f, pname, t, e))
            options[(si, kind)] = opts
    return options


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
    by the emulator on the GPU's NVLink or its network. Other keyword arguments are
    :func:`plan_iteration`'s.
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
    return plan_iteration(
        psets,
        local,
        gpu=spec.name,
        clocks_mhz=spec.clocks_mhz(),
        static_power_w=spec.calibration.static_power_w,
        settings=settings,
        **kwargs,
    )


def _searched_profiles(
    stage: int, kind: str, pset: PartitionSet, searches: dict[str, SearchResult]
) -> dict[str, dict[str, Pair]]:
    """Decision profiles (one (slot, share) per type) the searches suggest for one group.

    Per type, the pairs on its frontier that are fastest and most frugal at the top, middle
    and bottom of the clock grid (the fixed profiles, :func:`default_profiles`, come first).
    """
    with_coll = [
        k for k, t in pset.types.items() if t.instruction == kind and t.collective is not None
    ]
    profiles: dict[str, dict[str, Pair]] = {}
    for label in ("fast", "frugal"):
        for where in ("top", "mid", "low"):
            prof: dict[str, Pair] = {}
            for key in with_coll:
                pts = searches[f"{stage}/{key}"].points
                clocks = sorted({p.setting.freq_mhz for p in pts}, reverse=True)
                f = {"top": clocks[0], "mid": clocks[len(clocks) // 2], "low": clocks[-1]}[where]
                at = [p for p in pts if p.setting.freq_mhz == f]
                best = min(
                    at, key=(lambda p: p.time_s) if label == "fast" else (lambda p: p.energy_j)
                )
                prof[key] = best.setting.pair
            profiles[f"{label}@{where}"] = prof
    return profiles


def _base(
    pset: PartitionSet,
    kind: str,
    f: float,
    ev: CountingEvaluator,
    settings: PlannerSettings,
    static_power_w: float,
) -> tuple[float, float]:
    """Time and dynamic energy of an instruction's work outside partitions at clock f.

    That is the compute outside partitions, what activation recompute re-runs, and the
    collectives that overlap nothing.
    """
    t = e = 0.0
    for ops in (pset.outside(kind), pset.recompute.get(kind, ())):
        if ops:
            est = ev.ops(ops, f)
            t += est.time_s
            e += est.energy_j - static_power_w * est.time_s
    for coll in pset.exposed.get(kind, ()) + pset.recompute_collectives.get(kind, ()):
        est = ev.partition(
            PartitionWork((), coll), Knobs(f, settings.no_overlap_sm_share, launch_slot=None)
        )
        t += est.time_s
        e += est.energy_j - static_power_w * est.time_s
    return t, e

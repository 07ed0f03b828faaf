"""The main job: from a workload and a GPU type to a plan, its report and its plot.

Traces the workload at scale (:mod:`kareus.jobs.trace`, kept by :mod:`kareus.jobs.cache`),
plans every method on one evaluator (:mod:`kareus.planner`), and returns what a user reads:
``plan.json`` (apply it with ``kareus.compile(model, plan=...)``), and, written by
:mod:`kareus.jobs.report`, ``report.md``, ``frontier.png`` and the partition sets. Used by
``kareus plan`` and by the benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import resource
import time
from collections.abc import Callable, Sequence

from kareus.hardware import GPUSpec, gpu
from kareus.ir.costs import Evaluator
from kareus.ir.partitions import PartitionSet
from kareus.ir.plan_file import Plan
from kareus.jobs.cache import traced_stages
from kareus.jobs.stages_file import distinct, load_partitions
from kareus.jobs.trace import Workload, workload_record
from kareus.planner import Parallelism, PlannerSettings, plan_for_gpu
from kareus.planner.iteration import PlanningResult

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkloadPlan:
    """A planned workload: the plan and what produced it.

    Attributes:
        work: the workload.
        spec: the GPU type.
        result: the planner's result (``result.plan`` is the plan).
        stages: each pipeline stage's partition set (identical stages share one).
        originals: the same for the original graphs (blocks whole), or None where they
            were not available (a replay, a partitions file that lacks them).
        trace_s, plan_s: wall time of tracing and of planning (measured).
        peak_rss_mib: peak resident memory of this process so far (measured).
        cached: the trace cache entry the partition sets were read from, if they were.
    """

    work: Workload
    spec: GPUSpec
    result: PlanningResult
    stages: list[PartitionSet]
    trace_s: float
    plan_s: float
    peak_rss_mib: float
    cached: pathlib.Path | None = None
    originals: list[PartitionSet] | None = None

    @property
    def plan(self) -> Plan:
        """The chosen plan."""
        return self.result.plan

    def distinct_stages(self) -> list[tuple[int, PartitionSet]]:
        """(first stage index, set) of each distinct partition set."""
        return distinct(self.stages)


def with_recompute(stages: Sequence[PartitionSet], mode: str) -> list[PartitionSet]:
    """Return the stages with ``mode``'s activation recompute (identical stages stay shared)."""
    done: dict[int, PartitionSet] = {}
    for pset in stages:
        if id(pset) not in done:
            done[id(pset)] = pset.recomputed(mode)
    return [done[id(p)] for p in stages]


def planning_steps(
    stages: Sequence[PartitionSet], originals: bool = True, data_parallel: bool = False
) -> int:
    """Return how many progress steps planning these stages reports.

    Originals' add one; data-parallel traffic two (pricing it, then planning blind to it).
    """
    return sum(len(p.types) for _, p in distinct(stages)) + 3 + originals + 2 * data_parallel


def plan_workload(
    work: Workload,
    gpu_name: str | GPUSpec,
    *,
    policy: str = "iso_time",
    settings: PlannerSettings | None = None,
    evaluator: Evaluator | None = None,
    energy_budget_j: float | None = None,
    deadline_s: float | None = None,
    layers: int = 4,
    partitions: str | pathlib.Path | None = None,
    cache: bool = True,
    on_traced: Callable[[list[PartitionSet], list[PartitionSet] | None], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> WorkloadPlan:
    """Trace ``work``, plan it on ``gpu_name`` (the emulator unless ``evaluator``), return all.

    Args:
        work: model, parallel sizes, batch shape, dtype.
        gpu_name: a GPU of :data:`kareus.hardware.GPUS` (aliases such as ``a100-40gb``), or
            its spec as :func:`kareus.hardware.gpu` resolved it (the CLI resolves it once).
        policy: how to pick the plan (:func:`kareus.planner.select`).
        energy_budget_j: the budget of policy ``energy_budget_j``.
        deadline_s: the deadline of policy ``deadline_s``.
        settings: planner knobs (clocks, SM shares, search budget...).
        evaluator: times and energies; the emulator of ``gpu_name`` by default.
        layers: layers traced per pipeline stage; the rest are counted.
        partitions: a ``partitions.json`` of an earlier run of this workload: its partition
            sets are used instead of tracing again (and its original graphs' sets, if it
            holds them; else the baselines are priced on the split graphs).
        cache: read and write traced partition sets in the trace cache
            (:func:`kareus.jobs.cache.trace_cache_dir`), keyed by everything tracing depends on.
        on_traced: called with the stages' partition sets and the original graphs' (None
            where there are none) once tracing is done.
        progress: called with a short description before each long step.

    Raises:
        UnknownGPUError, ValueError: bad input. TraceError: tracing failed.
        InfeasiblePlanError: the policy's budget or deadline cannot be met.
    """
    spec = gpu_name if isinstance(gpu_name, GPUSpec) else gpu(gpu_name)
    start = time.perf_counter()
    stages, originals, notes, cached = _partition_sets(
        work, partitions, layers=layers, cache=cache, evaluator=evaluator, progress=progress
    )
    traced = time.perf_counter()
    _log.info("%d partitions, %d stages; planning on %s", _count(stages), len(stages), spec.name)
    if on_traced is not None:
        on_traced(stages, originals)
    stages, originals, notes = _recomputed(work, stages, originals, notes)
    result = plan_for_gpu(
        stages,
        spec,
        evaluator,
        parallel=parallelism(work),
        settings=settings or PlannerSettings(),
        policy=policy,
        energy_budget_j=energy_budget_j,
        deadline_s=deadline_s,
        skip_reasons=notes,
        progress=progress,
        workload=workload_record(work),
        original=originals,
        **_data_parallel(work),
    )
    done = time.perf_counter()
    _log.info(
        "planned in %.1f s: %d frontier points, chosen %.4f s, %.1f J (%s)",
        done - traced,
        len(result.plan.frontier),
        result.plan.chosen.time_s,
        result.plan.chosen.energy_j,
        result.plan.source,
    )
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return WorkloadPlan(
        work, spec, result, stages, traced - start, done - traced, peak_rss_mib, cached, originals
    )


def _data_parallel(work: Workload) -> dict[str, object]:
    """Return the planner's data-parallel arguments for ``work`` (none without ``dp``)."""
    layout = work.data_parallel()
    return {} if layout is None else {"data_parallel": layout, "weights": work.stage_weights()}


def _count(stages: Sequence[PartitionSet]) -> int:
    return sum(len(s.partitions) for s in stages)


def _recomputed(
    work: Workload,
    stages: list[PartitionSet],
    originals: list[PartitionSet] | None,
    notes: list[str],
) -> tuple[list[PartitionSet], list[PartitionSet] | None, list[str]]:
    """Apply the workload's activation recompute to both graphs' sets; note what it did."""
    stages = with_recompute(stages, work.recompute)
    if originals is not None:
        originals = with_recompute(originals, work.recompute)
    notes = notes + [
        f"stage {i}: {pset.notes['recompute']}"
        for i, pset in enumerate(stages)
        if "recompute" in pset.notes
    ]
    return stages, originals, notes


def _partition_sets(
    work: Workload,
    partitions: str | pathlib.Path | None,
    *,
    layers: int,
    cache: bool,
    evaluator: Evaluator | None,
    progress: Callable[[str], None] | None,
) -> tuple[list[PartitionSet], list[PartitionSet] | None, list[str], pathlib.Path | None]:
    """Return the split and original graphs' sets, the notes, and the cache entry read.

    From ``partitions`` (both graphs' sets from one read of the file), else traced.
    """
    if partitions is not None:
        stages, originals = load_partitions(work, partitions)
        notes: list[str] = []
        cached = None
        _log.info("read %d pipeline stages' partitions from %s", len(stages), partitions)
    else:
        # micro-batches of fewer than 2 * MIN_NANOBATCH sequences are split along the
        # sequence where the layers' attention is causal (kareus.passes.split_nanobatches)
        stages, notes, cached = traced_stages(work, layers=layers, cache=cache, progress=progress)
        originals = _originals(work, layers, cache, evaluator, progress)
    if originals is None:
        notes = [*notes, UNTRACED_ORIGINALS]
    return stages, originals, notes, cached


def parallelism(work: Workload) -> Parallelism:
    """Return the planner's view of the workload's parallel layout and schedule."""
    return Parallelism(
        tp=work.tp,
        cp=work.cp,
        pp=work.pp,
        virtual_stages=work.virtual_stages,
        microbatches=work.microbatches,
        schedule=work.schedule,
    )


UNTRACED_ORIGINALS = (
    "the original graphs were not traced (a replay answers only what was recorded, or the "
    "partitions file predates them): the Megatron-LM and Perseus baselines are priced on the "
    "split graphs, each collective alone"
)


def _originals(
    work: Workload,
    layers: int,
    cache: bool,
    evaluator: Evaluator | None,
    progress: Callable[[str], None] | None,
) -> list[PartitionSet] | None:
    """Return the original graphs' sets, traced (None for a replay).

    A replay is not traced for: it answers only the evaluations it recorded.
    """
    from kareus.planner import ReplayEvaluator

    if isinstance(evaluator, ReplayEvaluator):
        return None
    return traced_stages(work, layers=layers, cache=cache, progress=progress, nanobatches=1)[0]

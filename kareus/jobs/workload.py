"""The main job: from a workload and a GPU type to a plan, its report and its plot.

Traces the workload at scale (:mod:`kareus.jobs.trace`), plans every method on one evaluator
(:mod:`kareus.planner`), and writes the results a user reads: ``plan.json`` (apply it with
``kareus.compile(model, plan=...)``), ``report.md``, ``frontier.png`` and the partition
sets. Used by ``kareus plan`` and by the benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

from kareus._files import check_output_dir, write_text
from kareus.errors import KareusError
from kareus.hardware import GPUSpec, gpu
from kareus.ir.costs import Evaluator
from kareus.ir.partitions import PartitionSet
from kareus.ir.plan_file import FrontierPoint, Plan
from kareus.jobs.trace import Workload, trace
from kareus.planner import Parallelism, PlannerSettings, plan_for_gpu
from kareus.planner.iteration import PlanningResult
from kareus.planner.pareto import iso_energy_time_reduction, iso_time_energy_reduction

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
        return _distinct(self.stages)


_TRACED_FIELDS = (
    "model",
    "config",
    "tp",
    "cp",
    "pp",
    "microbatch_size",
    "seq_len",
    "dtype",
    "layers_per_stage",
    "virtual_stages",
)
"""Workload fields the partition sets depend on (the micro-batch count does not)."""


def save_stages(
    work: Workload,
    stages: Sequence[PartitionSet],
    path: str | pathlib.Path,
    originals: Sequence[PartitionSet] | None = None,
) -> None:
    """Write the stages' partition sets (each distinct set once) with their workload.

    ``originals``, the original graphs' sets, are written beside them when given.
    """
    data: dict[str, Any] = {"workload": workload_record(work), **_indexed(stages)}
    if originals is not None:
        data["original"] = _indexed(originals)
    write_text(path, json.dumps(data, indent=1) + "\n")


def _indexed(stages: Sequence[PartitionSet]) -> dict[str, Any]:
    """Each distinct set once, and per stage the index of its set."""
    distinct = [pset for _, pset in _distinct(stages)]
    return {
        "stages": [next(i for i, d in enumerate(distinct) if d is p) for p in stages],
        "sets": [d.to_dict() for d in distinct],
    }


@dataclasses.dataclass(frozen=True)
class _StageSets:
    """Per stage the index of its set, and the distinct sets."""

    stages: list[int]
    sets: list[PartitionSet]


@dataclasses.dataclass(frozen=True)
class _PartitionsFile:
    """What ``partitions.json`` holds (its schema)."""

    workload: dict[str, Any]
    stages: list[int]
    sets: list[PartitionSet]
    original: _StageSets | None = None  # the original graphs' (files before them lack it)


class PartitionsFileError(KareusError, ValueError):
    """A partitions.json that cannot be read, or was traced for another workload."""


def load_stages(work: Workload, path: str | pathlib.Path) -> list[PartitionSet]:
    """Read partition sets written by :func:`save_stages` for the same traced workload.

    Raises:
        PartitionsFileError: the file cannot be read or was traced for another workload.
    """
    return load_partitions(work, path)[0]


def load_originals(work: Workload, path: str | pathlib.Path) -> list[PartitionSet] | None:
    """Read the original graphs' sets of a :func:`save_stages` file (None if it has none).

    Raises:
        PartitionsFileError: as :func:`load_stages`.
    """
    return load_partitions(work, path)[1]


def load_partitions(
    work: Workload, path: str | pathlib.Path
) -> tuple[list[PartitionSet], list[PartitionSet] | None]:
    """Read a :func:`save_stages` file once: the split graphs' sets, and the original's.

    The original graphs' sets are None where the file has none.

    Raises:
        PartitionsFileError: as :func:`load_stages`.
    """
    from kareus.ir.schema import FileFormatError, parse, read_text

    try:
        data: _PartitionsFile = parse(
            _PartitionsFile, read_text(path, "partitions file"), str(path), "partitions file"
        )
    except FileFormatError as err:
        raise PartitionsFileError(str(err)) from None
    saved = data.workload
    groups = [("stages", _StageSets(data.stages, data.sets))]
    groups += [("original.stages", data.original)] if data.original is not None else []
    for name, group in groups:
        bad = [i for i in group.stages if not 0 <= i < len(group.sets)]
        if bad:
            raise PartitionsFileError(
                f"{path} is not a valid partitions file: {name} refers to set {bad[0]}, but "
                f"it holds {len(group.sets)} set(s)"
            )
    want = workload_record(work)
    # A field a file predates holds its default (virtual_stages came after the first files).
    defaults = {f.name: f.default for f in dataclasses.fields(Workload)}
    diff = [
        f"{k} {saved.get(k, defaults.get(k))!r} != {want.get(k)!r}"
        for k in _TRACED_FIELDS
        if saved.get(k, defaults.get(k)) != want.get(k)
    ]
    if diff:
        raise PartitionsFileError(f"{path} was traced for another workload: {', '.join(diff)}")
    split, *original = [[g.sets[i] for i in g.stages] for _name, g in groups]
    return split, (original[0] if original else None)


def _distinct(stages: Sequence[PartitionSet]) -> list[tuple[int, PartitionSet]]:
    """(first stage index, set) of each distinct set (identical stages share one object)."""
    seen: list[tuple[int, PartitionSet]] = []
    for i, pset in enumerate(stages):
        if all(pset is not other for _, other in seen):
            seen.append((i, pset))
    return seen


def with_recompute(stages: Sequence[PartitionSet], mode: str) -> list[PartitionSet]:
    """Return the stages with ``mode``'s activation recompute (identical stages stay shared)."""
    done: dict[int, PartitionSet] = {}
    for pset in stages:
        if id(pset) not in done:
            done[id(pset)] = pset.recomputed(mode)
    return [done[id(p)] for p in stages]


def planning_steps(stages: Sequence[PartitionSet], originals: bool = True) -> int:
    """Return how many progress steps planning these stages reports (with originals')."""
    return sum(len(p.types) for _, p in _distinct(stages)) + 3 + originals


def plan_workload(
    work: Workload,
    gpu_name: str,
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
        gpu_name: a GPU of :data:`kareus.hardware.GPUS` (aliases such as ``a100-40gb``).
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
            (:func:`trace_cache_dir`), keyed by everything tracing depends on.
        on_traced: called with the stages' partition sets and the original graphs' (None
            where there are none) once tracing is done.
        progress: called with a short description before each long step.

    Raises:
        UnknownGPUError, ValueError: bad input. TraceError: tracing failed.
        InfeasiblePlanError: the policy's budget or deadline cannot be met.
    """
    spec = gpu(gpu_name)
    start = time.perf_counter()
    if partitions is not None:  # both graphs' sets from one read of the file
        stages, originals = load_partitions(work, partitions)
        notes: list[str] = []
        cached = None
        _log.info("read %d pipeline stages' partitions from %s", len(stages), partitions)
    else:
        stages, notes, cached = traced_stages(work, layers=layers, cache=cache, progress=progress)
        originals = _originals(work, layers, cache, evaluator, progress)
    if originals is None:
        notes = [*notes, UNTRACED_ORIGINALS]
    traced = time.perf_counter()
    _log.info(
        "%d partitions over %d stages; planning on %s",
        sum(len(s.partitions) for s in stages),
        len(stages),
        spec.name,
    )
    if on_traced is not None:
        on_traced(stages, originals)
    stages = with_recompute(stages, work.recompute)
    if originals is not None:
        originals = with_recompute(originals, work.recompute)
    notes = notes + [
        f"stage {i}: {pset.notes['recompute']}"
        for i, pset in enumerate(stages)
        if "recompute" in pset.notes
    ]
    result = plan_for_gpu(
        stages,
        spec,
        evaluator,
        parallel=Parallelism(
            tp=work.tp,
            cp=work.cp,
            pp=work.pp,
            virtual_stages=work.virtual_stages,
            microbatches=work.microbatches,
            schedule=work.schedule,
        ),
        settings=settings or PlannerSettings(),
        policy=policy,
        energy_budget_j=energy_budget_j,
        deadline_s=deadline_s,
        skip_reasons=notes,
        progress=progress,
        workload=workload_record(work),
        original=originals,
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
    return WorkloadPlan(
        work,
        spec,
        result,
        stages,
        traced - start,
        done - traced,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        cached,
        originals,
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


def traced_stages(
    work: Workload,
    *,
    layers: int = 4,
    cache: bool = True,
    progress: Callable[[str], None] | None = None,
    nanobatches: int = 2,
) -> tuple[list[PartitionSet], list[str], pathlib.Path | None]:
    """Return each pipeline stage's partition set, the passes' notes and the cache entry read.

    From the trace cache, else by tracing (and writing the cache); an earlier run's
    ``partitions.json`` is read by :func:`load_partitions` instead. The sets are as traced:
    activation recompute is not applied (:func:`with_recompute`). ``nanobatches``: 2 for
    the nanobatched graphs kareus plans, 1 for the original ones.
    """
    entry = trace_cache_dir() / _cache_key(work, layers, nanobatches) if cache else None
    if entry is not None and (found := _read_cache(work, entry)) is not None:
        _log.info("partitions from the trace cache: %s", entry)
        return found[0], found[1], entry
    stages, notes = trace(work, layers=layers, progress=progress, nanobatches=nanobatches)
    if entry is not None:
        _write_cache(work, stages, notes, entry)
    return stages, notes, None


def trace_cache_dir() -> pathlib.Path:
    """Return where traced partition sets are kept.

    ``$KAREUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kareus``, else ``~/.cache/kareus``.
    """
    if os.environ.get("KAREUS_CACHE_DIR"):
        return pathlib.Path(os.environ["KAREUS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kareus"


@functools.cache
def _code_digest() -> str:
    """Return a digest of kareus's source and the torch version.

    Tracing's result depends on them besides the workload: a changed pass must not be
    served a stale trace.
    """
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    root = pathlib.Path(__file__).resolve().parents[1]  # the kareus package
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def _cache_key(work: Workload, layers: int, nanobatches: int = 2) -> str:
    record = workload_record(work)
    fields = {k: record.get(k) for k in _TRACED_FIELDS} | {"layers": layers, "code": _code_digest()}
    if nanobatches != 2:  # the nanobatched trace keeps the keys it always had
        fields["nanobatches"] = nanobatches
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _read_cache(work: Workload, entry: pathlib.Path) -> tuple[list[PartitionSet], list[str]] | None:
    """Return the cached stages and tracing notes, or None (absent or unreadable: re-trace)."""
    if not (entry / "partitions.json").is_file():
        return None
    try:
        stages = load_stages(work, entry / "partitions.json")
        notes = json.loads((entry / "notes.json").read_text())
    except (OSError, ValueError, KareusError) as err:
        _log.warning("trace cache entry %s unreadable (%s): tracing again", entry, err)
        return None
    return stages, [str(n) for n in notes]


def _write_cache(
    work: Workload, stages: Sequence[PartitionSet], notes: Sequence[str], entry: pathlib.Path
) -> None:
    """Keep the traced stages for the next run; a cache that cannot be written is skipped."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        write_text(entry / "notes.json", json.dumps(list(notes)) + "\n")
        save_stages(work, stages, entry / "partitions.json")  # last: it marks the entry whole
    except OSError as err:
        _log.warning("cannot write the trace cache at %s (%s); continuing without", entry, err)


def workload_record(work: Workload) -> dict[str, Any]:
    """Return the workload as plain data for the plan file."""
    data = dataclasses.asdict(work)
    if not isinstance(work.model, str):
        data["model"] = dataclasses.asdict(work.model)
    elif ":" in work.model:  # a module's config: its shape, which the name does not pin
        data["config"] = dataclasses.asdict(work.config)
    if work.layers_per_stage is not None:  # as JSON holds it, so records compare equal
        data["layers_per_stage"] = list(work.layers_per_stage)
    data["describe"] = work.describe()
    return data


def _pts(points: Sequence[FrontierPoint]) -> list[tuple[float, float]]:
    return [(p.time_s, p.energy_j) for p in points]


def comparison_rows(plan: Plan) -> list[tuple[str, ...]]:
    """Per method: fastest time and its energy, least energy, and kareus's gains over it."""
    rows: list[tuple[str, ...]] = []
    kareus = _pts(plan.frontier)
    methods: dict[str, Sequence[FrontierPoint]] = {**plan.baselines, "kareus": plan.frontier}
    mega = min(_pts(plan.baselines["megatron"])) if "megatron" in plan.baselines else None
    for name, pts in methods.items():
        fast_t, fast_e = min(_pts(pts))
        least = min(e for _, e in _pts(pts))
        iso_t = iso_time_energy_reduction(kareus, _pts(pts)) if name != "kareus" else None
        iso_e = iso_energy_time_reduction(kareus, _pts(pts)) if name != "kareus" else None
        rows.append(
            (
                name,
                f"{fast_t:.4f}",
                f"{fast_e:.1f}",
                f"{100 * (fast_e - mega[1]) / mega[1]:+.1f} %" if mega else "",
                f"{least:.1f}",
                _pct(iso_t),
                _pct(iso_e),
            )
        )
    return rows


COMPARISON_HEADER = (
    "method",
    "fastest time s",
    "its energy J",
    "energy vs Megatron",
    "least energy J",
    "kareus iso-time energy saving",
    "kareus iso-energy time saving",
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def contribution_lines(plan: Plan, default_sm_share: int) -> list[str]:
    """Split the chosen plan's saving over Megatron-LM into clocks, overlap and the joint choice.

    A ladder at one time (the slower of the chosen plan and Megatron-LM), read off the
    frontiers computed on the same options: Perseus (clocks alone), nanobatching + Perseus
    (overlap at its defaults, then clocks), kareus (overlap decisions and clocks together).
    Then the overlap decisions that differ from nanobatching's defaults.
    """
    from kareus.planner.pareto import no_slower

    chosen = plan.chosen
    mega = plan.baselines["megatron"][0]
    t_ref = max(chosen.time_s, mega.time_s)
    fronts = {**plan.baselines, "kareus": plan.frontier}

    def least_at_ref(method: str) -> float | None:
        ok = [p.energy_j for p in fronts.get(method, ()) if no_slower(p.time_s, t_ref)]
        return min(ok) if ok else None

    steps = [
        ("per-instruction clocks, no overlap (Perseus)", least_at_ref("perseus")),
        ("overlap at nanobatching's defaults, then clocks", least_at_ref("nanobatch+perseus")),
        ("overlap decisions and clocks chosen together (kareus)", least_at_ref("kareus")),
    ]
    rows = [("Megatron-LM: max clock, no overlap", f"{mega.energy_j:.1f}", "", "")]
    prev = mega.energy_j
    for label, energy in steps:
        if energy is None:
            rows.append((label, "no plan as fast", "n/a", ""))
            continue
        share = f"{100 * (prev - energy) / mega.energy_j:.1f} %"
        rows.append((label, f"{energy:.1f}", f"{prev - energy:.1f}", share))
        prev = energy
    lines = [
        f"Each method's least energy at {t_ref:.4f} s or faster (the slower of the chosen "
        "plan and Megatron-LM), read off its frontier on the same options; each step's "
        "saving is against the step before, as a share of Megatron-LM's energy.",
        "",
        _md_table(("plan", "energy J", "saved J", "of Megatron-LM's"), rows),
        "",
    ]
    changed = [
        (group, key, d)
        for group, decs in plan.decisions.items()
        for key, d in decs.items()
        if (d.launch_slot, d.sm_share) != (0, default_sm_share)
    ]
    total = sum(len(decs) for decs in plan.decisions.values())
    if not changed:
        lines.append(
            f"All {total} overlap decisions are nanobatching's defaults (launch at the "
            f"partition's start, SM share {default_sm_share}): kareus's saving over "
            "nanobatching + Perseus comes from clocks chosen knowing the overlap."
        )
        return lines
    listed = ", ".join(
        f"{group} {key}: "
        + (
            "no overlap"
            if d.launch_slot is None
            else f"slot {d.launch_slot}, SM {d.sm_share or 'default'}"
        )
        for group, key, d in changed
    )
    lines.append(
        f"{len(changed)} of {total} overlap decisions differ from nanobatching's defaults "
        f"(slot 0, SM share {default_sm_share}): {listed}."
    )
    return lines


def _gap_sentence(point: FrontierPoint) -> str:
    """Say how close to optimal the solver proved ``point`` (on the planner's options)."""
    if point.gap is None:
        return "No solve bounded its energy."
    if point.gap < 5e-4:
        return "The solver proved it the least energy of any plan as fast on these options."
    return (
        f"The solver proved that no plan as fast on these options uses more than "
        f"{100 * point.gap:.1f} % less energy."
    )


def write_outputs(planned: WorkloadPlan, out: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Write plan.json, report.md, frontier.png and partitions.json to ``out``."""
    from kareus.planner.plot import plot_frontiers

    out = check_output_dir(out)
    paths = {
        "plan": out / "plan.json",
        "report": out / "report.md",
        "plot": out / "frontier.png",
        "partitions": out / "partitions.json",
    }
    planned.plan.save(paths["plan"])
    plot_frontiers(planned.plan, paths["plot"])
    save_stages(planned.work, planned.stages, paths["partitions"], planned.originals)
    write_text(paths["report"], report_markdown(planned, plot_name=paths["plot"].name))
    return paths


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _why_loose(instructions: int, settings: PlannerSettings) -> str:
    """Say which size limit left solves unproven, and the setting that moves it ("" if none)."""
    limits = [
        (settings.dive_max_instructions, "the relaxation's dive", "dive_max_instructions"),
        (settings.search_max_instructions, "CP-SAT's search", "search_max_instructions"),
    ]
    skipped = [
        f"{what} runs on iterations of up to {limit} (`PlannerSettings.{name}`)"
        for limit, what, name in limits
        if limit is not None and instructions > limit
    ]
    if not skipped:
        return ""
    return (
        f"; this iteration has {instructions} instructions, and "
        + " and ".join(skipped)
        + ": raise the limit for tighter plans at the cost of planning time"
    )


def report_markdown(planned: WorkloadPlan, plot_name: str = "frontier.png") -> str:
    """Return the report: workload, comparison, frontiers, decisions, clocks, partitions, cost."""
    plan, work, src = planned.plan, planned.work, planned.plan.source
    cfg = work.config
    chosen = plan.chosen
    mega = min(_pts(plan.baselines["megatron"]))
    lines = [
        f"# kareus plan: {work.name} on {plan.gpu}",
        "",
        f"Every time and energy below is **{src}** "
        + (
            f"(the hardware model of {plan.gpu}; see *Hardware model* at the end)."
            if src == "modelled"
            else "(measured on the GPU)."
        )
        + " Energy is per training iteration, summed over all "
        f"{work.tp * work.cp * work.pp} GPUs of one pipeline, static power included.",
        "",
        "## Workload",
        "",
        _md_table(
            ("model", "layers", "hidden", "heads (kv)", "FFN", "vocab", "dtype"),
            [
                (
                    work.name,
                    cfg.num_layers,
                    cfg.hidden_size,
                    f"{cfg.num_heads} ({cfg.num_kv_heads})",
                    cfg.intermediate_size,
                    cfg.vocab_size,
                    work.dtype,
                )
            ],
        ),
        "",
        _md_table(
            ("TP", "CP", "PP", "micro-batch", "sequence", "micro-batches / iteration"),
            [(work.tp, work.cp, work.pp, work.microbatch_size, work.seq_len, work.microbatches)],
        ),
        "",
        "## Chosen plan",
        "",
        f"Policy `{plan.policy}`: {chosen.time_s:.4f} s and {chosen.energy_j:.1f} J per "
        f"iteration ({src}); Megatron-LM's default (max clock, no overlap) takes "
        f"{mega[0]:.4f} s and {mega[1]:.1f} J: "
        f"{100 * (chosen.time_s - mega[0]) / mega[0]:+.1f} % time, "
        f"{100 * (chosen.energy_j - mega[1]) / mega[1]:+.1f} % energy. " + _gap_sentence(chosen),
        "",
        *(
            [
                "It leaves the graphs unsplit (no nanobatches, no overlap): at its time no "
                "split plan beats per-instruction clocks alone, so `kareus.compile` applies "
                "its clocks only.",
                "",
            ]
            if plan.nanobatches == 1
            else []
        ),
        "## Methods side by side",
        "",
        "Iso-time saving: least energy among kareus's plans no slower than the method's "
        "fastest plan, against that plan's energy. Iso-energy saving: shortest kareus time "
        "using no more energy than the method's least-energy plan.",
        "",
        _md_table(COMPARISON_HEADER, comparison_rows(plan)),
        "",
        f"![time-energy frontiers]({plot_name})",
        "",
        "## Frontiers",
        "",
    ]
    lines += [
        "Proven gap: how far each point's energy may be above the least energy of any plan as "
        "fast, on the same options (the better of the linear relaxation's and CP-SAT's proven "
        "lower bounds); 0.0 % is proven optimal. Graphs: *split* in two nanobatches, or the "
        "*original* ones (blocks whole, each collective alone), which Megatron-LM and Perseus "
        "run and which kareus keeps where no split plan beats them.",
        "",
    ]
    methods: dict[str, Sequence[FrontierPoint]] = {"kareus": plan.frontier, **plan.baselines}
    for name, pts in methods.items():
        rows = [
            (
                i,
                f"{p.time_s:.4f}",
                f"{p.energy_j:.1f}",
                _pct(p.gap),
                "split" if p.nanobatches == 2 else "original",
                "chosen" if name == "kareus" and p == chosen else "",
            )
            for i, p in enumerate(pts)
        ]
        header = ("#", "time s", "energy J", "proven gap", "graphs", "")
        lines += [f"### {name} ({src})", "", _md_table(header, rows), ""]
    lines += [
        "## Where the saving comes from",
        "",
        *contribution_lines(plan, planned.result.settings.default_sm_share),
        "",
        "## Overlap decisions (per partition type)",
        "",
        _md_table(
            ("stage/kind", "type", "launch slot", "SM share"),
            [
                (
                    g,
                    k,
                    "no overlap" if d.launch_slot is None else d.launch_slot,
                    d.sm_share or "default",
                )
                for g, decs in plan.decisions.items()
                for k, d in decs.items()
            ],
        ),
        "",
        "## Clock schedule (MHz; F = forward, B = backward, then the micro-batch)",
        "",
    ]
    for s in sorted({c.stage for c in plan.schedule}):
        steps = " ".join(
            f"{c.kind[0].upper()}{c.microbatch}@{c.freq_mhz:g}"
            for c in plan.schedule
            if c.stage == s
        )
        lines.append(f"- stage {s}: {steps}")
    lines += [
        "",
        "## Partition types",
        "",
        "A partition is the compute of one nanobatch overlapped with the collective of the "
        "other. *per micro-batch* counts a type's partitions in one forward or backward of "
        "one micro-batch: each layer is split into two nanobatches, and a layer with two "
        "collectives per direction (attention, MLP) gives two partitions per nanobatch.",
        "",
    ]
    for i, pset in planned.distinct_stages():
        per = work.stage_layers()[i]
        lines += [
            f"### stage {i} ({per} layers; traced on fake tensors, repeated layers counted)",
            "",
            _md_table(
                ("type", "per micro-batch", "compute ‖ collective", "launch slots"),
                [
                    (
                        key,
                        sum(1 for p in pset.partitions if p.type_key == key),
                        t.describe(),
                        len(t.slot_labels),
                    )
                    for key, t in pset.types.items()
                ],
            ),
            "",
        ]
    ev = plan.evaluations
    lines += [
        "## Cost of planning (measured)",
        "",
        f"- tracing: {planned.trace_s:.1f} s; planning: {planned.plan_s:.1f} s; peak memory "
        f"{planned.peak_rss_mib:.0f} MiB",
        f"- evaluations: {ev.get('search', 0)} in the search of a {ev.get('grid', 0)}-setting "
        f"grid, {ev.get('total', 0)} in all; {ev.get('solves', 0)} solves of the composition "
        f"(linear relaxation; {ev.get('cp_sat_solves', 0)} searched further by CP-SAT; "
        f"{ev.get('solves_not_proven_optimal', 0)} not proven within "
        f"{100 * planned.result.settings.solver_gap_limit:g} % of optimal; "
        "each point's proven gap is in *Frontiers*)"
        + (
            _why_loose(len(plan.schedule), planned.result.settings)
            if ev.get("solves_not_proven_optimal", 0)
            else ""
        ),
        "",
        'Apply the plan: `model = kareus.compile(model, plan="plan.json", stage=STAGE)`.',
    ]
    if src == "modelled":
        lines += ["", "## Hardware model", "", f"{plan.gpu}: {planned.spec.calibration_source}"]
    lines += [f"- note: {r}" for r in plan.skip_reasons]
    return "\n".join(lines) + "\n"

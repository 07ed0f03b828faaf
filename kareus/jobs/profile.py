"""``kareus profile``: measure the partitions of a workload on the devices it trains on.

Launched like the training job, one process per GPU of one TP × CP group
(``torchrun --nproc-per-node TP*CP -m kareus profile ...``). Every rank traces the workload on
fake tensors, as ``kareus plan`` does, keeping each partition type as a runnable program
(:mod:`kareus.passes.extract_partitions`); then the ranks join a process group and run the
planner's own evaluation (:func:`kareus.planner.iteration.evaluate_options`) with a
:class:`~kareus.planner.measured.ProfilerEvaluator` over those programs. Each knob setting
the search asks for is measured: the launch slot by reordering the program, the SM share
through the communicator pool, the clock locked only when permitted (``--lock-clocks``) and
reset after each measurement, also on errors. The ranks agree on repetitions and combine
their results, so they take the same search decisions and run the same collectives.

The work outside partitions (embedding, head, loss, each block's weight gradients,
collectives that overlap nothing) is measured the same way, from the pieces the partition
set counts it in: the traced layers' pieces, and an ordinary layer's again for each layer
that was counted rather than traced. Work without a program (none in a normal trace) is
left to the hardware model, and its rows say so.

Writes to ``--out``: ``profiles.jsonl`` (the replay format of
:class:`~kareus.planner.knobs.ReplayEvaluator`; each row also names the partition type, the
GPU, the clock observed and what was measured), ``partitions.json`` (the partition sets the
rows belong to) and ``profile.md``. ``kareus plan --evaluator replay --replay
DIR/profiles.jsonl`` plans from them.

On a CPU (gloo) times are measured on the CPU and energies come from the hardware model of
``--gpu`` (its dynamic energy, plus static power over the measured time), so those rows are
labelled modelled. On a CUDA GPU time is measured over the window and energy through Zeus's
monitor (NVML's counter).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kareus._files import check_output_dir, write_text
from kareus.hardware import Emulator, GPUSpec, gpu
from kareus.ir.costs import Estimate, Knobs, OpCost, PartitionWork
from kareus.ir.partitions import PartitionSet
from kareus.jobs.program_device import Piece, ProgramDevice, programs_by_work, sm_clock
from kareus.jobs.trace import Workload, trace_programs
from kareus.jobs.workload import with_recompute
from kareus.planner import PlannerSettings
from kareus.planner.instruction_options import evaluate_options
from kareus.planner.knobs import CountingEvaluator, RecordingEvaluator, _digest
from kareus.planner.measured import ProfilerEvaluator
from kareus.runtime.clocks import ClockController, ClockError, EmulatedClocks

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """How measurements are taken.

    Attributes:
        window_s: shortest measurement window (NVML's energy counter needs about a second).
        warmup: executions before each measurement.
        lock_clocks: True locks each clock the search asks for (needs permission; without
            it the clock as found is measured and planned, never a failure); False never
            locks; None locks only where nothing real changes (the emulated GPU of a CPU
            run, whose clock only the energy model sees).
        device: ``cuda``, ``cpu`` or None (CUDA when available).
        seed: seed of the random inputs.
    """

    window_s: float = 1.0
    warmup: int = 3
    lock_clocks: bool | None = None
    device: str | None = None
    seed: int = 0


class _Profiled:
    """The evaluator of a profile: work with programs measured, anything else modelled."""

    def __init__(self, profiler: ProfilerEvaluator, device: ProgramDevice, model: Emulator):
        self.profiler = profiler
        self.device = device
        self.model = model

    @property
    def source(self) -> str:
        """The programs' source."""
        return self.device.source

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Measure a partition type's program; model work without one."""
        if self.device.has(work):
            return self.profiler.partition(work, knobs)
        return self.model.partition(work, knobs)

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Measure work outside partitions from its programs; model it without."""
        return self.partition(PartitionWork(ops, None), Knobs(freq_mhz, 0, launch_slot=None))


@dataclasses.dataclass
class ProfileResult:
    """What a profile measured.

    Attributes:
        work: the workload.
        spec: the GPU type planned for.
        stages: each pipeline stage's partition set.
        rows: one record per evaluation (what ``profiles.jsonl`` holds).
        clocks_mhz: the clocks measured at.
        device: where the programs ran (``cpu`` or the CUDA device's name).
        ranks: processes that measured together.
        trace_s, profile_s: wall time of tracing and of measuring.
        notes: what the passes and the profiler recorded.
    """

    work: Workload
    spec: GPUSpec
    stages: list[PartitionSet]
    rows: list[dict[str, Any]]
    clocks_mhz: tuple[float, ...]
    device: str
    ranks: int
    trace_s: float
    profile_s: float
    notes: list[str]
    planner: PlannerSettings


def profile_workload(
    work: Workload,
    gpu_name: str,
    out: str | pathlib.Path,
    *,
    planner: PlannerSettings | None = None,
    settings: ProfileSettings | None = None,
    layers: int = 4,
    clocks: ClockController | None = None,
    on_traced: Callable[[list[PartitionSet]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ProfileResult:
    """Measure every evaluation planning ``work`` needs; write the files (rank 0).

    Args:
        work: the workload (its TP × CP size is the number of processes).
        gpu_name: the GPU type: the plan's clocks and static power, and the energy model
            where energy is not measured.
        out: the output directory.
        planner: the planner's settings (clocks, SM shares, search); plan from the profile
            with the same ones.
        settings: how to measure.
        layers: layers traced per pipeline stage.
        clocks: the clock controller (default: the device's; the emulated GPU's on a CPU).
        on_traced: called with the stages' partition sets once tracing is done (rank 0).
        progress: called with a short description before each long step (rank 0).

    Raises:
        ValueError: the process count does not match TP × CP, the workload has no partition
            with a collective, or a CUDA device was asked for without one.
    """
    settings = settings or ProfileSettings()
    planner = planner or PlannerSettings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _check_group(work, world)
    device = _device(settings.device)
    spec = gpu(gpu_name)
    out = check_output_dir(out) if rank == 0 else pathlib.Path(out)
    note = progress if progress is not None and rank == 0 else (lambda _s: None)
    start = time.perf_counter()
    stages, notes, by_work, type_of = _traced(work, layers, note, device)
    traced = time.perf_counter()
    if on_traced is not None and rank == 0:
        on_traced(stages)
    created = _init_group(device, world, rank)
    try:
        if clocks is None:
            clocks = _controller(device, spec)
        job = _Job(work, spec, device, world, rank, out, settings, planner, note)
        freqs, recorder = _measure(job, stages, by_work, type_of, clocks, notes)
    finally:
        if created:
            dist.destroy_process_group()
    result = ProfileResult(
        work,
        spec,
        stages,
        recorder.rows,
        freqs,
        recorder.device_name,
        world,
        traced - start,
        time.perf_counter() - traced,
        notes,
        dataclasses.replace(planner, clocks_mhz=freqs),
    )
    if rank == 0:
        from kareus.jobs.stages_file import save_stages

        save_stages(work, stages, out / "partitions.json")
        write_text(out / "profile.md", profile_markdown(result, str(out)))
    return result


def _traced(
    work: Workload, layers: int, note: Callable[[str], Any], device: torch.device
) -> tuple[list[PartitionSet], list[str], dict[str, list[Piece]], dict[str, str]]:
    """Trace the workload's programs; return the sets, notes and programs by work and type.

    Raises:
        ValueError: no partition has a collective to measure.
    """
    stages, notes, programs = trace_programs(work, layers=layers, progress=note, device=device.type)
    stages = with_recompute(stages, work.recompute)
    by_work, type_of = programs_by_work(stages, programs)
    if not any(
        p.program.partition and p.program.partition.collective
        for pieces in by_work.values()
        for p in pieces
    ):
        raise ValueError(
            f"{work.describe()} has no partition with a collective to measure (TP and CP "
            "1 have none): plan its clocks with `kareus plan`"
        )
    return stages, notes, by_work, type_of


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one profiling process measures, where, and with which settings."""

    work: Workload
    spec: GPUSpec
    device: torch.device
    world: int
    rank: int
    out: pathlib.Path
    settings: ProfileSettings
    planner: PlannerSettings
    note: Callable[[str], Any]


def _measure(
    job: _Job,
    stages: list[PartitionSet],
    by_work: dict[str, list[Piece]],
    type_of: dict[str, str],
    clocks: ClockController,
    notes: list[str],
) -> tuple[tuple[float, ...], _Recorder]:
    """Measure every evaluation the planner's search asks for; return the clocks and rows."""
    work, spec, device, settings, planner = (
        job.work,
        job.spec,
        job.device,
        job.settings,
        job.planner,
    )
    wanted = settings.lock_clocks
    lock = _can_lock(clocks, device.type != "cuda" if wanted is None else wanted, notes)
    freqs = _clocks_to_measure(lock, planner, spec, device, notes)
    program_device = ProgramDevice(
        by_work,
        _groups(work.tp, work.cp, job.rank),
        device,
        model=Emulator(spec) if device.type != "cuda" else None,
        static_power_w=spec.calibration.static_power_w,
        gpu_index=device.index or 0,
        seed=settings.seed,
    )
    recorder = _Recorder(spec, device, job.world, program_device, type_of)
    evaluator = _evaluator(
        program_device, clocks, lock, spec, settings, job.rank, job.out, recorder
    )
    evaluate_options(
        stages,
        CountingEvaluator(evaluator),
        freqs,
        spec.calibration.static_power_w,
        dataclasses.replace(planner, clocks_mhz=freqs),
        job.note,
    )
    notes.extend(program_device.pool.notes if program_device.pool else [])
    return freqs, recorder


def _check_group(work: Workload, world: int) -> None:
    """Raise ValueError unless this job is one TP x CP group with a collective to measure."""
    group_size = work.tp * work.cp
    if world != group_size:
        raise ValueError(
            f"kareus profile measures one TP x CP group of {group_size} rank(s) "
            f"(TP {work.tp} x CP {work.cp}) but runs on {world}: launch it with "
            f"`torchrun --nproc-per-node {group_size} -m kareus profile ...`"
        )
    if group_size == 1:
        raise ValueError(
            f"{work.describe()} has no collective to overlap (TP and CP 1): nothing to "
            "profile; plan its clocks with `kareus plan`"
        )


def _clocks_to_measure(
    lock: bool, planner: PlannerSettings, spec: GPUSpec, device: torch.device, notes: list[str]
) -> tuple[float, ...]:
    """Return the clocks the search measures: the planner's if they can be locked, else one."""
    if lock:
        # (the first grid only: a plan replayed from these is not planned again on every
        # clock, which would mean measuring 2-3 times the settings on the GPU)
        return planner.planned_clocks(spec.clocks_mhz())
    found = sm_clock(device.index or 0) if device.type == "cuda" else None
    freqs = (float(found or spec.clock_max_mhz),)
    notes.append(
        f"clocks not locked: measured at the clock as found ({freqs[0]:g} MHz, "
        f"{'read from NVML' if found else 'taken as the maximum'}); only it is planned"
    )
    return freqs


class _Recorder:
    """Describes each evaluation for ``profiles.jsonl`` and keeps a row of it."""

    def __init__(
        self,
        spec: GPUSpec,
        device: torch.device,
        world: int,
        program_device: ProgramDevice,
        type_of: dict[str, str],
    ) -> None:
        self.spec = spec
        self.world = world
        self.program_device = program_device
        self.type_of = type_of
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.rows: list[dict[str, Any]] = []

    def __call__(self, w: PartitionWork, knobs: Knobs, est: Estimate) -> dict[str, Any]:
        measured = self.program_device.has(w)
        row = {
            "type": self.type_of.get(_digest(w), "not extracted"),
            "gpu": self.spec.name,
            "device": self.device_name,
            "ranks": self.world,
            "clock_mhz_observed": self.program_device.clock_mhz if measured else None,
            "time_source": "measured" if measured else "modelled",
            "energy_source": self.program_device.energy_source if measured else "modelled",
        }
        self.rows.append(row | {"knobs": dataclasses.asdict(knobs), "time_s": est.time_s})
        return row


def _evaluator(
    program_device: ProgramDevice,
    clocks: ClockController,
    lock: bool,
    spec: GPUSpec,
    settings: ProfileSettings,
    rank: int,
    out: pathlib.Path,
    recorder: _Recorder,
) -> Any:
    """Return the profiler (recording to ``profiles.jsonl`` on rank 0)."""
    profiler = ProfilerEvaluator(
        program_device,
        clocks,
        lock_clocks=lock,
        static_power_w=spec.calibration.static_power_w,
        warmup=settings.warmup,
        min_window_s=settings.window_s,
    )
    evaluator: Any = _Profiled(profiler, program_device, program_device.model or Emulator(spec))
    if rank == 0:
        path = out / "profiles.jsonl"
        path.unlink(missing_ok=True)
        evaluator = RecordingEvaluator(evaluator, path, recorder)
    return evaluator


def _device(name: str | None) -> torch.device:
    if name == "cuda" or (name is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA GPU; use --device cpu")
        index = int(os.environ.get("LOCAL_RANK", "0"))  # pragma: no cover - needs a GPU
        torch.cuda.set_device(index)  # pragma: no cover
        return torch.device("cuda", index)  # pragma: no cover
    return torch.device("cpu")


def _init_group(device: torch.device, world: int, rank: int) -> bool:
    """Join the profiling group (env:// from torchrun); return whether this call created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)  # type: ignore[arg-type]
    return True


def _groups(tp: int, cp: int, rank: int) -> dict[str, str | None]:
    """Create the TP and CP groups (every rank creates all); return this rank's by role.

    Ranks are laid out as in tracing: TP groups are consecutive ranks, CP groups stride TP.
    """
    roles: dict[str, str | None] = {"tp": None, "cp": None}
    if tp > 1:
        for c in range(cp):
            ranks = [c * tp + i for i in range(tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                roles["tp"] = group.group_name  # type: ignore[union-attr]
    if cp > 1:
        for t in range(tp):
            ranks = [t + c * tp for c in range(cp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                roles["cp"] = group.group_name  # type: ignore[union-attr]
    return roles


def _can_lock(controller: ClockController, lock: bool, notes: list[str]) -> bool:
    """Return whether ``controller`` may lock clocks; without permission say so, never fail."""
    if not lock:
        return False
    if controller.name == "dry-run":  # it would accept the lock and change nothing
        why = getattr(controller, "why", "") or "asked for"
        notes.append(f"clocks not locked (a dry run: {why}): measured at the clock as found")
        return False
    try:
        controller.set(max(controller.supported_clocks()))
        controller.reset()
    except ClockError as err:
        notes.append(f"cannot lock clocks ({err}): measured at the clock as found")
        _log.warning("cannot lock clocks (%s): measuring at the clock as found", err)
        return False
    return True


def _controller(device: torch.device, spec: GPUSpec) -> ClockController:
    """Return the clock controller of ``device``: the emulated GPU's on a CPU."""
    if device.type != "cuda":
        return EmulatedClocks(spec.clocks_mhz())
    from kareus.runtime.clocks import default_controller  # pragma: no cover - needs a GPU

    return default_controller()  # pragma: no cover


def profile_markdown(result: ProfileResult, out: str = "DIR") -> str:
    """Return ``profile.md``: what was measured, per partition type, and how to plan from it."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for row in result.rows:
        by_type.setdefault(row["type"], []).append(row)
    lines = [
        f"# kareus profile: {result.work.describe()}",
        "",
        f"Ran on {result.ranks} {result.device} process(es); planned for {result.spec.name}; "
        f"clocks {', '.join(f'{c:g}' for c in result.clocks_mhz)} MHz. Traced in "
        f"{result.trace_s:.1f} s, measured in {result.profile_s:.1f} s (wall, measured).",
        "",
        "| type | evaluations | time | energy | fastest time (s) | at knobs |",
        "|---|---|---|---|---|---|",
    ]
    for key, rows in by_type.items():
        best = min(rows, key=lambda r: r["time_s"])
        knobs = best["knobs"]
        where = (
            "no overlap"
            if knobs["launch_slot"] is None
            else f"slot {knobs['launch_slot']}, SM share {knobs['sm_share']}"
        )
        lines.append(
            f"| {key} | {len(rows)} | {rows[0]['time_source']} | {rows[0]['energy_source']} | "
            f"{best['time_s']:.6f} | {knobs['freq_mhz']:g} MHz, {where} |"
        )
    lines += ["", "Plan from it (the same clocks, SM shares and search):", ""]
    lines.append(f"    {plan_command(result, out)}")
    if result.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def plan_command(result: ProfileResult, out: str = "DIR") -> str:
    """Return the ``kareus plan`` command line that plans from this profile."""
    w, p = result.work, result.planner
    clocks = ",".join(f"{c:g}" for c in result.clocks_mhz)
    return (
        f"kareus plan --model {w.name} --gpu {result.spec.name} --tp {w.tp} --cp {w.cp} "
        f"--pp {w.pp} --microbatch-size {w.microbatch_size} --seq-len {w.seq_len} "
        f"--microbatches {w.microbatches} --dtype {w.dtype} --recompute {w.recompute} "
        + (f"--schedule {w.schedule} " if w.schedule != "1F1B" else "")
        + (f"--virtual-stages {w.virtual_stages} " if w.virtual_stages > 1 else "")
        + (
            f"--layers-per-stage {','.join(map(str, w.layers_per_stage))} "
            if w.layers_per_stage
            else ""
        )
        + f"--clocks {clocks} "
        f"--sm-shares {','.join(str(s) for s in p.sm_shares)}"
        + (" --exhaustive" if p.exhaustive else "")
        + f" --evaluator replay --replay {out}/profiles.jsonl --partitions {out}/partitions.json"
    )

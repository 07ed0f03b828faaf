"""Run the partition programs a trace extracted, as a profiling device of the planner.

:class:`ProgramDevice` runs each knob setting's program (reordered for its launch slot, its
collective on the SM share's communicator) and reads time (CUDA events, else the perf
counter) and energy (Zeus's monitor, else the hardware model);
:class:`~kareus.planner.measured.ProfilerEvaluator` drives it. :func:`programs_by_work`
maps each work planning prices to the programs that run it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from kareus.hardware import Emulator
from kareus.ir.costs import Estimate, Knobs, PartitionWork
from kareus.ir.partitions import Decision, PartitionSet
from kareus.passes.extract_partitions import scheduled, unnamed
from kareus.passes.programs import PartitionProgram
from kareus.planner.knobs import _digest


@dataclasses.dataclass(frozen=True)
class Piece:
    """A program that runs part of a work: how often, and whether without its collective."""

    program: PartitionProgram
    repeat: int = 1
    alone: bool = False  # the compute only: activation recompute re-runs a partition so


def programs_by_work(
    stages: list[PartitionSet], programs: list[dict[str, PartitionProgram]]
) -> tuple[dict[str, list[Piece]], dict[str, str]]:
    """Map the digest of each work planning evaluates to the programs that run it.

    Returns:
        The pieces per work digest, and a name per digest: the type key, or what outside
        partitions it is.
    """
    from kareus.jobs.extrapolate import template_block

    by_work: dict[str, list[Piece]] = {}
    names: dict[str, str] = {}

    def add(work: PartitionWork, pieces: list[Piece | None], name: str) -> None:
        if not pieces or any(p is None for p in pieces):
            return  # nothing extracted for it: the model answers
        got = tuple(o for p in pieces for o in p.program.work.ops)  # type: ignore[union-attr]
        if unnamed(PartitionWork(got)) != unnamed(PartitionWork(work.ops)):
            raise RuntimeError(f"the programs of {name} do not add up to its work")
        merged: dict[tuple[int, bool], Piece] = {}
        for p in pieces:
            assert p is not None
            k = (id(p.program), p.alone)
            merged[k] = dataclasses.replace(p, repeat=merged[k].repeat + 1) if k in merged else p
        digest = _digest(work)
        by_work.setdefault(digest, list(merged.values()))
        names.setdefault(digest, name)

    def piece(program: PartitionProgram | None, alone: bool = False) -> Piece | None:
        return Piece(program, alone=alone) if program is not None else None

    for si, (pset, progs) in enumerate(zip(stages, programs, strict=True)):
        for key, ptype in pset.types.items():
            work = PartitionWork(ptype.compute, ptype.collective)
            add(work, [piece(progs.get(key))], f"{si}/{key}")
            if ptype.collective is not None:
                alone = PartitionWork((), ptype.collective)
                add(alone, [piece(progs.get(f"{key}/collective"))], f"{si}/{key} collective")
        rest: dict[str, tuple[list[Piece | None], list[Piece | None]]] = {}
        for kind in ("forward", "backward"):
            template = template_block(pset, kind)
            head = [piece(progs.get(f"{kind}/outside"))] if pset.other.get(kind) else []
            blocks = [
                piece(progs.get(f"{kind}/block/{block}", progs.get(f"{kind}/block/{template}")))
                for block in pset.block_other.get(kind, {})
            ]
            rest[kind] = head, blocks
            add(PartitionWork(pset.outside(kind)), head + blocks, f"{si}/{kind} outside partitions")
            for coll in pset.exposed.get(kind, ()):
                program = progs.get(f"{kind}/exposed/{coll.name}")
                add(PartitionWork((), coll), [piece(program)], f"{si}/{kind} collective alone")
        redo = pset.recompute.get("backward", ())
        if redo and redo == pset.recomputed("full").recompute["backward"]:
            # Full recompute (PartitionSet.recomputed): each forward partition's compute, then
            # the rest of the layers' forward; a forward without layer blocks re-runs whole.
            forward = [p for p in pset.partitions if p.instruction == "forward"]
            parts = [piece(progs.get(p.type_key), alone=True) for p in forward]
            head, blocks = rest["forward"]
            add(PartitionWork(redo), parts + blocks or head, f"{si}/backward recompute")
    return by_work, names


class ProgramDevice:
    """Runs extracted partition programs: a profiling device of ``ProfilerEvaluator``.

    Args:
        programs: by the digest of the work they stand for, the programs that run it and
            how often each runs (the work outside partitions of a stage is the traced
            layers' pieces plus a repeated layer's, as the partition set counts it).
        groups: the real process group's name for each collective role (``tp``, ``cp``).
        device: where the programs run.
        model: the hardware model that supplies energy where nothing measures it (CPU).
        static_power_w: static power added over measured time to modelled energy.
        gpu_index: the CUDA index (energy and observed clock).
        seed: seed of the random inputs.
        codegen: "inductor" runs each program as Inductor compiles it, with the kernels
            training runs (fused memory-bound ops, SDPA's fused attention); "python" runs
            it op by op. Default: Inductor on a GPU, python on a CPU (tens of seconds a
            compile there, and the CPU's figures stand for no GPU's).
    """

    time_source = "measured"

    @property
    def counter_period_s(self) -> float:
        """NVML's energy counter moves about every 0.1 s (0: energy modelled, no counter)."""
        return 0.1 if self._monitor is not None else 0.0

    def __init__(
        self,
        programs: Mapping[str, list[Piece]],
        groups: Mapping[str, str | None],
        device: torch.device,
        *,
        model: Emulator | None,
        static_power_w: float,
        gpu_index: int = 0,
        seed: int = 0,
        codegen: str | None = None,
    ) -> None:
        from kareus.runtime.comm_pool import job_pool

        if codegen not in (None, "inductor", "python"):
            raise ValueError(f"codegen must be 'inductor' or 'python', got {codegen!r}")
        self.codegen = codegen or ("inductor" if device.type == "cuda" else "python")

        self.programs = programs
        self.groups = groups
        self.device = device
        self.model = model
        self.static_power_w = static_power_w
        self.gpu_index = gpu_index
        self.seed = seed
        self.pool = job_pool() if dist.is_initialized() else None
        self._graphs: dict[tuple[str, int | None, int | None], list[tuple[Piece, Any]]] = {}
        self._inputs: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._modelled_j = 0.0
        self._model_cache: dict[tuple[str, Knobs], Estimate] = {}
        self._start = time.perf_counter()
        self._measured_j = 0.0
        self.clock_mhz: float | None = None
        self._monitor: Any = None
        self._epoch: Any = None
        if device.type == "cuda":  # pragma: no cover - needs a CUDA GPU
            self._epoch = torch.cuda.Event(enable_timing=True)
            self._epoch.record()
            from zeus.monitor import ZeusMonitor

            self._monitor = ZeusMonitor(gpu_indices=[gpu_index], sync_execution_with="torch")
            self._monitor.begin_window("kareus-profile", sync_execution=True)

    @property
    def energy_source(self) -> str:
        """``measured`` where an energy counter is read, else ``modelled``."""
        return "measured" if self._monitor is not None else "modelled"

    @property
    def source(self) -> str:
        """``measured`` when time and energy both are."""
        return "measured" if self.energy_source == "measured" else "modelled"

    def has(self, work: PartitionWork) -> bool:
        """Whether ``work`` is a partition type with a program."""
        return _digest(work) in self.programs

    def run(self, work: PartitionWork, knobs: Knobs) -> None:
        """Run the programs of ``work`` once, ordered and grouped per ``knobs``."""
        key = _digest(work)
        slot = knobs.launch_slot
        share = knobs.sm_share if slot is not None else None  # alone: the default group
        graph_key = (key, slot, share)
        if graph_key not in self._graphs:
            self._graphs[graph_key] = [
                (
                    piece,
                    self._lowered(
                        piece.program,
                        scheduled(
                            piece.program,
                            Decision(slot, share),
                            None if piece.alone else self._group(piece.program),
                            self.pool if share is not None else None,
                        ),
                    ),
                )
                for piece in self.programs[key]
            ]
        with torch.no_grad():
            for piece, gm in self._graphs[graph_key]:
                inputs = self._inputs_of(piece.program)
                for _ in range(piece.repeat):
                    gm(*inputs)
        if self.model is not None:
            if (key, knobs) not in self._model_cache:  # outside the timed loop's cost
                alone = all(p.alone or self._group(p.program) is None for p in self.programs[key])
                ran = PartitionWork(work.ops) if alone else work  # collective left out
                self._model_cache[(key, knobs)] = self.model.partition(ran, knobs)
            self._modelled_j += self._model_cache[(key, knobs)].dynamic_energy_j

    def _lowered(self, program: PartitionProgram, gm: Any) -> Any:
        """Return ``gm`` as it runs: compiled by Inductor, or op by op (python)."""
        if self.codegen == "python":
            return gm
        from kareus.compiler.inductor_lowering import inductor_inference

        return inductor_inference(gm, self._inputs_of(program))

    def _group(self, program: PartitionProgram) -> str | None:
        """Return the real group of the program's collective (None: left out)."""
        role = program.group_name
        return self.groups.get(role) if role is not None else None

    def _inputs_of(self, program: PartitionProgram) -> list[torch.Tensor]:
        """Random inputs of ``program``, kept for the programs run most recently."""
        if program.key not in self._inputs:
            while len(self._inputs) >= 8:
                self._inputs.popitem(last=False)
            self._inputs[program.key] = program.make_inputs(self.device, self.seed)
        self._inputs.move_to_end(program.key)
        return self._inputs[program.key]

    def synchronize(self) -> None:
        """Wait for the device."""
        if self.device.type == "cuda":  # pragma: no cover - needs a CUDA GPU
            torch.cuda.synchronize(self.device)

    def now_s(self) -> float:
        """Return the device's time: CUDA events on a GPU, the perf counter on a CPU."""
        if self._epoch is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # pragma: no cover - needs a GPU
        event.record()  # pragma: no cover
        event.synchronize()  # pragma: no cover
        return float(self._epoch.elapsed_time(event)) / 1e3  # pragma: no cover

    def energy_j(self) -> float:
        """Return the cumulative energy: measured through Zeus, else modelled.

        Modelled energy is the hardware model's dynamic energy of what ran plus static
        power over the measured time.
        """
        if self._monitor is None:
            return self._modelled_j + self.static_power_w * (time.perf_counter() - self._start)
        m = self._monitor.end_window("kareus-profile", sync_execution=True)  # pragma: no cover
        self._monitor.begin_window("kareus-profile", sync_execution=True)  # pragma: no cover
        self._measured_j += m.total_energy  # pragma: no cover
        return self._measured_j  # pragma: no cover

    def agree(self, reps: int) -> int:
        """Return the largest repetition count any rank asks for."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return reps
        t = torch.tensor([reps], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def combine(self, time_s: float, energy_j: float) -> tuple[float, float]:
        """Return the slowest rank's time and the ranks' mean energy (per GPU)."""
        self.clock_mhz = sm_clock(self.gpu_index) if self.device.type == "cuda" else None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return time_s, energy_j
        dev = self._collective_device()
        t = torch.tensor([time_s], dtype=torch.float64, device=dev)
        e = torch.tensor([energy_j], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(e)
        return float(t.item()), float(e.item()) / dist.get_world_size()

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def sm_clock(index: int) -> float | None:  # pragma: no cover - needs a CUDA GPU
    """Return the SM clock of CUDA device ``index`` now (NVML), or None when unreadable."""
    from kareus.jobs.gpu_watch import nvml_reader

    reader = nvml_reader(index)
    return reader()[0] if reader is not None else None

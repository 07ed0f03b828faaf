"""Trace a real model configuration without its hardware, and count what repeats.

A preset of :mod:`kareus.models` is built under ``FakeTensorMode`` (parameters and
activations have shapes and dtypes but no storage) inside a fake process group whose world
is the configuration's tensor × context-parallel size, so one process traces a rank of a
70B model split over 64 GPUs. Only a few layers of each pipeline stage are traced: the
partitions of an interior layer repeat for every other layer of the stage, so the
partition set of a full stage is the traced one plus that layer's partitions counted again.
Tracing cost does not grow with depth.

The fake process group is for tracing only: no collective runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kareus.errors import KareusError, TraceError
from kareus.ir.partitions import PartitionSet
from kareus.jobs.extrapolate import TEMPLATE_POSITION, extrapolate
from kareus.jobs.fake_step import block_notes, run_stage
from kareus.jobs.workload_spec import DTYPES, Workload
from kareus.models.sources import (
    FactoryModel,
    HFModel,
    run_failure,
)
from kareus.passes.programs import PartitionProgram

if TYPE_CHECKING:
    pass


@contextlib.contextmanager
def fake_world(tp: int, cp: int, dp: int = 1, ep: int = 1) -> Iterator[tuple[Any, ...]]:
    """Start a fake process group; yield the (tp, cp, dp, ep) groups.

    This process plays rank 0. Ranks are ordered as Megatron-LM and torch's device meshes
    order them: tensor parallel innermost, then context, then data parallel (``dp`` > 1 only
    where data parallelism is in the graphs, :attr:`Workload.graph_dp`). The expert-parallel
    group takes the first ``ep`` data-parallel ranks (stride ``tp * cp``): with TP x CP of
    8 and EP 2 its all-to-all crosses nodes of 8 GPUs. A group of one rank is None.

    Raises:
        TraceError: a process group is already initialised in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TraceError(
            "tracing at scale starts its own fake process group, but this process already "
            "has one; trace in a separate process (`kareus plan` does)"
        )
    world = tp * cp * max(dp, ep)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        tp_group = dist.new_group(list(range(tp))) if tp > 1 else None
        cp_group = dist.new_group(list(range(0, tp * cp, tp))) if cp > 1 else None
        dp_group = dist.new_group(list(range(0, tp * cp * dp, tp * cp))) if dp > 1 else None
        ep_group = dist.new_group(list(range(0, tp * cp * ep, tp * cp))) if ep > 1 else None
        yield tp_group, cp_group, dp_group, ep_group
    finally:
        dist.destroy_process_group()


def stage_kinds(pp: int) -> list[int]:
    """Return the indices of the distinct pipeline stages: first, one middle, last."""
    return sorted({0, min(1, pp - 1), pp - 1})


@dataclasses.dataclass
class StageTrace:
    """What tracing one pipeline stage found.

    Attributes:
        pset: the stage's partition set (the traced layers only).
        notes: what the passes recorded.
        programs: each partition type as a runnable program, by type key (when extracted).
    """

    pset: PartitionSet
    notes: list[str]
    programs: dict[str, PartitionProgram] = dataclasses.field(default_factory=dict)


def trace_stage(
    work: Workload,
    stage: int,
    *,
    layers: int,
    groups: tuple[Any, ...] = (None, None, None),
    extract: bool = False,
    device: str = "cpu",
    nanobatches: int = 2,
) -> StageTrace:
    """Trace ``layers`` layers of one pipeline stage.

    Runs one forward and backward of a kareus-compiled stage on fake tensors (analysis
    passes only: nothing is rewritten).

    Args:
        work: the configuration.
        stage: the pipeline stage.
        layers: decoder layers traced.
        groups: the (TP, CP, DP, EP) process groups of :func:`fake_world`; with a DP group,
            the stage's parameters are sharded over it and gathered in the graph
            (:func:`~kareus.models.parallel.gather_in_graph`, SimpleFSDP).
        extract: also keep each partition type as a runnable program; its collective's
            group is then named by role (``"tp"`` or ``"cp"``), to be bound to a real group.
        device: the device the fake tensors claim (the one the programs will run on: the
            attention kernels differ between CPU and CUDA).
        nanobatches: 2 traces the nanobatched graphs kareus plans; 1 the original ones
            (blocks left whole), as Megatron-LM runs them.
    """
    from kareus._torch_internals import inductor_lowering

    if work.graphs == "inductor" and inductor_lowering() is None:
        raise TraceError(
            f"tracing Inductor's graphs needs an Inductor partition step that takes a "
            f"partitioner, which torch {torch.__version__} lacks: trace AOTAutograd's "
            "(--graphs aot), and apply the plan with codegen='python'"
        )
    torch._dynamo.reset()
    mesh = None
    if isinstance(work.model, (HFModel, FactoryModel)) and groups[0] is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (work.tp,))  # a source runs TP only: the whole world
    try:
        compiled = run_stage(work, stage, layers, groups, mesh, device, nanobatches, extract)
    except KareusError:
        raise
    except Exception as err:
        if not isinstance(work.model, (HFModel, FactoryModel)):
            raise  # a preset that fails is kareus's bug: its traceback says where
        raise TraceError(run_failure(work.model, work.tp, err)) from err
    return _stage_trace(compiled, work, stage, groups)


def _stage_trace(compiled: Any, work: Workload, stage: int, groups: tuple[Any, ...]) -> StageTrace:
    """Return what the compiled stage's regions found, its programs' groups named by role."""
    from kareus.compiler.backend import find_backend

    backend = find_backend(compiled)
    assert backend is not None
    notes: list[str] = []
    psets = []
    found: dict[int, dict[str, PartitionProgram]] = {}
    for region in backend.regions:
        notes.extend(region.notes)
        if region.findings.blocks is not None:
            notes += block_notes(region.findings.blocks, work, stage)
        pset = region.findings.partitions
        if pset is not None and "backward" in pset.other:
            psets.append(pset)
            found[id(pset)] = region.findings.programs
    if not psets:
        raise TraceError(
            f"stage {stage} of {work.describe()} traced into no training graph"
            f"{': ' + '; '.join(notes) if notes else ''}"
        )
    if len(psets) > 1:
        # A graph break (Hugging Face GPT-2 breaks before its loss): the graph holding the
        # layers is planned; the others run as compiled, unplanned, and are said to be.
        psets.sort(key=lambda p: (len(p.partitions), len(p.block_other.get("forward", {}))))
        notes.append(
            f"stage {stage} traced into {len(psets)} training graphs (a graph break): the "
            f"plan covers the one holding the layers; the other {len(psets) - 1} (such as "
            "the loss) is not priced"
        )
        psets = psets[-1:]
    programs = found[id(psets[0])]
    notes.extend(f"stage {stage} {kind}: {note}" for kind, note in psets[0].notes.items())
    roles = {
        g.group_name: role
        for g, role in zip(groups, ("tp", "cp", "dp", "ep"), strict=False)
        if g is not None
    }
    for program in programs.values():
        if program.group_name is not None:
            program.group_name = roles.get(program.group_name, program.group_name)
    return StageTrace(psets[0], notes, dict(programs))


_log = logging.getLogger(__name__)


def trace(
    work: Workload,
    *,
    layers: int = TEMPLATE_POSITION + 2,
    progress: Callable[[str], None] | None = None,
    nanobatches: int = 2,
) -> tuple[list[PartitionSet], list[str]]:
    """Partition sets of every pipeline stage of ``work`` (identical stages share one).

    Args:
        work: the configuration.
        layers: layers traced per stage (at least 4 when the stage has more; the rest are
            counted from an ordinary layer, see :func:`extrapolate`).
        progress: called with a short description before each stage is traced.
        nanobatches: 2 for the nanobatched graphs kareus plans, 1 for the original ones.

    Returns:
        One partition set per pipeline stage, and the notes the passes recorded.
    """
    stages, notes, _programs = trace_programs(
        work, layers=layers, progress=progress, extract=False, nanobatches=nanobatches
    )
    return stages, notes


def trace_programs(
    work: Workload,
    *,
    layers: int = TEMPLATE_POSITION + 2,
    progress: Callable[[str], None] | None = None,
    extract: bool = True,
    device: str = "cpu",
    nanobatches: int = 2,
) -> tuple[list[PartitionSet], list[str], list[dict[str, PartitionProgram]]]:
    """:func:`trace`, also keeping each partition type as a runnable program.

    Args:
        work: the configuration.
        layers: layers traced per stage (see :func:`trace`).
        progress: called with a short description before each stage is traced.
        extract: keep the programs (:mod:`kareus.passes.extract_partitions`).
        device: the device the programs will run on (see :func:`trace_stage`).
        nanobatches: as in :func:`trace`.

    Returns:
        As :func:`trace`, and per pipeline stage its programs by type key.
    """
    per_stage = work.stage_layers()
    last = work.stages - 1
    kinds = [0 if s == 0 else last if s == last else 1 for s in range(work.stages)]
    # Layers traced per stage kind: what its smallest stage holds, up to ``layers``.
    traced: dict[int, int] = {}
    for k in set(kinds):
        smallest = min(n for n, j in zip(per_stage, kinds, strict=True) if j == k)
        traced[k] = min(smallest, max(layers, TEMPLATE_POSITION + 2))
    note = progress or (lambda _s: None)
    by_kind: dict[int, StageTrace] = {}
    notes: list[str] = []
    with fake_world(work.tp, work.cp, work.graph_dp, work.ep) as groups:
        for kind in stage_kinds(work.stages):
            layers_of = (
                f"{traced[kind]} of {per_stage[kind]} layers" if per_stage[kind] else "whole"
            )
            note(f"tracing stage {kind} ({layers_of}, fake tensors)")
            _log.info("tracing stage kind %d: %d of %d layers", kind, traced[kind], per_stage[kind])
            found = trace_stage(
                work,
                kind,
                layers=traced[kind],
                groups=groups,
                extract=extract,
                device=device,
                nanobatches=nanobatches,
            )
            _log.info(
                "stage kind %d: %d partitions, %d notes",
                kind,
                len(found.pset.partitions),
                len(found.notes),
            )
            by_kind[kind] = found
            notes.extend(found.notes)
    # Each stage counts its own layers from its kind's trace; equal stages share one set.
    counted: dict[tuple[int, int], PartitionSet] = {}
    stages: list[PartitionSet] = []
    for s, kind in enumerate(kinds):
        if (kind, per_stage[s]) not in counted:
            pset = copy.deepcopy(by_kind[kind].pset)
            extrapolate(pset, traced[kind], per_stage[s])
            counted[(kind, per_stage[s])] = pset
        stages.append(counted[(kind, per_stage[s])])
    return stages, notes, [by_kind[k].programs for k in kinds]


__all__ = [
    "DTYPES",
    "StageTrace",
    "TraceError",
    "Workload",
    "extrapolate",
    "fake_world",
    "stage_kinds",
    "trace",
    "trace_programs",
    "trace_stage",
]


def workload_record(work: Workload) -> dict[str, Any]:
    """Return the workload as plain data for the plan file."""
    data = dataclasses.asdict(work)
    if isinstance(work.model, (HFModel, FactoryModel)):
        data["model"] = work.model.record()
    elif not isinstance(work.model, str):
        data["model"] = dataclasses.asdict(work.model)
    elif ":" in work.model:  # a module's config: its shape, which the name does not pin
        data["config"] = dataclasses.asdict(work.config)
    if work.layers_per_stage is not None:  # as JSON holds it, so records compare equal
        data["layers_per_stage"] = list(work.layers_per_stage)
    data["describe"] = work.describe()
    # the shape a compiled model is checked against (kareus.passes.check_plan), read here so
    # that the passes need no model library to resolve a preset's name
    if work.shape is not None:
        data["shape"] = {"hidden_size": work.shape.hidden_size, "num_layers": work.shape.num_layers}
    # what tracing reads of the data-parallel layout (none unless it is in the graphs)
    if work.graph_dp > 1:
        data["graph_dp"] = {"dp": work.graph_dp, "gpus_per_node": work.gpus_per_node}
    return data

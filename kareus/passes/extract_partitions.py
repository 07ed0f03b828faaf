"""Extract each partition type as a program that runs alone.

For every partition type of a forward or backward graph, one of its partitions (they are
identical) is copied out of the graph: its compute nodes in order, then the issue and wait of
the collective it overlaps. Values the partition reads from the rest of the graph become
inputs, recorded with their shapes, strides and dtypes so that random inputs of the captured
shapes can be made; values the rest of the graph reads become outputs. The copy keeps node
names, so the partition's record (slots, compute, collective) names the program's nodes and
:func:`~kareus.passes.schedule_overlap.rewrite_schedule` reorders it like the whole graph.

The program's cost is read from its own nodes with the functions that cut the partitions
(:func:`~kareus.passes.cut_partitions.partition_costs`); the pass checks it equals the type's,
so what ``kareus profile`` measures is what the emulator costs. It runs only when
``Config.extract_partitions`` is set (``kareus profile`` sets it); the graph does not change.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kareus.costs import PartitionWork
from kareus.partitions import Decision, Partition, PartitionSet
from kareus.passes.annotate_costs import concrete
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.cut_partitions import collective_cost, partition_costs


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one input, to make a random tensor like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self, device: torch.device | str, generator: torch.Generator) -> torch.Tensor:
        """Return a tensor of this layout: normal values for floats, zeros otherwise.

        Zeros keep integer inputs (indices, positions) in range.
        """
        size = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        flat = torch.zeros(max(size, 1), dtype=self.dtype, device=device)
        if self.dtype.is_floating_point:
            flat.copy_(torch.randn(flat.shape, generator=generator).to(self.dtype))
        return flat.as_strided(self.shape, self.stride)


@dataclasses.dataclass
class PartitionProgram:
    """One partition type as a runnable program (see the module docstring).

    Attributes:
        type_key: the :class:`~kareus.partitions.PartitionType` it stands for.
        partition: the copied partition; its node names are the program's.
        work: the program's cost, equal to the type's.
        gm: the program, in captured order (issue and wait after the compute).
        inputs: one spec per placeholder, in order.
        group_name: the process group the collective was traced on, or None.
    """

    type_key: str
    partition: Partition
    work: PartitionWork
    gm: fx.GraphModule
    inputs: tuple[TensorSpec, ...]
    group_name: str | None

    def make_inputs(self, device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
        """Return random inputs of the captured layouts on ``device`` (same seed, same data)."""
        gen = torch.Generator().manual_seed(seed)
        return [spec.make(device, gen) for spec in self.inputs]

    def scheduled(
        self, decision: Decision, group_name: str | None, pool: Any = None
    ) -> fx.GraphModule:
        """Return a copy ordered per ``decision``, its collective on ``group_name``.

        Args:
            decision: launch slot (None: no overlap) and SM share of the collective.
            group_name: the real group to run the collective on; None leaves it out
                (a one-GPU measurement of the compute alone).
            pool: a :class:`~kareus.runtime.comm_pool.CommunicatorPool` that points the
                collective at its SM share's communicator; None keeps ``group_name``.
        """
        from kareus.passes.schedule_overlap import rewrite_schedule
        from kareus.runtime.comm_pool import _group_arg

        graph = copy.deepcopy(self.gm.graph)
        by_name = {n.name: n for n in graph.nodes}
        part = self.partition
        if part.collective is not None:
            issue, wait = (by_name[n] for n in part.collective)
            if group_name is None:
                output = next(n for n in graph.nodes if n.op == "output")
                output.args = (tuple(a for a in output.args[0] if a not in (issue, wait)),)
                graph.erase_node(wait)
                graph.erase_node(issue)
                part = dataclasses.replace(part, collective=None)
            else:
                i = _group_arg(issue)
                if i is not None:
                    issue.args = (*issue.args[:i], group_name, *issue.args[i + 1 :])
        pset = PartitionSet(partitions=[part])
        share = decision.sm_share if part.collective is not None else None
        rewrite_schedule(
            graph,
            part.instruction,
            pset,
            {part.type_key: dataclasses.replace(decision, sm_share=share)},
            pool,
        )
        graph.lint()
        return fx.GraphModule(self.gm, graph, class_name=f"Partition_{part.type_key}")


class ExtractPartitions(GraphPass):
    """Keep one runnable program per partition type (when ``Config.extract_partitions``)."""

    name = "extract_partitions"
    graphs = frozenset({"forward", "backward"})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Record ``{type key: PartitionProgram}`` under this pass's name in the findings."""
        pset: PartitionSet | None = ctx.findings.get("cut_partitions")
        if not ctx.config.extract_partitions or pset is None:
            return PassResult(gm, modified=False)
        programs: dict[str, PartitionProgram] = ctx.findings.setdefault(self.name, {})
        for key, ptype in pset.types.items():
            if ptype.instruction != ctx.graph or key in programs:
                continue
            part = next(p for p in pset.partitions if p.type_key == key)
            program = extract(gm, part, fuse=ctx.config.fuse_memory_ops)
            want = PartitionWork(ptype.compute, ptype.collective)
            if _strip(program.work) != _strip(want):
                raise ValueError(
                    f"the extracted program of {key} costs differently from its type: "
                    "extraction and partition cutting disagree on its nodes"
                )
            programs[key] = program
        return PassResult(gm, modified=False)


def _strip(work: PartitionWork) -> PartitionWork:
    """``work`` without op names (a fused run is named after its first and last node)."""
    ops = tuple(dataclasses.replace(o, name="") for o in work.ops)
    coll = work.collective and dataclasses.replace(work.collective, name="")
    return PartitionWork(ops, coll)


def extract(gm: fx.GraphModule, part: Partition, *, fuse: bool) -> PartitionProgram:
    """Copy one partition of ``gm`` into a program of its own (see the module docstring).

    Raises:
        ValueError: an input of the partition is not a tensor or a size.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[n] for n in part.compute]
    if part.collective is not None:
        nodes += [by_name[n] for n in part.collective]
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    specs: list[TensorSpec] = []

    for node in nodes:  # inputs first: placeholders lead the graph
        for arg in node.all_input_nodes:
            if arg in inside or arg in env:
                continue
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor):
                env[arg] = graph.placeholder(arg.name)
                env[arg].meta["val"] = val
                specs.append(
                    TensorSpec(tuple(concrete(val.shape)), tuple(concrete(val.stride())), val.dtype)
                )
            elif isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat)):
                env[arg] = concrete(val) if isinstance(val, torch.SymInt) else val
            else:
                raise ValueError(
                    f"partition {part.type_key} reads {arg.name}, which is neither a tensor "
                    f"nor a size ({type(val).__name__})"
                )
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    outputs = [env[n] for n in nodes if any(u not in inside for u in n.users) or not n.users]
    graph.output(tuple(outputs))
    program = fx.GraphModule(gm, graph, class_name=f"Partition_{part.type_key}")
    copied = [env[by_name[n]] for n in part.compute]
    ops = partition_costs(copied, fuse)
    issue = env[by_name[part.collective[0]]] if part.collective else None
    work = PartitionWork(ops, collective_cost(issue) if issue is not None else None)
    group = None
    if issue is not None:
        from kareus.runtime.comm_pool import _group_arg

        i = _group_arg(issue)
        group = issue.args[i] if i is not None else None
    for n in graph.nodes:  # the specs hold the layouts; fake values must not outlive tracing
        n.meta.pop("val", None)
    return PartitionProgram(part.type_key, part, work, program, tuple(specs), group)

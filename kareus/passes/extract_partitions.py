"""Extract each partition type, and the work outside partitions, as programs that run alone.

For every partition type of a forward or backward graph, one of its partitions (they are
identical) is copied out of the graph: its compute nodes in order, then the issue and wait of
the collective it overlaps. The work outside partitions is copied too, in the pieces the
partition set counts it in: the compute outside split blocks, each split block's compute
outside its partitions, and each collective that overlaps nothing. Values a program reads
from the rest of the graph become inputs, recorded with their shapes, strides and dtypes so
that random inputs of the captured shapes can be made; values the rest of the graph reads
become outputs. The copy keeps node names, so a partition's record (slots, compute,
collective) names the program's nodes and
:func:`~kareus.passes.schedule_overlap.rewrite_schedule` reorders it like the whole graph.

A program's cost is read from its own nodes with the functions that cut the partitions
(:func:`~kareus.passes.cut_partitions.partition_costs`); the pass checks it equals what the
partition set records, so what ``kareus profile`` measures is what the emulator costs. It
runs only when ``Config.extract_partitions`` is set (``kareus profile`` sets it); the graph
does not change.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kareus.ir.costs import PartitionWork
from kareus.ir.partitions import Decision, Partition, PartitionSet
from kareus.passes.annotate_costs import concrete, cost_of
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.cut_partitions import (
    collective_cost,
    gaps,
    outside_nodes,
    partition_costs,
    step_index,
)
from kareus.passes.programs import PartitionProgram, TensorSpec, class_name
from kareus.passes.schedule_overlap import rewrite_schedule


class ExtractPartitions(GraphPass):
    """Keep runnable programs of the graph's work (when ``Config.extract_partitions``)."""

    name = "extract_partitions"
    graphs = frozenset({"forward", "backward"})
    reads = frozenset({"cut_partitions", "find_blocks"})
    finds = "programs"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Find ``{key: PartitionProgram}`` (those of the graphs before kept)."""
        pset = ctx.findings.partitions
        if not ctx.config.extract_partitions or pset is None:
            return PassResult(gm, modified=False)
        programs: dict[str, PartitionProgram] = dict(ctx.findings.programs)
        kind, fuse = ctx.graph, ctx.config.fuses_memory_ops
        wanted: dict[str, tuple[PartitionProgram, PartitionWork]] = {}
        for key, ptype in pset.types.items():
            if ptype.instruction == kind:
                part = next(p for p in pset.partitions if p.type_key == key)
                nodes = [*part.compute, *(part.collective or ())]
                program = extract(gm, nodes, key, fuse=fuse, partition=part)
                wanted[key] = program, PartitionWork(ptype.compute, ptype.collective)
                if part.collective is not None:  # alone: activation recompute re-runs it
                    alone = extract(gm, list(part.collective), f"{key}/collective", fuse=fuse)
                    wanted[alone.key] = alone, PartitionWork((), ptype.collective)
        blockset = ctx.findings.blocks
        spans = blockset.spans.get(kind, {}) if blockset is not None else {}
        rest, per_block, exposed, _alone = outside_nodes(gm.graph, kind, pset, spans, fuse)
        index = step_index(gm.graph)
        if rest:
            names = [n.name for n in rest]
            program = extract(gm, names, f"{kind}/outside", fuse=fuse, breaks=gaps(index, rest))
            wanted[program.key] = program, PartitionWork(pset.other[kind])
        for block, nodes in per_block.items():
            names = [n.name for n in nodes]
            where = f"{kind}/block/{block}"
            program = extract(gm, names, where, fuse=fuse, breaks=gaps(index, nodes))
            wanted[program.key] = program, PartitionWork(pset.block_other[kind][block])
        for issue in exposed:
            names = [issue.name, *(u.name for u in issue.users)]
            program = extract(gm, names, f"{kind}/exposed/{issue.name}", fuse=fuse)
            wanted[program.key] = program, PartitionWork((), collective_cost(issue))
        for key, (program, want) in wanted.items():
            if unnamed(program.work) != unnamed(want):
                raise ValueError(
                    f"the extracted program of {key} costs differently from what the "
                    "partition set records: extraction and partition cutting disagree"
                )
            programs[key] = program
        return PassResult(gm, modified=False, found=programs)


def scheduled(
    program: PartitionProgram, decision: Decision, group_name: str | None, pool: Any = None
) -> fx.GraphModule:
    """Return a copy of ``program`` ordered per ``decision``, its collective on ``group_name``.

    Args:
        program: a partition type's program (:func:`extract`).
        decision: launch slot (None: no overlap) and SM share of the collective.
        group_name: the real group to run the collective on; None leaves it out
            (a one-GPU measurement of the compute alone).
        pool: a :class:`~kareus.runtime.comm_pool.CommunicatorPool` that points the
            collective at its SM share's communicator; None keeps ``group_name``.
    """
    from kareus.runtime.comm_pool import _group_arg

    graph = copy.deepcopy(program.gm.graph)
    issues = [n for n in graph.nodes if cost_of(n).op_class == "collective_issue"]
    waits = [n for n in graph.nodes if cost_of(n).op_class == "collective_wait"]
    if group_name is None and issues:
        output = next(n for n in graph.nodes if n.op == "output")
        gone = {*issues, *waits}
        output.args = (tuple(a for a in output.args[0] if a not in gone),)
        for node in (*waits, *issues):
            graph.erase_node(node)
    for issue in issues if group_name is not None else ():
        i = _group_arg(issue)
        if i is not None:
            issue.args = (*issue.args[:i], group_name, *issue.args[i + 1 :])
    part = program.partition
    if part is not None:
        if group_name is None:
            part = dataclasses.replace(part, collective=None)
        share = decision.sm_share if part.collective is not None else None
        rewrite_schedule(
            graph,
            part.instruction,
            PartitionSet(partitions=[part]),
            {part.type_key: dataclasses.replace(decision, sm_share=share)},
            pool,
        )
    elif pool is not None and decision.sm_share is not None and group_name is not None:
        pool.regroup([(issue, decision.sm_share) for issue in issues])
    graph.lint()
    return fx.GraphModule(program.gm, graph, class_name=class_name(program.key))


def unnamed(work: PartitionWork) -> PartitionWork:
    """Return ``work`` without op names (a fused run is named after its first and last node)."""
    ops = tuple(dataclasses.replace(o, name="") for o in work.ops)
    coll = work.collective and dataclasses.replace(work.collective, name="")
    return PartitionWork(ops, coll)


def extract(
    gm: fx.GraphModule,
    names: list[str],
    key: str,
    *,
    fuse: bool,
    partition: Partition | None = None,
    breaks: frozenset[str] = frozenset(),
) -> PartitionProgram:
    """Copy nodes of ``gm`` into a program of their own (see the module docstring).

    Args:
        gm: the graph.
        names: the nodes, in order: compute, then any collective's issue and wait.
        key: what the program stands for.
        fuse: cost runs of memory-bound ops as fused kernels (``Config.fuse_memory_ops``).
        partition: the partition the nodes are, if they are one.
        breaks: memory ops that start a kernel of their own (work outside partitions:
            :func:`~kareus.passes.cut_partitions.gaps` in the source graph).

    Raises:
        ValueError: an input of the nodes is not a tensor or a size.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[n] for n in names]
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
                    f"program {key} reads {arg.name}, which is neither a tensor nor a size "
                    f"({type(val).__name__})"
                )
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    outputs = [env[n] for n in nodes if any(u not in inside for u in n.users) or not n.users]
    graph.output(tuple(outputs))
    program = fx.GraphModule(gm, graph, class_name=class_name(key))
    copied = [env[n] for n in nodes]
    compute = [n for n in copied if cost_of(n).op_class not in _COLLECTIVE]
    issues = [n for n in copied if cost_of(n).op_class == "collective_issue"]
    coll = collective_cost(issues[0]) if issues else None
    work = PartitionWork(partition_costs(compute, fuse, breaks), coll)
    group = None
    if issues:
        from kareus.runtime.comm_pool import _group_arg

        i = _group_arg(issues[0])
        group = issues[0].args[i] if i is not None else None
    for n in graph.nodes:  # the specs hold the layouts; fake values must not outlive tracing
        n.meta.pop("val", None)
    return PartitionProgram(key, partition, work, program, tuple(specs), group)


_COLLECTIVE = ("collective_issue", "collective_wait")

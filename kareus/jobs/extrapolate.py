"""From the layers traced to the whole stage: an ordinary layer's work counted again.

The partitions of an interior layer repeat for every other layer of a stage, so a stage
traced with a few layers stands for all of them: :func:`extrapolate` copies the layer at
:data:`TEMPLATE_POSITION` (in execution order) once per layer not traced.
"""

from __future__ import annotations

import dataclasses

from kareus.errors import TraceError
from kareus.ir.partitions import Partition, PartitionSet

TEMPLATE_POSITION = 2
"""Which block, in execution order, stands for the repeated ones: the third. The first
block overlaps nothing before it, and a block's first partition takes in the tail of the
block run before it, so the third is the first whose neighbours are all ordinary."""


def template_block(pset: PartitionSet, kind: str) -> str | None:
    """Return the block that stands for the untraced layers in ``kind``'s graph, if any.

    The block at :data:`TEMPLATE_POSITION` in execution order: of the split blocks, else of
    the blocks left whole.
    """
    split = list(dict.fromkeys(p.block for p in pset.partitions if p.instruction == kind))
    order = split or list(pset.block_other.get(kind, {}))
    return order[TEMPLATE_POSITION] if len(order) > TEMPLATE_POSITION else None


def extrapolate(pset: PartitionSet, traced: int, total: int, family: str = "layers") -> None:
    """Add the work of ``total - traced`` more layers, copying an ordinary layer's.

    Per instruction (forward, backward: the backward runs the layers in reverse), the
    block at :data:`TEMPLATE_POSITION` in execution order is copied: its partitions, its
    compute outside them and the collectives it runs alone; a stage whose blocks were left
    whole copies a whole block's compute and collectives. Needs ``traced >=
    TEMPLATE_POSITION + 2`` so that the template is not the last block either.

    Raises:
        TraceError: too few layers traced to count the rest, or no layer blocks found to
            count them from.
    """
    if total <= traced:
        return
    if traced < TEMPLATE_POSITION + 2:
        raise TraceError(
            f"tracing {traced} layers cannot stand for {total}: trace at least "
            f"{TEMPLATE_POSITION + 2}"
        )
    kinds = sorted({p.instruction for p in pset.partitions} | set(pset.block_other))
    added: list[Partition] = []
    counted = False
    for kind in kinds:
        block = template_block(pset, kind)
        if block is None:
            continue
        counted = True
        template = [p for p in pset.partitions if p.instruction == kind and p.block == block]
        blocks = pset.block_other.get(kind, {})
        alone = pset.block_exposed.get(kind, {})
        for extra in range(traced, total):
            name = f"{family}.{extra}"
            added.extend(dataclasses.replace(p, block=name) for p in template)
            if block in blocks:
                blocks[name] = blocks[block]
            if block in alone:
                alone[name] = alone[block]
                pset.exposed[kind] = pset.exposed.get(kind, ()) + alone[block]
    if not counted:
        raise TraceError(
            f"found no layer blocks among the {traced} layers traced to count the other "
            f"{total - traced} from: trace all {total} (layers={total})"
        )
    pset.partitions.extend(added)

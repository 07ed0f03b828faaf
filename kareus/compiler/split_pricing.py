"""The split only where it pays: pricing a region's split graphs before they are compiled.

With ``Config.nanobatches=None`` and ``split_when="pays"`` (the defaults), a block is split
only where kareus's cost model for the device the model runs on predicts that its forward
and backward get faster. Two steps:

1. Before the split (``split_nanobatches``, on Dynamo's graph): a block none of whose
   collectives could fly beside compute (groups of one rank; gloo on a CPU, whose threads
   share the compute's cores) stays whole at once, with the reason
   (:mod:`kareus.passes.links`).
2. After AOTAutograd partitioned the split graphs, before any kernel is generated
   (:func:`judge`): the forward and backward are cut into partitions and each block priced
   split and whole (:func:`kareus.planner.split_pays.price_split`). If a block does not pay,
   the backend raises :class:`SplitDeclined` with the verdicts and lowers the region again
   with those blocks whole (the verdicts then stand: nothing is priced twice); it keeps
   every verdict in the region's record (``Region.split_prices``), which ``explain``
   shows.

The cost model is the hardware model of the GPU named by ``Config.gpu``, else of the CUDA
device the region runs on (its type, if kareus knows it), else a CPU host's
(:class:`kareus.hardware.host.HostModel`); a collective on a group that declares its
durations (an emulated link) takes them. The same inputs give the same verdicts: nothing
here measures anything.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch.fx as fx

from kareus.compiler.config import Config
from kareus.compiler.lowering import copy_module
from kareus.ir.costs import CollectiveCost
from kareus.ir.partitions import PartitionSet
from kareus.passes.annotate_costs import AnnotateCosts
from kareus.passes.base import PassContext, RegionInputs, run_passes
from kareus.passes.blocks import BlockSet
from kareus.passes.cut_partitions import CutPartitions
from kareus.passes.find_blocks import FindBlocks
from kareus.passes.findings import Findings
from kareus.passes.links import HOST, declared_time


class SplitDeclined(Exception):
    """Raised at the partition step when a split block does not pay; carries the verdicts.

    ``verdicts``: per priced block, (split, what was predicted), for
    :attr:`~kareus.passes.base.RegionInputs.priced`.
    """

    def __init__(self, verdicts: Mapping[str, tuple[bool, str]]) -> None:
        whole = sorted(b for b, (split, _text) in verdicts.items() if not split)
        super().__init__(f"the split does not pay for {', '.join(whole)}")
        self.verdicts = dict(verdicts)


def pricing_device(config: Config, device: str) -> str | None:
    """Return what prices the split: a GPU type, :data:`HOST`, or None (not priced).

    None where the split is not priced: ``nanobatches`` set, or ``split_when`` other than
    ``"pays"``.
    """
    if config.nanobatches is not None or config.split_when != "pays":
        return None
    if config.gpu is not None:
        return config.gpu
    if device == "cuda":
        from kareus.compiler.apply_plan import this_gpu

        found = this_gpu()
        if found is not None:
            return found
    return HOST


def judge(
    inputs: RegionInputs,
    config: Config,
    findings: Findings,
    graphs: Mapping[str, fx.GraphModule],
) -> dict[str, tuple[bool, str]]:
    """Price the split blocks of a region's partitioned graphs.

    Args:
        inputs: the region's compiler inputs (what prices it: :attr:`RegionInputs.pricing`).
        config: the compile call's settings.
        findings: the region's findings so far (its blocks, from the Dynamo graph).
        graphs: the ``forward`` and ``backward`` graphs as AOTAutograd partitioned them;
            they are not changed (the analysis runs on copies).

    Returns:
        Per priced block: whether its split pays, and what was predicted (empty where
        nothing is priced: the split forced or a plan's, no block split, or verdicts of an
        earlier lowering standing).
    """
    blockset = findings.blocks
    if inputs.pricing is None or inputs.priced is not None or not blockset or not blockset.split:
        return {}
    pset = _partitions(config, inputs, blockset, graphs)
    return {block: (v.pays, v.describe()) for block, v in price(pset, inputs.pricing).items()}


def _partitions(
    config: Config,
    inputs: RegionInputs,
    blockset: BlockSet,
    graphs: Mapping[str, fx.GraphModule],
) -> PartitionSet:
    """Cut copies of the graphs into partitions, as the analysis passes do."""
    scratch = copy.copy(blockset)
    scratch.spans = dict(blockset.spans)
    scratch._by_seq_nr = dict(blockset._by_seq_nr)
    findings = Findings(blocks=scratch)
    passes = (FindBlocks(), AnnotateCosts(), CutPartitions())
    for kind in ("forward", "backward"):
        g = graphs[kind]
        example = [n.meta.get("val") for n in g.graph.find_nodes(op="placeholder")]
        ctx = PassContext(config, kind, findings, example, inputs=inputs)
        run_passes(copy_module(g), passes, ctx)
    assert findings.partitions is not None  # cut_partitions ran on both graphs
    return findings.partitions


def price(pset: PartitionSet, on: str) -> dict[str, Any]:
    """Price each split block of ``pset`` on ``on`` (a GPU type or :data:`HOST`)."""
    from kareus.planner.settings import PlannerSettings
    from kareus.planner.split_pays import DeclaredCollectives, price_split

    settings = PlannerSettings()
    if on == HOST:
        from kareus.hardware.host import HostModel

        host = HostModel()
        inner: Any = host
        freq, label = 0.0, host.spec.name
    else:
        from kareus.hardware import Emulator, gpu

        spec = gpu(on)
        inner, freq = Emulator(spec), float(spec.clock_max_mhz)
        label = f"{spec.name} (hardware model, top clock)"

    def declared(coll: CollectiveCost) -> float | None:
        return declared_time(coll.group, coll.kind, coll.bytes)

    return price_split(
        pset,
        DeclaredCollectives(inner, declared),
        freq_mhz=freq,
        sm_share=settings.default_sm_share,
        device=label,
    )


def after_declined(inputs: RegionInputs, declined: SplitDeclined) -> RegionInputs:
    """Return the region's inputs for its second lowering, with the verdicts to keep."""
    return dataclasses.replace(inputs, priced=declined.verdicts)

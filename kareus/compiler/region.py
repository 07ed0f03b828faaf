"""What kareus captured and did for one compiled region (one Dynamo graph).

A region is created when Dynamo hands kareus a graph; it collects the graphs as captured and
as rewritten, the pass history, the passes' findings and the reasons something was left
unchanged. :func:`kareus.explain` reads regions; nothing in the training step does.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch.fx as fx

from kareus.passes.base import PassRecord, RegionInputs
from kareus.passes.findings import Findings


@dataclasses.dataclass
class GraphRecord:
    """One graph of a region, as captured and as it runs.

    ``captured`` is the captured code, or the captured graph module, whose code is then
    generated when first read (:attr:`captured_code`): only ``kareus.explain`` reads it.
    """

    kind: str
    captured: str | fx.GraphModule
    final_code: str = ""
    num_inputs: int = 0
    final: fx.GraphModule | None = None
    """The rewritten graph (what Inductor compiles, or what runs with codegen='python')."""

    @property
    def captured_code(self) -> str:
        """The graph's code as captured."""
        if not isinstance(self.captured, str):
            self.captured = self.captured.code
        return self.captured


@dataclasses.dataclass
class Region:
    """Everything kareus knows about one compiled region.

    Attributes:
        index: position among the backend's regions, in capture order.
        compile_id: Dynamo's id of the compilation ("frame/recompile"), for cross-reference
            with ``TORCH_LOGS``.
        graphs: the region's graphs by kind ("dynamo", "forward", "backward", "inference").
        history: the pass records of all graphs, in the order the passes ran.
        findings: what the passes found (blocks, partitions...), typed.
        inputs: what the compiler supplies the passes (plan, decisions, clock runtime).
        notes: why something was left unchanged (a failed pass, a skipped block...).
        device: the device type its tensors are on ("cuda", "cpu"...; "" without tensors).
        parameter_refs: weak references to the parameters among the graph's inputs (the
            model's own tensors, which Dynamo passes in): whose graph this is, where one
            backend compiles several models (``backend="kareus"``); see :attr:`parameters`.
    """

    index: int
    compile_id: str
    device: str = ""
    graphs: dict[str, GraphRecord] = dataclasses.field(default_factory=dict)
    history: list[PassRecord] = dataclasses.field(default_factory=list)
    findings: Findings = dataclasses.field(default_factory=Findings)
    notes: list[str] = dataclasses.field(default_factory=list)
    parameter_refs: tuple[weakref.ref[Any], ...] = ()
    inputs: RegionInputs = dataclasses.field(default_factory=RegionInputs)
    codegen: str = ""
    """Which codegen ran the rewritten graphs (``inductor`` or ``python``; "": not lowered)."""
    graph_break: str = ""
    """Where and why Dynamo ended this graph at a graph break ("": it did not, or unknown)."""
    split_prices: dict[str, tuple[bool, str]] = dataclasses.field(default_factory=dict)
    """Per block whose split was priced: whether it pays, and what was predicted
    (:mod:`kareus.compiler.split_pricing`)."""
    early_forward_runs: int = 0
    """Forwards run before a compile-time plan existed (the runtime counts them as its
    first instruction's)."""

    @property
    def parameters(self) -> frozenset[int]:
        """The ids of this region's parameters that are still alive.

        A freed parameter's id may be a new object's (the shared backend outlives the
        models it compiled): an id is only its parameter's while that parameter lives.
        """
        return frozenset(id(p) for p in (r() for r in self.parameter_refs) if p is not None)

    def warn(self, note: str) -> None:
        """Record ``note`` (``explain`` shows it) and warn with it."""
        self.notes.append(note)
        warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=3)

    def undo_split(self, reason: str) -> None:
        """Record that the region's blocks run whole after all (the split was not kept)."""
        blockset = self.findings.blocks
        if blockset is not None:
            for name in blockset.split:
                blockset.skipped[name] = f"split undone: {reason}"
            blockset.split.clear()

"""Insert a clock switch at the start of each forward and backward graph.

The switch node (``kareus_set_clock_fwd`` / ``kareus_set_clock_bwd``) calls the registered
operator ``kareus::switch_clock`` with the runtime, the pipeline stage, the direction and the
region; the runtime works out which instruction starts and sets its clock. The operator has
side effects, so dead-code elimination and Inductor keep it. Without a plan (no runtime) the
pass changes nothing.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.node import has_side_effect

from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.runtime.switcher import SWITCH_OP, ClockRuntime

has_side_effect(SWITCH_OP)  # no dead-code elimination (fx, AOTAutograd, Inductor) drops it

_SHORT = {"forward": "fwd", "backward": "bwd"}


class InsertClockSwitches(GraphPass):
    """One switch node after the placeholders of each forward and backward graph."""

    name = "insert_clock_switches"
    graphs = frozenset({"forward", "backward"})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Insert the switch when the region has a clock runtime."""
        runtime: ClockRuntime | None = ctx.findings.get("clock_runtime")
        if runtime is None:
            return PassResult(gm, modified=False)
        args = (
            runtime.id,
            int(ctx.findings.get("clock_stage", 0)),
            ctx.graph,
            int(ctx.findings.get("region_index", 0)),
        )
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        if anchor is None:
            with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                node = gm.graph.call_function(SWITCH_OP, args)
        else:
            with gm.graph.inserting_after(anchor):
                node = gm.graph.call_function(SWITCH_OP, args)
        node._rename(f"kareus_set_clock_{_SHORT[ctx.graph]}")
        return PassResult(gm, modified=True)

    def ensures(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Check that the switch survived and runs before any compute."""
        if ctx.findings.get("clock_runtime") is None:
            return
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        if first.target is not SWITCH_OP:
            raise ValueError("the clock switch is not the first node after the inputs")

"""Insert clock switches: where each forward and backward graph starts and a backward ends.

The switch node (``kareus_set_clock_fwd`` / ``kareus_set_clock_bwd``) calls the registered
operator ``kareus::switch_clock`` with the runtime, the pipeline stage, the direction and the
region; the runtime works out which instruction starts and sets its clock. The one where a
backward graph ends (``kareus_set_clock_step``, direction ``step``) starts the plan's step
(data-parallel communication and the optimizer) once the GPU's last backward of the
iteration ends; the runtime ignores it otherwise. The operator has side effects, so
dead-code elimination and Inductor keep it. Without a plan (no runtime) the pass changes
nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.runtime.switcher import SWITCH_AFTER_OP, SWITCH_OP, ClockRuntime

# no dead-code elimination (fx, AOTAutograd, Inductor) drops them
has_side_effect(SWITCH_OP)
has_side_effect(SWITCH_AFTER_OP)

_SHORT = {"forward": "fwd", "backward": "bwd"}


class InsertClockSwitches(GraphPass):
    """A switch after each graph's placeholders, and one before a backward's output."""

    name = "insert_clock_switches"
    graphs = frozenset({"forward", "backward"})
    after = frozenset({"schedule_overlap"})  # switches frame the graph as reordered

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Insert the switch when the region has a clock runtime."""
        runtime: ClockRuntime | None = ctx.inputs.clock_runtime
        if runtime is None:
            return PassResult(gm, modified=False)
        args = (
            runtime.id,
            ctx.inputs.clock_stage,
            ctx.graph,
            ctx.inputs.index,
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
        outputs = _outputs(gm)
        if ctx.graph == "backward" and outputs:
            with gm.graph.inserting_before(_output(gm)):
                end = gm.graph.call_function(SWITCH_AFTER_OP, (args[0], args[1], args[3], outputs))
            end._rename("kareus_set_clock_step")
        return PassResult(gm, modified=True)

    def ensures(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Check that the switch survived and runs before any compute."""
        if ctx.inputs.clock_runtime is None:
            return
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        if first.target is not SWITCH_OP:
            raise ValueError("the clock switch is not the first node after the inputs")
        ends = [n for n in gm.graph.nodes if n.target is SWITCH_AFTER_OP]
        outputs = _outputs(gm)
        if ctx.graph == "backward" and outputs and len(ends) != 1:
            raise ValueError(f"a backward graph has {len(ends)} step switches, not one")
        if ends and set(ends[0].args[3]) != set(outputs):
            raise ValueError("the step's clock switch does not take every output of the graph")


def _output(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """Return the graph's output tensors (the step switch runs after all that computes them)."""
    found: list[fx.Node] = []
    fx.node.map_arg(_output(gm).args, found.append)
    return [n for n in dict.fromkeys(found) if isinstance(n.meta.get("val"), torch.Tensor)]

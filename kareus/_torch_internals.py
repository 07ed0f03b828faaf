"""The private PyTorch internals kareus reads, in one place, each with a safe fallback.

kareus reads a few things PyTorch does not promise to keep. Each is read here, behind a
function that returns None (or the conservative answer) where the installed PyTorch keeps
it elsewhere, so that a PyTorch upgrade costs kareus an optimisation, never a wrong result:
:func:`self_test` says which of them this PyTorch still provides.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch


@dataclasses.dataclass(frozen=True)
class TracedFrame:
    """What Dynamo is compiling: the frame's code and whether a graph break ended it.

    Attributes:
        qualname: the qualified name of the frame's code (``Layer.forward``), or None.
        graph_break: True when the graph ends at a graph break (the frame goes on in a
            resume function), False when it ends at the frame's return, None when unknown.
    """

    qualname: str | None
    graph_break: bool | None
    piece: bool = False

    @property
    def whole_call(self) -> bool:
        """Whether the graph is known to hold a whole call of the frame's code."""
        return self.qualname is not None and self.graph_break is False and not self.piece


def traced_frame() -> TracedFrame:
    """Return the frame Dynamo is compiling now (call it from a ``torch.compile`` backend).

    Read from Dynamo's tracing context (its first traced code is the frame's own) and the
    current instruction translator's compile reason.
    """
    context = torch._guards.TracingContext.try_get()
    codes = getattr(context, "traced_code", None) or ()
    qualname = getattr(codes[0], "co_qualname", None) if codes else None
    graph_break = None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        reason = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None)
        graph_break = getattr(reason, "graph_break", None)
    except (ImportError, AttributeError, AssertionError, IndexError):
        graph_break = None
    return TracedFrame(
        qualname, graph_break if isinstance(graph_break, bool) else None, ddp_piece()
    )


def ddp_piece() -> bool:
    """Whether the graph being compiled is one piece of a graph Dynamo's DDPOptimizer split.

    Under DDP (with ``torch._dynamo.config.optimize_ddp``) Dynamo cuts a frame's graph at the
    gradient buckets and compiles each piece on its own, from ``SubmodCompiler.compile_submod``
    (a graph of one bucket is compiled whole). Where this PyTorch has no such method, any
    graph compiled under DDP counts as a piece: a piece is never taken for a whole call.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not torch._dynamo.config.optimize_ddp:
        return False
    if DistributedDataParallel._get_active_ddp_module() is None:
        return False
    code = _submod_compiler_code()
    if code is None:
        return True
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def self_test() -> dict[str, bool]:
    """Compile two tiny modules and say which internals this PyTorch still provides."""
    import torch._dynamo

    seen: list[TracedFrame] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        seen.append(traced_frame())
        return gm.forward

    class _Whole(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class _Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    x = torch.ones(2)
    for module in (_Whole(), _Broken()):
        torch.compile(module, backend=backend)(x)
    whole = seen[0] if seen else TracedFrame(None, None)
    broken = seen[1] if len(seen) > 1 else TracedFrame(None, None)
    return {
        "traced frame name": whole.qualname is not None
        and whole.qualname.endswith("_Whole.forward"),
        "graph break told": whole.graph_break is False and broken.graph_break is True,
        "DDP's graph pieces told": _submod_compiler_code() is not None,
    }


def _submod_compiler_code() -> types.CodeType | None:
    """Return the code DDPOptimizer compiles each graph piece from (None in this PyTorch)."""
    from torch._dynamo.backends import distributed

    method = getattr(getattr(distributed, "SubmodCompiler", None), "compile_submod", None)
    return getattr(method, "__code__", None)

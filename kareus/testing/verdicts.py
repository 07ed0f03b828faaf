"""Whether a function acts per sample: kareus's verdict beside the numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class PerSampleVerdict:
    """kareus's verdict on a function over a batch, and whether the numbers bear it out.

    Attributes:
        claimed: kareus would split it (every op of its graph acts per sample).
        reason: why not, when not claimed (the first op's reason), or why nothing was checked.
        holds: the halves' outputs, joined, equal the whole batch's (None: not checked).
    """

    claimed: bool
    reason: str
    holds: bool | None

    @property
    def unsound(self) -> bool:
        """Kareus would split it, and splitting changes the result."""
        return self.claimed and self.holds is False


def per_sample_verdict(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PerSampleVerdict:
    """Ask kareus whether ``fn(*args, **kwargs)`` acts per sample along dimension 0; check it.

    The first tensor among ``args`` carries the batch; the other arguments are the same for
    every sample (as weights are). ``fn`` is captured by Dynamo with that dimension
    symbolic, and every op of the graph is put to
    :func:`kareus.passes.per_sample.why_not_per_sample`. Where kareus says
    yes, the function is run on the two halves and on the whole, and the outputs compared:
    a claim the numbers refute is unsound.
    """
    from kareus.passes.op_effects import draws_random
    from kareus.passes.per_sample import why_not_per_sample

    first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if first is None or args[first].dim() == 0 or args[first].shape[0] < 4:
        return PerSampleVerdict(False, "no batch of 4 or more in the first tensor", None)
    size = args[first].shape[0]
    batched = [i == first for i in range(len(args))]  # the others are the same for all
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def call(*batch: Any) -> Any:
        it = iter(batch)
        return fn(*(next(it) if b else a for a, b in zip(args, batched, strict=True)), **kwargs)

    inputs = [a.clone() for a, b in zip(args, batched, strict=True) if b]
    for t in inputs:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.reset()
    try:
        torch.compile(call, backend=capture, fullgraph=True)(*inputs)
    except Exception as err:  # a function Dynamo cannot capture whole: nothing to judge
        return PerSampleVerdict(False, f"not captured: {type(err).__name__}", None)
    finally:
        torch._dynamo.reset()
    if not graphs:
        return PerSampleVerdict(False, "no graph captured", None)
    gm = graphs[0]
    dims0 = [
        v.shape[0]
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(v := n.meta.get("example_value"), torch.Tensor)
        and v.dim() == inputs[0].dim()
        and isinstance(v.shape[0], torch.SymInt)
    ]
    if not dims0:
        return PerSampleVerdict(False, "the batch size was specialised", None)
    dim0 = dims0[0]
    sym = dim0.node.expr
    if not dim0.node.shape_env.replace(sym).free_symbols:
        return PerSampleVerdict(False, "the batch size was specialised while tracing", None)
    for node in gm.graph.nodes:
        if reason := why_not_per_sample(node, sym):
            return PerSampleVerdict(False, reason, None)
    if any(draws_random(n) for n in gm.graph.nodes):
        return PerSampleVerdict(True, "random: not compared", None)
    if any(_read_uninitialised(n) for n in gm.graph.nodes):
        return PerSampleVerdict(True, "uninitialised memory: not compared", None)
    return _compare_halves(gm, sym, call, inputs, size)


def _read_uninitialised(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes uninitialised memory that is read before a copy fills it.

    (A buffer a collective's result is copied into, ``dist.all_gather_into_tensor(out, x)``,
    is read only after its whole is written.)
    """
    if node.op == "placeholder" or "empty" not in str(node.target):
        return False
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    value = node.meta.get("example_value")
    fills = [
        u
        for u in node.users
        if str(u.target).startswith("copy_")
        and u.args[0] is node
        and isinstance(src := u.args[1], torch.fx.Node)
        and getattr(src.meta.get("example_value"), "shape", None) == getattr(value, "shape", ())
    ]
    if not fills:
        return True
    first = min(order[f] for f in fills)
    return any(order[u] < first for u in node.users)


def _compare_halves(
    gm: torch.fx.GraphModule, sym: Any, call: Callable[..., Any], inputs: list[Any], size: int
) -> PerSampleVerdict:
    """Run ``call`` on the halves of the batch and on the whole; compare the outputs."""
    from kareus.passes.batch_dims import batch_dim_of

    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    dims = [
        batch_dim_of(o.meta.get("example_value"), sym) if isinstance(o, torch.fx.Node) else None
        for o in torch.utils._pytree.tree_leaves(outputs)
    ]
    half = size // 2
    whole = torch.utils._pytree.tree_leaves(call(*inputs))
    try:
        first_half = torch.utils._pytree.tree_leaves(call(*(t[:half] for t in inputs)))
        second_half = torch.utils._pytree.tree_leaves(call(*(t[half:] for t in inputs)))
    except Exception as err:  # the function itself refuses a smaller batch
        return PerSampleVerdict(True, f"halves not run: {type(err).__name__}", None)
    for w, a, b, d in zip(whole, first_half, second_half, dims, strict=False):
        if not isinstance(w, torch.Tensor) or not isinstance(d, int):
            continue
        if a.shape[:d] + a.shape[d + 1 :] != b.shape[:d] + b.shape[d + 1 :]:
            return PerSampleVerdict(True, "the halves' outputs differ in shape", False)
        joined = torch.cat([a, b], dim=d)
        if joined.shape != w.shape or not torch.allclose(
            joined.double(), w.double(), rtol=1e-4, atol=1e-5, equal_nan=True
        ):
            return PerSampleVerdict(True, "", False)
    return PerSampleVerdict(True, "", True)

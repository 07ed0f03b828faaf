"""Where the batch sits in a value, and the ops that stack the ranks' batches.

The batch dimension of a value is the one whose size mentions the batch symbol (Dynamo's
``example_value``). Functional all-gathers and reduce-scatters put one block per rank along
dimension 0; with the batch there, they are per sample only where the blocks are taken
apart (or were put together) by rank right beside them: :func:`rank_blocks_reason`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from kareus.passes.op_effects import arg_value, op_name


def batch_dim_of(value: Any, sym: Any) -> int | str | None:
    """Return the batch dimension of ``value``: its index, None (no batch), or "mixed".

    "mixed" means the batch symbol appears in several dimensions, or in one whose size is
    not a multiple of the batch (the batch was merged into a dimension that mixes samples).
    """
    if not isinstance(value, torch.Tensor):
        return None
    dims = [
        i
        for i, s in enumerate(value.shape)
        if isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols
    ]
    if not dims:
        return None
    if len(dims) > 1:
        return "mixed"
    expr = value.shape[dims[0]].node.expr  # type: ignore[attr-defined]
    if not (expr / sym).free_symbols.isdisjoint({sym}):
        return "mixed"  # e.g. s*s or s + 1: not whole samples per row
    return dims[0]


def rows_per_sample(size: Any, sym: Any) -> int | None:
    """Return a batch dimension's size over the batch (rows per sample), if a whole number."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    ratio = expr / sym
    return int(ratio) if getattr(ratio, "is_Integer", False) and int(ratio) > 0 else None


def rank_blocks_reason(
    node: fx.Node, name: str, carrying: list[tuple[fx.Node, Any]], sym: Any, label: str
) -> str | None:
    """Judge the ops that stack the ranks' batches along dimension 0 and take them apart.

    A functional all-gather concatenates the ranks' tensors along dimension 0, and a
    reduce-scatter's input holds one block per rank there. With the batch at dimension 0,
    such a dimension holds rank blocks, each a whole batch: a nanobatch's gather is not a
    slice of the batch's. It is per sample all the same where the blocks are taken apart
    again before anything else reads them, as a gather along another dimension does
    (``funcol.all_gather_tensor(x, gather_dim=1)``: gather, ``chunk`` per rank, ``cat``
    along the sequence), and where the blocks were put together just before the
    reduce-scatter (``funcol.reduce_scatter_tensor(x, scatter_dim=1)``: ``chunk`` along the
    sequence, ``cat`` per rank, reduce-scatter). Returns "" for those, a reason for a
    gather or a scatter whose blocks escape or mix, and None for other ops (the other rules
    judge them).
    """
    dims = [d for _i, d in carrying]
    if name == "all_gather_into_tensor" and dims == [0]:
        ranks = arg_value(node, 1, "group_size")
        if _taken_apart(node, ranks, sym):
            return ""
        return (
            f"{label} gathers the ranks' batches along the batch dimension, and they are "
            "not taken apart by rank (a chunk per rank) before use"
        )
    if name in ("chunk", "split", "tensor_split") and dims == [0] and _along_0(node):
        source = _through_waits(carrying[0][0])
        if _op_is(source, "all_gather_into_tensor") and _taken_apart(source, None, sym):
            return ""
        return None
    if name in ("cat", "concat", "concatenate") and 0 in dims and _along_0(node):
        if _stacked_for_scatter(node, sym):
            return ""
        return None
    if name == "reduce_scatter_tensor" and dims == [0]:
        if _stacked_for_scatter(carrying[0][0], sym):  # (as many blocks as its ranks)
            return ""
        return (
            f"{label} scatters along the batch dimension an input that is not one block "
            "per rank of whole batches (a cat of a chunk per rank)"
        )
    return None


def _op_is(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op != "placeholder" and op_name(node) == name


def _through_waits(node: fx.Node) -> fx.Node:
    """Return the node whose value ``node`` is, through ``wait_tensor`` calls."""
    while _op_is(node, "wait_tensor") and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _along_0(node: fx.Node) -> bool:
    index = 1 if op_name(node) in ("cat", "concat", "concatenate") else 2
    dim = arg_value(node, index, "dim", 0)
    first = node.args[0] if node.args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    value = first.meta.get("example_value") if isinstance(first, fx.Node) else None
    ndim = value.dim() if isinstance(value, torch.Tensor) else 1
    return isinstance(dim, int) and dim % max(ndim, 1) == 0


def _rank_parts(node: fx.Node, sym: Any) -> int | None:
    """Return how many equal parts along dimension 0 a chunk/split node makes, or None.

    Each part must be a whole-batch block (the same rows per sample).
    """
    parts = node.meta.get("example_value")
    if not isinstance(parts, (list, tuple)) or not parts:
        return None
    rows = {
        rows_per_sample(p.shape[0], sym) if isinstance(p, torch.Tensor) and p.dim() else None
        for p in parts
    }
    if len(rows) != 1 or None in rows:
        return None
    return len(parts)


def _taken_apart(gather: fx.Node, ranks: Any, sym: Any) -> bool:
    """Whether every use of ``gather`` (through waits) splits it into one block per rank."""
    ranks = arg_value(gather, 1, "group_size") if ranks is None else ranks
    pending = list(gather.users)
    while pending:
        user = pending.pop()
        if _op_is(user, "wait_tensor"):
            pending.extend(user.users)
            continue
        name = op_name(user)
        if name not in ("chunk", "split", "tensor_split") or not _along_0(user):
            return False
        if not isinstance(ranks, int) or _rank_parts(user, sym) != ranks:
            return False
    return True


def _stacked_for_scatter(node: Any, sym: Any) -> bool:
    """Return whether ``node`` stacks whole-batch blocks for reduce-scatters.

    That is: a cat along dimension 0 of equal blocks with the batch at dimension 0 of each,
    used only by reduce-scatters of as many ranks as blocks.
    """
    if not isinstance(node, fx.Node) or op_name(node) not in ("cat", "concat", "concatenate"):
        return False
    if not _along_0(node):
        return False
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return False
    rows = set()
    for t in tensors:
        value = t.meta.get("example_value") if isinstance(t, fx.Node) else None
        if batch_dim_of(value, sym) != 0:
            return False
        rows.add(rows_per_sample(value.shape[0], sym))  # type: ignore[union-attr]
    if len(rows) != 1 or None in rows or not node.users:
        return False
    return all(
        _op_is(u, "reduce_scatter_tensor") and arg_value(u, 2, "group_size") == len(tensors)
        for u in node.users
    )

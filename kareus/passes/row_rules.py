"""Ops that read a batch-carrying tensor's rows by index, repeat them, or multiply them.

Rules of the per-sample judgement (:mod:`kareus.passes.per_sample`) for ops whose inputs do
not all carry the batch where their output does, but whose every output row is still one
sample's: a lookup of a shared table by each sample's own indices, a ``gather`` of such a
table, rows repeated in place a fixed number of times, and rows times a batch-free weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.op_effects import arg_value


def keeps_rows(node: fx.Node, name: str, carrying: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Whether ``node`` computes each output row from one sample's rows (the rules below)."""
    return (
        _gathers_rows(node, name, carrying)
        or _repeats_rows(node, name, carrying)
        or _rows_times_weight(node, name, carrying)
    )


def looks_up(node: fx.Node, carrying: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Whether ``table[index]`` looks up rows of a table that carries no batch.

    Each sample's own indices pick rows of a table every sample shares (a rotary cache
    indexed by positions, as torchtitan does at a batch of one): the sample's output
    depends on its indices alone, as an embedding's does.
    """
    index = node.args[1]
    index = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    return (
        isinstance(index, fx.Node)
        and len(carrying) == 1
        and carrying[0][0] is index
        and isinstance(node.args[0], fx.Node)
    )


def _gathers_rows(node: fx.Node, name: str, carrying: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Whether a ``gather`` reads a source that carries no batch by batch-carrying indices.

    ``torch.gather(table, dim, index)`` with only ``index`` carrying the batch: each
    output element is the table's element at its own index (a lookup, as
    :func:`_looks_up`).
    """
    if name not in ("gather", "take_along_dim"):
        return False
    source = node.args[0] if node.args else node.kwargs.get("input")
    index = arg_value(node, 2, "index") if name == "gather" else arg_value(node, 1, "indices")
    return (
        isinstance(index, fx.Node) and source is not index and [i for i, _d in carrying] == [index]
    )


def _repeats_rows(node: fx.Node, name: str, carrying: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Whether ``repeat_interleave`` repeats each row of the batch dimension a fixed count.

    ``x.repeat_interleave(k, dim=d)`` with ``d`` the batch dimension and ``k`` a number puts
    ``k`` copies of each row beside it: a sample's rows stay together, ``k`` times as many
    (each token once per expert it picks, as Hugging Face's batched experts copy them). A
    tensor of counts (each row its own count) is not such a repeat.
    """
    if name != "repeat_interleave" or len(carrying) != 1:
        return False
    source, dim = carrying[0]
    repeats, along = arg_value(node, 1, "repeats"), arg_value(node, 2, "dim")
    ndim = source.meta["example_value"].dim()
    if isinstance(repeats, fx.Node):
        repeats = repeats.meta.get("example_value")
    fixed = isinstance(repeats, (int, torch.SymInt)) and not isinstance(repeats, bool)
    return (
        source is (node.args[0] if node.args else node.kwargs.get("input"))
        and fixed
        and isinstance(along, int)
        and along % ndim == dim
    )


def _rows_times_weight(node: fx.Node, name: str, carrying: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Whether ``x @ w`` multiplies rows of ``x`` by a ``w`` that carries no batch.

    With the batch not in ``x``'s last dimension, each output row is its own row's
    (``x[n, h] @ w[h, i]``, an expert's weight indexed out of a stack), as ``linear``'s is.
    """
    if name not in ("matmul", "mm") or len(carrying) != 1:
        return False
    source, dim = carrying[0]
    ndim = source.meta["example_value"].dim()
    return bool(node.args) and source is node.args[0] and 0 <= dim < ndim - 1

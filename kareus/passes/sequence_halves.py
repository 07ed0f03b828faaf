"""The split along the sequence: its one op that is not per position, causal attention.

A block whose batch is too small to halve is split into the two halves of every sequence
(:mod:`kareus.passes.split_nanobatches`). Every op must then compute each position from
that position alone (:mod:`kareus.passes.per_sample`, positions for samples) except
``scaled_dot_product_attention(q, k, v, is_causal=True)``: :func:`causal_attention_reason`
proves it can be split, and :func:`attend_to_earlier` gives the later half's copy the
earlier half's keys and values under a causal mask moved right by the earlier half's
length.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.batch_dims import batch_dim_of
from kareus.passes.op_effects import arg_value

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
"""``scaled_dot_product_attention``'s positional parameters, in order (``scale`` and
``enable_gqa`` are keyword-only)."""


def sdpa_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Return the argument ``name`` of a ``scaled_dot_product_attention`` node."""
    return arg_value(node, SDPA_ARGS.index(name), name, default)


def causal_attention_reason(node: fx.Node, sym: Any, label: str) -> str:
    """Say why an attention cannot be split along the sequence ``sym`` ("" if it can).

    ``scaled_dot_product_attention(q, k, v, is_causal=True)`` with the sequence at
    dimension -2 of all three (SDPA's own layout: this is what proves that the dimension
    is the sequence, in the order causality reads it) computes each query from the keys
    and values at or before it: the first half's queries need the first half's keys
    only, the second half's the whole sequence's, which the split gives them (the first
    half's keys and values before its own, and a causal mask offset by the first half's
    length). A mask, dropout or non-causal attention keeps the block whole.
    """
    for arg in ("query", "key", "value"):
        value = sdpa_arg(node, arg)
        value = value.meta.get("example_value") if isinstance(value, fx.Node) else None
        if not isinstance(value, torch.Tensor) or batch_dim_of(value, sym) != value.dim() - 2:
            return (
                f"{label} does not hold the sequence at dimension -2 of its {arg}: "
                "scaled_dot_product_attention's layout, which proves the dimension is the "
                "sequence, is not there"
            )
        if _expr(value.shape[-2]) != sym:
            return (
                f"{label} attends over {value.shape[-2]} positions, not the sequence split "
                "in two: several ranks' or copies' halves interleaved (a sequence-parallel "
                "gather), whose order causality reads is not the halves'"
            )
    if sdpa_arg(node, "attn_mask") is not None:
        return (
            f"{label} takes an attention mask, which the sequence split does not cut: only "
            "attention with is_causal=True and no mask is split along the sequence"
        )
    if sdpa_arg(node, "dropout_p", 0.0) != 0.0:
        return f"{label} drops attention weights at random: not split along the sequence"
    if sdpa_arg(node, "is_causal", False) is not True:
        return (
            f"{label} is not causal: each position reads the whole sequence, so neither "
            "half can run without the other's keys and values"
        )
    return ""


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def attend_to_earlier(
    graph: fx.Graph,
    new: fx.Node,
    node: fx.Node,
    copies: list[dict[fx.Node, Any]],
    bounds: tuple[Any, Any],
) -> list[fx.Node]:
    """Give a later half's causal attention ``new`` the keys and values of the halves before.

    ``node`` is the attention as captured (``is_causal=True``, sequence at dimension -2,
    :func:`causal_attention_reason`); ``copies`` every half's
    copies so far, this one's last; ``bounds`` this half's (start, length). Its queries
    read the keys and values of the sequence up to its end, joined in order, under a
    causal mask moved right by ``start``: query ``i`` (position ``start + i``) sees keys
    ``0 .. start + i``, as in the unsplit attention. Returns the nodes inserted (the
    joined keys and values, the mask's length and the mask).
    """
    start, length = bounds
    parts = {}
    with graph.inserting_before(new):
        for arg in ("key", "value"):
            given = sdpa_arg(node, arg)
            dim = given.meta["example_value"].dim() - 2
            parts[arg] = graph.call_function(torch.cat, ([c[given] for c in copies], dim))
        symbolic = isinstance(start, fx.Node)  # halves of a symbolic length, else constants
        total = graph.call_function(operator.add, (start, length)) if symbolic else None
        device = node.meta["example_value"].device
        ones = graph.call_function(
            torch.ones,
            (length, total if total is not None else start + length),
            {"dtype": torch.bool, "device": device},
        )
        mask = graph.call_method("tril", (ones,), {"diagonal": start})
    keywords = {k: v for k, v in new.kwargs.items() if k not in SDPA_ARGS}  # scale, enable_gqa
    new.args = (sdpa_arg(new, "query"), parts["key"], parts["value"])  # no dropout: checked
    new.kwargs = {**keywords, "attn_mask": mask, "is_causal": False}
    return [parts["key"], parts["value"], *([total] if total is not None else []), ones, mask]


def in_positions(reason: str) -> str:
    """Word a per-sample reason for the sequence split, whose "samples" are positions."""
    for batch_word, sequence_word in (
        (r"\bthe batch size\b", "the sequence length"),
        (r"\bbatch\b", "sequence"),
        (r"\bsamples\b", "positions"),
        (r"\bsample('s)?\b", r"position\1"),
    ):
        reason = re.sub(batch_word, sequence_word, reason)
    return reason

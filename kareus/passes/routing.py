"""Token routing: copies sorted by expert, gathered in that order, and put back in token order.

A mixture-of-experts layer (Mixtral's, Qwen3-MoE's, torchtitan's, kareus's own) routes each
token's ``k`` copies to the experts its router picks: it sorts the copies by expert id,
gathers their rows in that order, runs each expert on its contiguous rows (a grouped GEMM
segmented by how many copies each expert got) and puts the rows back in token order. The
sort and the counts read every token of the batch, so the per-sample rule
(:mod:`kareus.passes.per_sample`) refuses them one by one. Yet each copy gets its own
expert's function of its own token: :func:`route` proves it for the whole routing at once,
whatever ops write it, and the split then lets each nanobatch route its own tokens.

What is proven, from the ops' semantics (never from names of modules or libraries):

- **keys**: a sort (or argsort, ascending) of a one-dimensional tensor of expert ids that
  carries the batch: ids read, through views and casts, from ``topk``'s indices along a
  dimension of ``E`` scores, so each id is an expert in ``0 .. E-1``;
- **a permutation**: the sort's indices ``p`` (or ``p // k``, the copy's token) index only
  rows of batch-carrying tensors with as many rows per sample (gathers: ``x[p // k]``,
  ``index_select``), and such gathered rows, the sorted ids and what is computed from them
  row by row (the per-sample rule, with no row in token order beside them) stay in the
  sort's order;
- **segments**: the count of copies per expert (``bincount`` with ``minlength=E``, or
  ``histc`` with ``E`` bins over ``0 .. E-1``) of the sorted or unsorted ids, summed up
  (``cumsum``), is used only as the offsets of a grouped GEMM (``torch._grouped_mm``,
  ``F.grouped_mm``, a custom op declared alike with
  :func:`kareus.passes.op_effects.declare_alike`) whose weights hold
  ``E`` experts and carry no batch: row ``r`` then meets expert ``ids[r]``, its own;
- **put back**: rows in the sort's order leave it only by the inverse permutation (``x[inv]``
  with ``inv[p] = arange(n)``, or ``argsort(p)``) or by an ``index_add`` / ``index_copy``
  at ``p`` (or ``p // k``) into a tensor in token order.

Anything else that reads the sort's order (a ``cumsum`` over the copies, as a capacity
factor computes each copy's slot; an index kept as data; counts used other than as
offsets) leaves the routing unproven, and the block whole with that op named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.batch_dims import batch_dim_of
from kareus.passes.census import qualified_name
from kareus.passes.op_effects import arg_value, op_name
from kareus.passes.per_sample import why_not_per_sample

_CASTS = frozenset({"to", "float", "int", "long", "type", "contiguous", "clone", "detach"})
_VIEWS = _CASTS | {"view", "reshape", "flatten"}
_GROUPED = frozenset({"_grouped_mm", "grouped_mm"})
"""Ops with ``torch._grouped_mm``'s semantics (a custom one: ``op_effects.declare_alike``)."""


@dataclasses.dataclass(frozen=True)
class _Label:
    """What a node holds of a routing: ``kind`` of the sort ``sort`` (``divisor``: ``p // k``)."""

    kind: str  # sort, perm, keys, rows, counts, offsets, buffer, inverse
    sort: fx.Node
    divisor: int = 1


@dataclasses.dataclass(frozen=True)
class _At:
    """The routing a node is judged in: its sort, experts, copies, batch symbol, put-backs."""

    sort: fx.Node
    experts: int
    copies: Any  # the symbolic count of the sorted copies
    sym: Any
    back: set[fx.Node]  # the nodes that put rows back in token order, proven


@dataclasses.dataclass(frozen=True)
class Routing:
    """The nodes of a block's proven token routings, or why one is not proven."""

    proven: frozenset[fx.Node] = frozenset()
    reason: str = ""


def route(nodes: Sequence[fx.Node], sym: Any) -> Routing:
    """Prove the token routings among ``nodes`` (a block, in graph order); see the module."""
    labels: dict[fx.Node, _Label] = {}
    back: set[fx.Node] = set()
    sorts = {n: found for n in nodes if (found := _sorted_ids(n, sym)) is not None}
    for node in nodes:
        reason = _step(node, labels, sorts, back, sym)
        if reason:
            return Routing(reason=reason)
    inside = set(nodes)
    for node, label in labels.items():
        if label.kind not in ("counts", "offsets") and any(u not in inside for u in node.users):
            return Routing(reason=f"{node.name} leaves the block in the order of {label.sort.name}")
    return Routing(frozenset(labels) | back)


def _step(
    node: fx.Node,
    labels: dict[fx.Node, _Label],
    sorts: dict[fx.Node, tuple[fx.Node, int]],
    back: set[fx.Node],
    sym: Any,
) -> str:
    """Label ``node`` from its inputs' labels; return why it breaks a routing ("" if not)."""
    name = op_name(node)
    ins = [(i, labels[i]) for i in node.all_input_nodes if i in labels]
    if not ins:
        if node in sorts:
            labels[node] = _Label("sort" if name == "sort" else "perm", node)
        elif name == "sum" and (sort := _counted(node, sorts)) is not None:
            labels[node] = _Label("counts", sort)  # a one-hot of the ids summed over tokens
        return ""
    read = {label.sort for _i, label in ins}
    if len(read) > 1:
        both = sorted(s.name for s in read)
        return f"{node.name} ({name}) reads the orders of two sorts: {both}"
    sort = read.pop()
    kinds = {i: label for i, label in ins}
    at = _At(sort, sorts[sort][1], _rows(sort.args[0], sym), sym, back)
    label = _label(node, name, kinds, at)
    if isinstance(label, str):
        return label
    if label is not None:
        labels[node] = label
    elif name == "setitem":  # inv[p] = arange(n): the buffer now holds p's inverse
        labels[node.args[0]] = _Label("inverse", sort)  # type: ignore[index]
    return ""


def _label(node: fx.Node, name: str, ins: dict[Any, _Label], at: _At) -> _Label | str | None:
    """Return ``node``'s label, None where it puts rows back in token order, or a reason."""
    first: Any = node.args[0] if node.args else None
    kinds = {label.kind for label in ins.values()}
    sort = at.sort
    if name == "getitem" and kinds == {"sort"}:  # values (the sorted ids), indices
        return _Label("keys" if node.args[1] == 0 else "perm", sort)
    if kinds == {"perm"} and name in ("floordiv", "floor_divide") and first in ins:
        k = node.args[1] if len(node.args) > 1 else None
        if isinstance(k, int) and k > 0:
            return _Label("perm", sort, ins[first].divisor * k)
    if name == "argsort" and kinds == {"perm"} and ins[first].divisor == 1:
        return _Label("inverse", sort)  # the inverse of a permutation
    index = node.args[1] if name == "getitem" else arg_value(node, 2, "index")
    if name in ("getitem", "index_select") and index in ins:  # rows picked by an index
        return _gather(node, name, ins, at)
    if name in (
        "index_add",
        "index_add_",
        "index_copy",
        "index_copy_",
        "scatter_add",
        "scatter_add_",
    ):
        return _put_back(node, ins, at)
    if kinds in ({"perm"}, {"column"}) and name in ("view", "reshape", "unsqueeze", "expand"):
        return _columns(node, ins[first], at.copies)
    if name in ("add_", "iadd") and kinds == {"counts"} and len(node.args) > 1:
        return _accumulate(node, ins, at)
    if name in ("empty_like", "zeros_like") and kinds == {"perm"}:
        return _Label("buffer", sort)
    if name == "setitem":
        return _inverse(node, ins, at)
    if name in ("bincount", "histc"):
        return _counts(node, name, ins, at)
    if name == "cumsum" and kinds == {"counts"} and arg_value(node, 1, "dim") in (0, -1):
        return _Label("offsets", sort)
    if kinds <= {"counts", "offsets", "keys"} and len(kinds) == 1 and name in _CASTS:
        return _Label(kinds.pop(), sort)
    if name in _GROUPED:
        return _grouped_rows(node, ins, at)
    if "offs" in node.kwargs and ins.get(node.kwargs["offs"]) == _Label("offsets", sort):
        return (
            f"{node.name} ({name}) takes the counts of {sort.name}'s experts as offsets, as a "
            "grouped GEMM does, but kareus does not know the op: if it computes "
            "torch._grouped_mm(input, weight, offs=offs), declare it so with "
            "kareus.passes.op_effects.declare_alike(op, torch._grouped_mm)"
        )
    if kinds <= {"rows", "keys"}:
        return _row_wise(node, name, set(ins), at)
    return _refuse(node, name, sort)


def _gather(node: fx.Node, name: str, ins: dict[Any, _Label], at: _At) -> _Label | str | None:
    """``x[p // k]`` gathers rows in the sort's order; ``rows[inv]`` puts them back."""
    sort, copies, sym, back = at.sort, at.copies, at.sym, at.back
    source, index = node.args[0], ins[node.args[1] if name == "getitem" else node.args[2]]
    if name == "index_select" and arg_value(node, 1, "dim") != 0:
        return _refuse(node, name, sort)
    if index.kind == "perm" and source not in ins and isinstance(source, fx.Node):
        rows = _rows(source, sym)
        if rows is not None and rows * index.divisor == copies:
            return _Label("rows", sort)
    if index.kind == "inverse" and source in ins and ins[source].kind in ("rows", "keys"):
        back.add(node)
        return None
    return _refuse(node, name, sort)


def _refuse(node: fx.Node, name: str, sort: fx.Node) -> str:
    qualified = qualified_name(node.target) if node.op == "call_function" else ""
    custom = qualified and not qualified.startswith(("aten::", "prims::"))
    return (
        f"{node.name} ({qualified if custom else name}) reads the order of {sort.name} (a sort "
        "of the tokens' copies by expert) other than to gather rows, run each expert on its "
        "own rows and put them back"
        + (
            "; if the op computes one kareus knows (a scatter-add, a grouped GEMM), declare it "
            "with kareus.passes.op_effects.declare_alike"
            if custom
            else ""
        )
    )


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _rows(node: Any, sym: Any) -> Any:
    """Return the symbolic count of ``node``'s rows, its batch at dimension 0 (else None)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or batch_dim_of(value, sym) != 0:
        return None
    size = value.shape[0]
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _sorted_ids(node: fx.Node, sym: Any) -> tuple[fx.Node, int] | None:
    """Return (topk's ids, experts) where ``node`` sorts expert ids ascending (else None)."""
    if op_name(node) not in ("sort", "argsort"):
        return None
    key = node.args[0] if node.args else None
    value = key.meta.get("example_value") if isinstance(key, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or _rows(key, sym) is None:
        return None
    if arg_value(node, 2, "descending", False) or arg_value(node, 1, "dim", -1) not in (0, -1):
        return None
    while isinstance(key, fx.Node) and op_name(key) in _VIEWS:
        key = key.args[0]
    if not (isinstance(key, fx.Node) and op_name(key) == "getitem" and key.args[1] == 1):
        return None
    topk = key.args[0]
    if not (isinstance(topk, fx.Node) and op_name(topk) == "topk"):
        return None
    scores = topk.args[0].meta.get("example_value") if isinstance(topk.args[0], fx.Node) else None
    dim = arg_value(topk, 2, "dim", -1)
    if not isinstance(scores, torch.Tensor) or not isinstance(dim, int):
        return None
    size = scores.shape[dim]
    return (key, size) if isinstance(size, int) else None


def _counted(node: fx.Node, sorts: dict[fx.Node, tuple[fx.Node, int]]) -> fx.Node | None:
    """Return the sort whose ids ``node`` counts: a one-hot of them summed over the tokens.

    The one-hot: ``F.one_hot(ids, E)``, or ``True`` (1) scattered into zeros along the last
    dimension (``zeros_like(scores, dtype=bool).scatter_(-1, ids, True)``); summed over every
    dimension but its last, it is each expert's count of copies.
    """
    onehot = node.args[0] if node.args else None
    value = onehot.meta.get("example_value") if isinstance(onehot, fx.Node) else None
    if not isinstance(onehot, fx.Node) or not isinstance(value, torch.Tensor):
        return None
    dims = arg_value(node, 1, "dim")
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    if {d % value.dim() for d in dims if isinstance(d, int)} != set(range(value.dim() - 1)):
        return None
    name = op_name(onehot)
    if name == "one_hot":
        ids, classes = onehot.args[0], arg_value(onehot, 1, "num_classes", -1)
    elif name in ("scatter", "scatter_"):
        base, ids = onehot.args[0], arg_value(onehot, 2, "index")
        fill = arg_value(onehot, 3, "value", arg_value(onehot, 3, "src"))
        zeros = isinstance(base, fx.Node) and op_name(base) in ("zeros_like", "zeros", "new_zeros")
        if (
            not zeros
            or fill not in (True, 1)
            or arg_value(onehot, 1, "dim") not in (-1, value.dim() - 1)
        ):
            return None
        classes = value.shape[-1]
    else:
        return None
    for sort, (sorted_ids, experts) in sorts.items():
        if ids is sorted_ids and classes == experts:
            return sort
    return None


def _put_back(node: fx.Node, ins: dict[Any, _Label], at: _At) -> str | None:
    """``base.index_add(0, p // k, rows)``: each copy's row added to its token's (or copied).

    Or ``base.scatter_add(0, idx, rows)`` with ``idx[r, c] = p[r] // k`` in every column
    (``(p // k).view(-1, 1).expand(-1, d)``): the same sum, row by row.
    """
    sort, copies, sym, back = at.sort, at.copies, at.sym, at.back
    base, dim = arg_value(node, 0, "input"), arg_value(node, 1, "dim")
    scatter = op_name(node).startswith("scatter")
    index = arg_value(node, 2, "index")
    source = arg_value(node, 3, "src" if scatter else "source")
    index_label, source_label = ins.get(index), ins.get(source)
    rows = _rows(base, sym)
    if (
        dim == 0
        and base not in ins
        and index_label is not None
        and index_label.kind == ("columns" if scatter else "perm")
        and (not scatter or _same_shape(index, source))
        and source_label is not None
        and source_label.kind in ("rows", "keys")
        and rows is not None
        and rows * index_label.divisor == copies
    ):
        back.add(node)
        return None
    return _refuse(node, op_name(node), sort)


def _columns(node: fx.Node, perm: _Label, copies: Any) -> _Label | str:
    """``p.view(-1, 1)`` (a column) and its ``expand(-1, d)``: ``p[r]`` in each column of row r."""
    value = node.meta.get("example_value")
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    first = shape[0].node.expr if shape and isinstance(shape[0], torch.SymInt) else None
    column = perm.kind == "perm" and len(shape) == 2 and shape[1] == 1
    spread = perm.kind == "column" and op_name(node) == "expand" and len(shape) == 2
    if first == copies and (column or spread):
        return _Label("column" if column else "columns", perm.sort, perm.divisor)
    return _refuse(node, op_name(node), perm.sort)


def _same_shape(a: Any, b: Any) -> bool:
    values = [n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in (a, b)]
    return all(isinstance(v, torch.Tensor) for v in values) and (
        tuple(values[0].shape) == tuple(values[1].shape)  # type: ignore[union-attr]
    )


def _accumulate(node: fx.Node, ins: dict[Any, _Label], at: _At) -> str | None:
    """``stats.add_(counts)``: each nanobatch adds its own counts, the two adding up to all.

    Counts are whole numbers, so the two additions sum exactly to the one; the statistic
    (torchtitan's ``tokens_per_expert``, which a router's bias update reads after the step)
    must be read by nothing else in the block, between the two.
    """
    sort, back = at.sort, at.back
    stats, counts = node.args[0], node.args[1]
    if (
        isinstance(stats, fx.Node)
        and stats not in ins
        and ins.get(counts, _Label("", sort)).kind == "counts"
        and len(stats.users) == 1
    ):
        back.add(node)
        return None
    return _refuse(node, op_name(node), sort)


def _inverse(node: fx.Node, ins: dict[Any, _Label], at: _At) -> str | None:
    """``inv[p] = arange(n)``: the buffer becomes the inverse permutation of ``p``."""
    sort, copies, sym, back = at.sort, at.copies, at.sym, at.back
    buffer, index, value = node.args[0], node.args[1], node.args[2]
    if not (
        isinstance(buffer, fx.Node)
        and ins.get(buffer) == _Label("buffer", sort)
        and ins.get(index) == _Label("perm", sort)
        and isinstance(value, fx.Node)
        and op_name(value) == "arange"
        and len(value.users) == 1
        and _rows(value, sym) == copies
        and len(value.args) == 1
    ):
        return _refuse(node, "setitem", sort)
    order = list(node.graph.nodes)
    here = order.index(node)
    if any(order.index(u) < here for u in buffer.users if u is not node):
        return _refuse(node, "setitem", sort)  # the buffer read before it is filled
    back.update((node, value))
    return None


def _counts(node: fx.Node, name: str, ins: dict[Any, _Label], at: _At) -> _Label | str:
    """Label copies per expert, of the sorted (or unsorted) ids: one count per expert."""
    sort, experts = at.sort, at.experts
    ids = node.args[0]
    if ins.get(ids) != _Label("keys", sort) and ids is not sort.args[0]:
        return _refuse(node, name, sort)
    if name == "bincount":
        ok = arg_value(node, 2, "minlength", 0) == experts and arg_value(node, 1, "weights") is None
    else:
        bins, low = arg_value(node, 1, "bins", 100), arg_value(node, 2, "min", 0)
        ok = bins == experts and low == 0 and arg_value(node, 3, "max", 0) == experts - 1
    return _Label("counts", sort) if ok else _refuse(node, name, sort)


def _grouped_rows(node: fx.Node, ins: dict[Any, _Label], at: _At) -> _Label | str:
    """Label a grouped GEMM of rows in the sort's order, segmented by the sort's counts."""
    sort, experts, sym = at.sort, at.experts, at.sym
    rows, weight = node.args[0], node.args[1] if len(node.args) > 1 else None
    offs = arg_value(node, 2, "offs")
    value = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
    if (
        ins.get(rows, _Label("", sort)).kind in ("rows", "keys")
        and weight not in ins
        and isinstance(value, torch.Tensor)
        and batch_dim_of(value, sym) is None
        and value.dim() == 3
        and value.shape[0] == experts
        and ins.get(offs) == _Label("offsets", sort)
        and not any(
            isinstance(a, fx.Node) and a not in ins and a is not weight
            for a in node.all_input_nodes
        )
    ):
        return _Label("rows", sort)
    return _refuse(node, op_name(node), sort)


def _row_wise(node: fx.Node, name: str, routed: set[fx.Node], at: _At) -> _Label | str:
    """Label an op on rows in the sort's order, row by row, with no row in token order.

    Its inputs and outputs keep one row per copy at dimension 0: in the sort's order,
    neighbouring rows are other tokens' copies, so a view that groups rows (fine in token
    order, where a sample's rows are neighbours) would mix tokens.
    """
    sort, copies, sym = at.sort, at.copies, at.sym
    outputs = node.meta.get("example_value")
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    for value in [*(i.meta.get("example_value") for i in routed), *outputs]:
        if isinstance(value, torch.Tensor) and (
            value.dim() == 0 or batch_dim_of(value, sym) != 0 or _expr(value.shape[0]) != copies
        ):
            return (
                f"{node.name} ({name}) regroups the rows of {sort.name}'s order (a sort of the "
                "tokens' copies by expert), where neighbouring rows are other tokens'"
            )
    for inp in node.all_input_nodes:
        value = inp.meta.get("example_value")
        tensor = inp.op != "get_attr" and isinstance(value, torch.Tensor)
        if tensor and batch_dim_of(value, sym) is not None and inp not in routed:
            return (
                f"{node.name} ({name}) puts rows in token order beside rows in the order "
                f"of {sort.name} (a sort of the tokens' copies by expert)"
            )
    reason = why_not_per_sample(node, sym)
    if reason:
        return f"{reason} (on rows in the order of {sort.name}, a sort by expert)"
    return _Label("rows", sort)

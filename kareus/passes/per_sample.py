"""Which ops of a Dynamo graph act per sample, so that a block may be split along the batch.

Splitting a block into nanobatches is exact only when every op computes each sample from
that sample alone. This module decides it from the ops' semantics, by an allow-list, and
from where the batch dimension sits in each value (the one dimension whose size mentions
the batch symbol, read from Dynamo's ``example_value``):

- elementwise ops, whose batch-carrying inputs line up with the output's batch dimension
  under broadcasting;
- ops that act along named dimensions (reductions, softmax, sort, flip, roll, indexing
  along a dimension, concatenation, normalisation over trailing dimensions, matmuls and
  attention over their inner dimensions), when the batch dimension is not among them;
- shape ops (views, reshapes, transposes), when the batch stays whole: every sample's
  elements stay in rows of its own (no dimension without the batch gets mixed data);
- higher-order ops (``autograd_function_apply``, activation checkpointing, ``wrap``), when
  every op of their bodies acts per sample.

Ops are told apart by their namespace too: the allow-lists describe ``aten``, ``prims``
and the functional collectives (:data:`KNOWN_NAMESPACES`); a custom op is unknown whatever
its name (``mylib::relu`` is not ``aten::relu``). Ops registered with
``torch.Tag.pointwise`` (``torch.library.custom_op(..., tags=...)``) are elementwise in any
namespace; other custom ops can be declared with :func:`declare_elementwise`.
Anything else is unknown, and an unknown op means "do not split": the caller records the
op's name as the reason. :func:`why_not_per_sample` returns that reason, or "".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.batch_dims import batch_dim_of, rank_blocks_reason, rows_per_sample
from kareus.passes.census import COLLECTIVE_NAMESPACES, is_wait, priced_kind, qualified_name
from kareus.passes.op_effects import alike, arg_value, op_name
from kareus.passes.row_rules import keeps_rows, looks_up
from kareus.passes.sequence_halves import causal_attention_reason
from kareus.passes.subgraphs import bodies


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


_ELEMENTWISE = _names(
    """
    abs absolute acos acosh add addcdiv addcmul angle asin asinh atan atan2 atanh bitwise_and
    bitwise_not bitwise_or bitwise_xor ceil clamp clamp_max clamp_min clip clone contiguous
    copy_ cos cosh deg2rad detach div divide elu eq erf erfc erfinv exp exp2 expm1 fill_
    float_power floor floor_divide fmod frac ge gelu glu_ gt hardsigmoid hardswish hardtanh
    isfinite isinf isnan le leaky_relu lerp lgamma log log10 log1p log2 log_sigmoid
    logical_and logical_not logical_or logical_xor logit lt masked_fill maximum minimum mish
    mul multiply nan_to_num ne neg negative pow rad2deg reciprocal relu relu6 remainder
    round rsqrt selu sgn sigmoid sign silu sin sinh softplus softsign sqrt square sub
    subtract tan tanh threshold true_divide trunc where xlogy
    float half bfloat16 double int long bool to type type_as
    add_ sub_ mul_ div_ masked_fill_ clamp_ relu_ copy_ zero_
    iadd isub imul itruediv truediv floordiv mod neg pos invert and_ or_ xor
    dropout alpha_dropout feature_alpha_dropout
    real imag conj conj_physical resolve_conj resolve_neg polar complex
    """
)
"""Ops that compute each output element from the elements at the same (broadcast) index;
dropout across elements."""

_CREATES = _names("new_empty new_zeros new_ones new_full empty_like zeros_like ones_like full_like")
"""Ops that make a new tensor from a shape alone: they read no sample's data."""

_FACTORIES = _names("zeros ones full empty zeros_like ones_like full_like empty_like")
"""Ops that make a tensor whose every element is the same constant (or uninitialised)."""

_SIZES = _names(
    "view reshape expand broadcast_to new_empty new_zeros new_ones new_full narrow getitem "
    "from_local"
)
"""Ops whose size arguments may mention the batch (they follow the nanobatch's size):
``from_local``'s global ``shape`` (Hugging Face's tensor-parallel layers pass it) describes
the local tensor it wraps, whose batch is the nanobatch's."""

_BROADCASTS = _names("expand expand_as broadcast_to")
"""Ops that repeat a tensor along new or size-1 dimensions: from a value without the batch,
every sample gets the same elements (a rotary table broadcast to the batch)."""

_METADATA = _names(
    "size dim numel stride is_contiguous __len__ getattr sym_size sym_numel sym_stride"
)

_PERMUTE = _names(
    """
    permute transpose t movedim moveaxis swapaxes swapdims squeeze unsqueeze expand expand_as
    view_as_complex view_as_real one_hot
    """
)
"""Ops that reorder, add or drop dimensions (or broadcast size-1 ones; a complex view pairs
or unpairs the trailing size-2 dimension; ``one_hot`` spells each element out along a new
last dimension): a sample's elements stay at its own batch index."""

_RESHAPE = _names("view reshape view_as reshape_as flatten unflatten")
"""Ops that regroup elements in row-major order; checked by :func:`_keeps_samples`."""


def _dimsarg(index: int, name: str, default: Any = "all") -> Callable[[fx.Node, int], Any]:
    """Say that the op acts along the dims of argument ``index``/``name`` (all if absent)."""

    def dims(node: fx.Node, ndim: int) -> Any:
        value = arg_value(node, index, name, default)
        if value is None or value == "all":
            return "all"
        return value

    return dims


def _var_dims(node: fx.Node, ndim: int) -> Any:
    # x.flip(0, 1) / x.permute style varargs, or one list argument.
    rest = node.args[1:]
    if "dims" in node.kwargs:
        return node.kwargs["dims"]
    if len(rest) == 1:
        return rest[0]
    return list(rest) if rest else "all"


def _trailing(count_of: Callable[[fx.Node], int]) -> Callable[[fx.Node, int], Any]:
    def dims(node: fx.Node, ndim: int) -> Any:
        return list(range(ndim - count_of(node), ndim))

    return dims


def _normalized_len(node: fx.Node) -> int:
    shape = arg_value(node, 1, "normalized_shape", ())
    return len(shape) if isinstance(shape, (list, tuple)) else 1


_ALONG: dict[str, Callable[[fx.Node, int], Any]] = {
    # reductions and scans: dim is argument 1; a missing dim reduces everything
    **{
        name: _dimsarg(1, "dim")
        for name in _names(
            """sum mean amax amin max min var std norm logsumexp prod any all argmax
            argmin median nansum nanmean var_mean std_mean cumsum cumprod cummax cummin
            logcumsumexp kthvalue mode softmax log_softmax _softmax count_nonzero"""
        )
    },
    # ops with a default dimension
    "sort": _dimsarg(1, "dim", -1),
    "argsort": _dimsarg(1, "dim", -1),
    "topk": _dimsarg(2, "dim", -1),
    "cat": _dimsarg(1, "dim", 0),
    "concat": _dimsarg(1, "dim", 0),
    "concatenate": _dimsarg(1, "dim", 0),
    "stack": _dimsarg(1, "dim", 0),
    "split": _dimsarg(2, "dim", 0),
    "chunk": _dimsarg(2, "dim", 0),
    "unbind": _dimsarg(1, "dim", 0),
    "tensor_split": _dimsarg(2, "dim", 0),
    "narrow": _dimsarg(1, "dim"),
    "select": _dimsarg(1, "dim"),
    "index_select": _dimsarg(1, "dim"),
    "gather": _dimsarg(1, "dim"),
    "take_along_dim": _dimsarg(2, "dim"),
    **{
        name + inplace: _dimsarg(1, "dim")
        for name in ("scatter", "scatter_add", "index_add", "index_copy", "index_fill")
        for inplace in ("", "_")
    },
    "repeat_interleave": _dimsarg(2, "dim"),
    "flip": _var_dims,
    "roll": _dimsarg(2, "dims"),
    "diff": _dimsarg(2, "dim", -1),
    # normalisation over trailing dims; GEMMs and attention over their inner dims
    "layer_norm": _trailing(_normalized_len),
    "rms_norm": _trailing(_normalized_len),
    "normalize": _dimsarg(2, "dim", 1),
    "linear": _trailing(lambda n: 1),
    "matmul": _trailing(lambda n: 2),
    "bmm": _trailing(lambda n: 2),
    "baddbmm": _trailing(lambda n: 2),
    "einsum": lambda n, ndim: "all",
    "scaled_dot_product_attention": _trailing(lambda n: 2),
    "mm": _trailing(lambda n: 1),
    "addmm": _trailing(lambda n: 1),
    "glu": _dimsarg(1, "dim", -1),
}
"""Ops that act along some dimensions of their (first) tensor input: safe when the batch
dimension is none of them."""

_COLLECTIVES: dict[str, Callable[[fx.Node, int], Any] | None] = {
    "wait": None,
    "all_reduce": None,
    "all_gather": lambda n, ndim: [0],
    "reduce_scatter": lambda n, ndim: [0],
    "all_to_all": lambda n, ndim: [0],
}
"""The functional collectives by the kind :mod:`kareus.passes.census` classifies them as:
elementwise (None: a wait; an all-reduce, elementwise across ranks) or acting along the
dimensions given (gathers, scatters and all-to-alls concatenate or split the ranks' blocks
along dimension 0)."""

_DTENSOR = _names("from_local to_local redistribute full_tensor wait")
"""DTensor plumbing: moves between local shards and the global tensor, and redistributes
(collectives across ranks): per sample unless a placement shards the batch dimension."""

_HIGHER_ORDER = frozenset(
    {"autograd_function_apply", "tag_activation_checkpoint", "checkpoint", "wrap"}
)

_MODULES = {
    "Linear": "linear",
    "LayerNorm": "layer_norm",
    "RMSNorm": "rms_norm",
    "Dropout": "dropout",
    "ReLU": "relu",
    "GELU": "gelu",
    "SiLU": "silu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Identity": "clone",
    "Embedding": "embedding",
}


_DECLARED: set[str] = set()
"""Ops declared elementwise: qualified names (``mylib::myop``), or bare names as declared."""

KNOWN_NAMESPACES = frozenset({"aten", "prims", *COLLECTIVE_NAMESPACES})
"""Op namespaces whose ops the allow-lists describe, by name. An op of any other namespace
is unknown whatever its name (``torch.ops.mylib.relu`` is not ``aten.relu``) unless it is
tagged ``torch.Tag.pointwise`` or declared with :func:`declare_elementwise`."""


def declare_elementwise(*ops: Any) -> None:
    """Declare custom ops elementwise (each output element from the same input elements).

    Args:
        ops: ops (``torch.ops.ns.name`` or its overload), their qualified names
            (``"ns::name"``) or bare names (``"name"``, matching that name in any namespace
            but ``aten``'s and ``prims``'), for ops kareus does not know and that carry no
            ``torch.Tag.pointwise``.
    """
    for op in ops:
        if isinstance(op, str):
            _DECLARED.add(op.split(".")[0])
        else:
            _DECLARED.add(qualified_name(op) or str(getattr(op, "__name__", op)))


def _foreign(node: fx.Node) -> str | None:
    """Return ``ns::name`` of ``node``'s op if it is a torch op outside the known namespaces."""
    if node.op != "call_function":
        return None
    qualified = qualified_name(node.target)
    if not qualified or qualified.split("::")[0] in KNOWN_NAMESPACES or alike(node):
        return None
    return qualified


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    overload = getattr(target, "default", target)  # a packet: its default overload
    tags = getattr(overload, "tags", ())
    return torch.Tag.pointwise in tags


def why_not_per_sample(node: fx.Node, sym: Any, *, sequence: bool = False) -> str:
    """Return why ``node`` may compute a sample from other samples' data, or "" if it cannot.

    Args:
        node: a node of a Dynamo graph (or of a higher-order op's body in it).
        sym: the batch symbol (sympy) of the region, or the sequence's.
        sequence: ``sym`` is the sequence's length, split in two halves of each sequence
            (a "sample" is then a position): causal attention is allowed
            (:func:`causal_attention_reason`), the split giving the second half the first
            half's keys and values.
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return ""
    foreign = _foreign(node)
    name = foreign or op_name(node)  # a foreign op matches no allow-list by its name
    name = _MODULES.get(name, name)
    value = node.meta.get("example_value")
    inputs = [i for i in node.all_input_nodes if i.op != "get_attr"]
    dims = [(i, batch_dim_of(i.meta.get("example_value"), sym)) for i in inputs]
    carrying = [(i, d) for i, d in dims if d is not None]
    if name in _HIGHER_ORDER:
        return _body_reason(node, name, sym, sequence)
    label = f"{node.name} ({name})"
    if name in _METADATA or (name == "getitem" and not _is_tensor(node.args[0])):
        return ""  # sizes; an element of a tuple (a split's parts, an op's outputs)
    tensor_op = isinstance(value, torch.Tensor) and name not in _SIZES | _FACTORIES | _CREATES
    if tensor_op and (reason := _batch_size_reason(node, sym, label)):
        return reason
    if not carrying:
        if batch_dim_of(value, sym) is not None and name not in _FACTORIES | _CREATES | _BROADCASTS:
            return (
                f"{label} makes a tensor along the batch whose values depend on the sample's "
                "index, which differs in a nanobatch"
            )
        return ""
    if name in _CREATES:
        return ""
    if any(d == "mixed" for _i, d in carrying):
        return f"{label} reads a value whose batch is merged with another dimension"
    out_dim = batch_dim_of(value, sym) if isinstance(value, torch.Tensor) else None
    if isinstance(value, torch.Tensor) and out_dim is None:
        return f"{label} reduces across the batch dimension"
    if out_dim == "mixed":
        return f"{label} merges the batch with another dimension"
    if name == "getitem":
        return _index_reason(node, carrying, label)
    if name == "embedding":
        return ""  # each id looks up its own row
    if name in _DTENSOR:
        return _dtensor_reason(node, carrying, out_dim, label)
    if (by_rank := rank_blocks_reason(node, name, carrying, sym, label)) is not None:
        return by_rank
    collective = "wait" if is_wait(node) else priced_kind(node)
    if collective is not None:
        if (along := _COLLECTIVES[collective]) is not None:
            return _along_reason(node, along, carrying, label)
        return _broadcast_reason(carrying, value, out_dim, label)
    if name in _ELEMENTWISE or _declared(name, foreign) or _pointwise(node):
        return _broadcast_reason(carrying, value, out_dim, label)
    if name in _PERMUTE:
        return ""
    if name in _RESHAPE:
        source = carrying[0][0].meta["example_value"]
        if _keeps_samples(source, carrying[0][1], value, out_dim, sym):  # type: ignore[arg-type]
            return ""
        return f"{label} moves elements of different samples into one row"
    if sequence and name == "scaled_dot_product_attention":
        return causal_attention_reason(node, sym, label)
    if keeps_rows(node, name, carrying):
        return ""
    if name in _ALONG:
        return _aligned_reason(node, name, carrying, sym, label) or _along_reason(
            node, _ALONG[name], carrying, label
        )
    return (
        f"{label} is not known to act per sample, so splitting the batch could change its "
        "result; kareus splits only blocks whose every op it knows (an elementwise custom "
        "op: tag it torch.Tag.pointwise or kareus.passes.per_sample.declare_elementwise it)"
    )


def _declared(name: str, foreign: str | None) -> bool:
    """Whether the op was declared elementwise (a bare declared name: foreign ops only)."""
    if name in _DECLARED:
        return True
    return foreign is not None and foreign.split("::")[-1] in _DECLARED


def _batch_size_reason(node: fx.Node, sym: Any, label: str) -> str:
    """Say why a tensor op that reads the batch size as a value cannot be split ("" if not)."""
    sized = [
        a
        for a in _flat(node.args, node.kwargs)
        if isinstance(a, fx.Node)
        and isinstance(v := a.meta.get("example_value"), torch.SymInt)
        and sym in v.node.expr.free_symbols
    ]
    if not sized:
        return ""
    return (
        f"{label} uses the batch size ({sized[0].name}) as a value, which a nanobatch "
        "would replace with its own size"
    )


def _dtensor_reason(
    node: fx.Node, carrying: list[tuple[fx.Node, Any]], out_dim: Any, label: str
) -> str:
    """Say why a DTensor redistribution mixes samples ("" if it shards no batch dimension)."""
    # Placements passed as arguments, and those of the DTensors in and out: a Dynamo that
    # binds the arguments into the function it calls (torch 2.11) shows only the latter.
    values = [node.meta.get("example_value")] + [n.meta.get("example_value") for n, _d in carrying]
    placements = [p for v in values for p in getattr(v, "placements", ())]
    sharded = {getattr(p, "dim", None) for p in [*_flat(node.args, node.kwargs), *placements]}
    batch_dims = {d for _i, d in carrying} | {out_dim}
    if any(isinstance(d, int) and d in batch_dims for d in sharded):
        return f"{label} shards the batch dimension across ranks"
    return ""


_ALIGNED = {
    name + inplace: args
    for name, args in {
        "scatter": (("index", 2), ("src", 3)),
        "scatter_add": (("index", 2), ("src", 3)),
        "scatter_reduce": (("index", 2), ("src", 3)),
        "index_add": (("source", 3),),
        "index_copy": (("source", 3),),
    }.items()
    for inplace in ("", "_")
}
"""Ops that write rows of one tensor argument into ``self`` by position: those arguments
must carry the batch where ``self`` does, or each nanobatch would get the first rows."""


def _aligned_reason(
    node: fx.Node, name: str, carrying: list[tuple[fx.Node, Any]], sym: Any, label: str
) -> str:
    """Say why a scatter writes rows that are not the sample's own ("" if they are)."""
    if name not in _ALIGNED or not carrying:
        return ""
    first = node.args[0] if node.args else None
    value = first.meta.get("example_value") if isinstance(first, fx.Node) else None
    self_dim = batch_dim_of(value, sym)
    for arg_name, index in _ALIGNED[name]:
        arg = arg_value(node, index, arg_name)
        if not isinstance(arg, fx.Node):
            continue  # a scalar value: the same for every element
        if batch_dim_of(arg.meta.get("example_value"), sym) != self_dim:
            return (
                f"{label} writes rows of {arg.name} ({arg_name}) that do not carry the batch "
                "where its input does: each nanobatch would get the first rows"
            )
    return ""


def _along_reason(
    node: fx.Node,
    along: Callable[[fx.Node, int], Any],
    carrying: list[tuple[fx.Node, Any]],
    label: str,
) -> str:
    """Say why an op acting ``along`` dimensions acts along the batch's ("" if it does not)."""
    for inp, dim in carrying:
        ndim = inp.meta["example_value"].dim()
        dims = along(node, ndim)
        if dims == "all":
            return f"{label} acts across every dimension, the batch's too"
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        if any(isinstance(d, int) and d % max(ndim, 1) == dim for d in dims):
            return f"{label} acts along the batch dimension ({dim}), mixing samples"
        if not all(isinstance(d, int) for d in dims):
            return f"{label} acts along dimensions that are not constants ({dims})"
    return ""


def _is_tensor(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("example_value"), torch.Tensor)


def _flat(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            out.append(item)
    return out


def _broadcast_reason(
    carrying: Sequence[tuple[fx.Node, Any]], value: Any, out_dim: Any, label: str
) -> str:
    if not isinstance(value, torch.Tensor):
        return ""
    for inp, dim in carrying:
        ndim = inp.meta["example_value"].dim()
        if ndim - dim != value.dim() - out_dim:
            return f"{label} broadcasts the batch dimension onto another dimension"
    return ""


def _index_reason(node: fx.Node, carrying: Sequence[tuple[fx.Node, Any]], label: str) -> str:
    source, dim = carrying[0]
    if node.args[0] is not source:
        if looks_up(node, carrying):
            return ""
        return f"{label} indexes with a batch-carrying tensor"
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index) or any(
        isinstance(i, (list, torch.Tensor)) for i in index
    ):
        return f"{label} indexes with a tensor, which can pick or reorder samples"
    # The index entry that applies to the batch dimension (None adds a dimension and
    # applies to none; an Ellipsis stands for as many full slices as needed).
    ndim = source.meta["example_value"].dim()
    real = [i for i in index if i is not None]
    if Ellipsis in real:
        at = real.index(Ellipsis)
        fill = [slice(None)] * (ndim - len(real) + 1)
        real = real[:at] + fill + real[at + 1 :]
    entry = real[dim] if dim < len(real) else slice(None)
    if entry != slice(None, None, None):
        return f"{label} indexes the batch dimension ({entry}), selecting samples"
    return ""


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


def _keeps_samples(source: torch.Tensor, dim: int, value: Any, out_dim: Any, sym: Any) -> bool:
    """Whether a view from ``source`` (batch at ``dim``) to ``value`` keeps samples apart.

    With P the product of the sizes before the batch dimension, and K a sample's share of
    the batch dimension and of those after it (a batch dimension of B x S rows holds S rows
    per sample: GPT-2's ``x.view(-1, C)`` and back), every output dimension without the
    batch holds one sample's data when P_out divides P_in and K_out divides K_in (the batch
    dimension absorbs the rest).
    """
    if not isinstance(value, torch.Tensor) or not isinstance(out_dim, int):
        return False
    rows_in, rows_out = (
        rows_per_sample(source.shape[dim], sym),
        rows_per_sample(value.shape[out_dim], sym),
    )
    if rows_in is None or rows_out is None:
        return False
    p_in = math.prod(_hint(s) for s in source.shape[:dim])
    k_in = rows_in * math.prod(_hint(s) for s in source.shape[dim + 1 :])
    p_out = math.prod(_hint(s) for s in value.shape[:out_dim])
    k_out = rows_out * math.prod(_hint(s) for s in value.shape[out_dim + 1 :])
    return p_out > 0 and k_out > 0 and p_in % p_out == 0 and k_in % k_out == 0


def _body_reason(node: fx.Node, name: str, sym: Any, sequence: bool) -> str:
    found = bodies(node)
    if not found:
        return f"{node.name} ({name}) has no body kareus can read"
    for arg, sub in found:
        for inner in sub.graph.nodes:
            if sequence and op_name(inner) == "scaled_dot_product_attention":
                return (
                    f"{inner.name} (scaled_dot_product_attention) runs inside {name} "
                    f"{arg.target}, whose body the sequence split does not rewrite"
                )
            reason = why_not_per_sample(inner, sym, sequence=sequence)
            if reason:
                return f"{reason} (inside {name} {arg.target})"
    return ""

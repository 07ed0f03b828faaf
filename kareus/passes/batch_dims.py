"""Where the batch sits in a value and in a region, and the ops that stack the ranks' batches.

The batch dimension of a value is the one whose size mentions the batch symbol (Dynamo's
``example_value``). Functional all-gathers and reduce-scatters put one block per rank along
dimension 0; with the batch there, they are per sample only where the blocks are taken
apart (or were put together) by rank right beside them: :func:`rank_blocks_reason`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.census import is_wait, priced_kind
from kareus.passes.op_effects import arg_value, op_name

MIN_NANOBATCH = 2
"""The smallest nanobatch a split runs: a size of one would be specialised by Dynamo."""


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
    """Return a batch dimension's size over the batch (rows per sample), if a whole number.

    Also k for a size ``k * B`` that Dynamo computes once, where a block first needs it
    (``16 * s0``: the tokens of a batch of sequences of 16), and the next blocks read: in
    each nanobatch copy it is k times the nanobatch's size, the whole one the copies' sum.
    """
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    ratio = expr / sym
    return int(ratio) if getattr(ratio, "is_Integer", False) and int(ratio) > 0 else None


def rows_dim(value: torch.Tensor, sym: Any) -> int | None:
    """Return the dimension of k x the batch's rows (k per sample, in order) to join on.

    An output such as a router's logits, one row per token (``[16 * s0, experts]``), holds
    each sample's rows together (the per-sample rule checked the views that made it): the
    two copies' rows, one after the other, are the whole batch's.
    """
    dim = batch_dim_of(value, sym)
    return dim if isinstance(dim, int) else None


_NO_SEQUENCE = (
    "nor is it split along the sequence, whose length is not symbolic in the graph "
    "(kareus.compile marks the dimension beside the batch dynamic where the batch is too "
    "small; it stays a constant where the block meets it in an op of fixed size, as a "
    "weight of that size: then that dimension is not a sequence)"
)


def size_reason(graph: fx.Graph, batch: BatchInfo) -> str | None:
    """Say why the size the region is split along cannot be halved (None: it can)."""
    sym, hint = batch.symbol, batch.hint
    sequence = batch.along == "sequence"
    small = hint is not None and hint // 2 < MIN_NANOBATCH
    if small and not sequence:
        return (
            f"batch {hint} is too small: a nanobatch of size {(hint or 0) // 2} would "
            f"specialise and recompile each step; use a batch of at least {2 * MIN_NANOBATCH}"
            + (f"; {_NO_SEQUENCE}" if batch.tried_sequence else "")
        )
    if sym is None:
        if sequence:
            return _NO_SEQUENCE
        return (
            f"the batch dimension ({batch.source}) is static: compile the block with "
            "kareus.compile, which marks it dynamic at each call (under FSDP2's hooks too); "
            "under torch.compile(..., backend='kareus') or module.compile(backend='kareus'), "
            f'name it in torch.compiler.config.dynamic_sources ("{batch.dynamo_source}:'
            f'{batch.dim}"), or call torch._dynamo.mark_dynamic on the input before the '
            "call where no hook replaces it"
        )
    if small:
        return f"a sequence of {hint} is too short to split in two halves of 2 or more"
    return fixed_batch_reason(graph, batch)


def rank_blocks_reason(
    node: fx.Node, name: str, carrying: list[tuple[fx.Node, Any]], sym: Any, label: str
) -> str | None:
    """Judge the ops that stack the ranks' batches along dimension 0 and take them apart.

    A functional all-gather concatenates the ranks' tensors along dimension 0, and a
    reduce-scatter's input holds one block per rank there. With the batch at dimension 0,
    such a dimension holds rank blocks, each a whole batch: a nanobatch's gather is not a
    slice of the batch's. It is per sample all the same where the blocks are taken apart
    by rank before anything else reads them (:func:`rank_blocks`: the value followed
    through waits, copies into a buffer and dtype casts, to a ``chunk``/``split`` per rank
    or a view that puts the ranks in a dimension of their own, whatever library wrote
    it), and where the blocks were put together just before the reduce-scatter
    (``funcol.reduce_scatter_tensor(x, scatter_dim=1)``: ``chunk`` along the sequence,
    ``cat`` per rank, reduce-scatter). Returns "" for those, a reason for a gather or a
    scatter whose blocks escape or mix (and for any op reading them before they are
    taken apart), and None for other ops (the other rules judge them).
    """
    dims = [d for _i, d in carrying]
    stacked = [g for i, d in carrying if d == 0 and (g := gather_of(i, sym)) is not None]
    if _gathers(node) and dims == [0]:
        stacked.append(node)
    if stacked:
        gather = stacked[0]
        if rank_blocks(gather, sym) is not None:
            return ""
        return (
            f"{label} reads the ranks' batches that {gather.name} gathers along the batch "
            "dimension, and they are not taken apart by rank (a chunk per rank, or a view "
            "with the ranks in a dimension of their own) before use"
        )
    if name in ("cat", "concat", "concatenate") and 0 in dims and _along_0(node):
        if _stacked_for_scatter(node, sym):
            return ""
        return None
    if priced_kind(node) == "reduce_scatter" and dims == [0]:
        if _stacked_for_scatter(carrying[0][0], sym):  # (as many blocks as its ranks)
            return ""
        return (
            f"{label} scatters along the batch dimension an input that is not one block "
            "per rank of whole batches (a cat of a chunk per rank)"
        )
    return None


_SAME_LAYOUT = frozenset(
    {"contiguous", "clone", "detach", "alias", "to", "type", "type_as"}
    | {"float", "half", "bfloat16", "double", "_to_copy"}
)
"""Ops whose output holds their first input's elements in the same layout (and a
collective's wait, :func:`_same_layout`)."""

_BUFFERS = frozenset(
    {"empty", "new_empty", "empty_like", "empty_strided", "zeros", "new_zeros", "zeros_like"}
)
"""Ops that make a buffer a collective's result is copied into (``out=`` style APIs)."""


def _same_layout(node: fx.Node, name: str) -> bool:
    return name in _SAME_LAYOUT or is_wait(node)


def _gathers(node: Any) -> bool:
    return isinstance(node, fx.Node) and priced_kind(node) == "all_gather"


def gather_of(node: fx.Node, sym: Any) -> fx.Node | None:
    """Return the all-gather whose ranks' batches ``node``'s value holds stacked, or None.

    Followed back through ops that keep the layout (waits, copies, casts) and through a
    buffer the gathered value was copied into (``dist.all_gather_into_tensor(out, x)``
    traced as the functional gather and ``out.copy_(result)``).
    """
    seen: set[fx.Node] = set()
    while isinstance(node, fx.Node) and node not in seen:
        seen.add(node)
        if _gathers(node):
            return node if batch_dim_of(_value(node.args[0]), sym) == 0 else None
        name = op_name(node) if node.op == "call_function" or node.op == "call_method" else ""
        if name == "copy_" and len(node.args) > 1:
            node = node.args[1]  # type: ignore[assignment]
        elif _same_layout(node, name) and node.args:
            node = node.args[0]  # type: ignore[assignment]
        elif name in _BUFFERS:
            copies = [u for u in node.users if op_name(u) == "copy_" and u.args[0] is node]
            if len(copies) != 1:
                return None
            node = copies[0]
        else:
            return None
    return None


def rank_blocks(gather: fx.Node, sym: Any) -> list[fx.Node] | None:
    """Return the ops that take ``gather``'s rank blocks apart, or None if a block escapes.

    Every reader of the gathered value (through layout-keeping ops and a buffer it was
    copied into) must take it apart by rank: a ``chunk``/``split``/``tensor_split`` along
    dimension 0 into one whole-batch block per rank, or a view/reshape/unflatten whose
    dimension 0 is the ranks and dimension 1 the batch (each rank's block, row-major).
    """
    ranks = arg_value(gather, 1, "group_size")
    if not isinstance(ranks, int):
        return None
    order: dict[fx.Node, int] = {}  # graph positions, read where a buffer is copied into
    takers: list[fx.Node] = []
    pending, seen = [gather], set()
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            name = op_name(user)
            if name == "copy_" and user.args[1] is value:
                buffer = user.args[0]
                if not isinstance(buffer, fx.Node) or op_name(buffer) not in _BUFFERS:
                    return None
                order = order or {n: i for i, n in enumerate(gather.graph.nodes)}
                later = [u for u in buffer.users if u is not user]
                if any(order.get(u, -1) < order[user] for u in later):
                    return None  # read before the gathered value is in it
                pending.extend([user, buffer])  # its other readers read the gather
            elif name == "copy_" and user.args[0] is value:
                continue  # the buffer written: its readers are followed from the copy
            elif _same_layout(user, name) and user.args and user.args[0] is value:
                pending.append(user)
            elif _takes_apart(user, name, ranks, sym):
                takers.append(user)
            else:
                return None
    return takers


def _takes_apart(node: fx.Node, name: str, ranks: int, sym: Any) -> bool:
    """Whether ``node`` cuts a rank-stacked dimension 0 into its ranks' whole batches."""
    if name in ("chunk", "split", "tensor_split"):
        return _along_0(node) and _rank_parts(node, sym) == ranks
    if name in ("view", "reshape", "unflatten"):
        value = _value(node)
        return (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and value.shape[0] == ranks
            and not isinstance(value.shape[0], torch.SymInt)
            and batch_dim_of(value, sym) == 1
        )
    return False


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


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
        priced_kind(u) == "reduce_scatter" and arg_value(u, 2, "group_size") == len(tensors)
        for u in node.users
    )


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """The symbolic size a region's blocks are split along, and where it comes from.

    ``along`` is "batch" (the nanobatches are halves of the batch) or "sequence" (halves
    of each sequence: :func:`split_info`).
    """

    size: torch.SymInt | int | None
    source: str
    dynamo_source: str = "L['x']"  # the input as Dynamo names it (dynamic_sources' syntax)
    dim: int = 0
    along: str = "batch"
    tried_sequence: bool = False  # "batch" chosen where the sequence could not be split

    @property
    def symbol(self) -> Any:
        """The sympy expression of the batch size, or None when static."""
        if isinstance(self.size, torch.SymInt):
            return self.size.node.expr
        return None

    @property
    def hint(self) -> int | None:
        """The concrete batch size of the example inputs."""
        if isinstance(self.size, torch.SymInt):
            return int(self.size.node.hint)
        return self.size


def batch_info(graph: fx.Graph, batch_dim: int) -> BatchInfo:
    """Return the batch size of the region: dimension ``batch_dim`` of its first data input."""
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or _is_state(node):
            continue
        if value.dim() > batch_dim:
            return BatchInfo(
                value.shape[batch_dim],
                f"{node.name}.shape[{batch_dim}]",
                _source_name(node) or "L['x']",
                batch_dim,
            )
    return BatchInfo(None, "no tensor input")


def split_info(graph: fx.Graph, batch_dim: int, along: str) -> BatchInfo:
    """Return the size the region's blocks are split along (``Config.split_along``).

    "auto": the batch where it is symbolic and holds two nanobatches of
    :data:`MIN_NANOBATCH` or more, else the sequence (the dimension beside the batch) where
    it is symbolic (and Dynamo did not fix it), else the batch (whose reason is given).
    """
    batch = batch_info(graph, batch_dim)
    if along == "batch":
        return batch
    sequence = dataclasses.replace(batch_info(graph, 1 if batch_dim == 0 else 0), along="sequence")
    if along == "sequence":
        return sequence
    if batch.symbol is not None and (batch.hint or 0) >= 2 * MIN_NANOBATCH:
        return batch
    if _still_symbolic(sequence.size):
        return sequence
    return dataclasses.replace(batch, tried_sequence=True)


def _still_symbolic(size: Any) -> bool:
    """Whether ``size`` is a symbol Dynamo did not fix to a constant while tracing."""
    if not isinstance(size, torch.SymInt):
        return False
    env = size.node.shape_env
    return env is None or bool(env.replace(size.node.expr).free_symbols)


def fixed_batch_reason(graph: fx.Graph, batch: BatchInfo) -> str | None:
    """Say why the batch size became a constant while Dynamo traced (None: it did not).

    An input that carries the batch but was not marked dynamic (``positions`` beside the
    ``x`` listed in ``dynamic_sources``) meets the batch in an op, and Dynamo makes them equal
    by fixing the batch: each such input (a tensor input of the batch's size in that
    dimension) is named, to be listed too.
    """
    size = batch.size
    if not isinstance(size, torch.SymInt) or size.node.shape_env is None:
        return None
    if size.node.shape_env.replace(size.node.expr).free_symbols:
        return None
    sources = [batch.dynamo_source]
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor) or _is_state(node):
            continue
        size = value.shape[batch.dim] if value.dim() > batch.dim else None
        if size == batch.hint and not isinstance(size, torch.SymInt):
            name = _source_name(node)
            if name is not None and name not in sources:
                sources.append(name)
    listed = ",".join(f"{s}:{batch.dim}" for s in sources)
    return (
        f"the batch size was fixed at {batch.hint} while Dynamo traced the block: an input "
        "that carries the batch was not marked dynamic and met it in an op. Compile the block "
        "with kareus.compile, which marks every input, or list each input that carries the "
        f'batch in torch.compiler.config.dynamic_sources ("{listed}")'
    )


def _source_name(node: fx.Node) -> str | None:
    """Return the name Dynamo gives a placeholder's input (``L['x']``), if it kept one."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    return name if isinstance(name, str) else None


def _is_state(node: fx.Node) -> bool:
    # Parameters and buffers are lifted as placeholders; their sources name them.
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = getattr(source, "name", node.name)
    name = name() if callable(name) else str(name)
    example = getattr(arg, "example", None)
    return isinstance(example, torch.nn.Parameter) or any(
        key in name for key in ("_parameters", "_buffers", "parameters_", "buffers_")
    )

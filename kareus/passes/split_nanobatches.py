"""Split each repeated block into nanobatches along the batch dimension (before autograd).

For each block found by ``find_blocks``, the batch-carrying inputs are cut into two halves,
the block's nodes are copied once per half, and the outputs are concatenated. AOTAutograd
then derives the split backward by itself, including the sum of the two halves' weight
gradients. Copies are tagged with block and nanobatch (:mod:`kareus.passes.tags`) and named
``<node>_nb0`` / ``<node>_nb1``.

A batch too small to halve (fewer than 4 sequences) is split along the sequence instead
(:func:`~kareus.passes.batch_dims.split_info`, ``Config.split_along``): the same cut, copy
and join, with positions for samples, and one op that is not per position, causal
attention, whose later half reads the earlier half's keys and values under a causal mask
moved by the earlier half's length (:mod:`kareus.passes.sequence_halves`).

By default (``Config.nanobatches=None``) only blocks that hold a collective are split: the
split exists to overlap one nanobatch's collective with the other's compute, and a block
without one would only run twice the kernels at half the size (1.15-1.36x the step time of
``aot_eager`` on the 4- and 16-layer tiny Llama with the python codegen, where the unsplit
graph takes 0.94-0.99x; measured by ``benchmarks/compile_overhead.py``). ``nanobatches=2``
splits every block that can be split.

Nanobatch sizes are chosen so that every size a compiler derives from them is one term,
never a sum: an even batch ``s`` is cut into two halves of ``s//2`` each, under a guard that
``s`` is even (Dynamo recompiles when it is not); an odd batch is specialised to its value
(a guard ``s == 7``) and cut into two constants (3 and 4). The old cut, ``s//2`` and
``s - s//2``, made Inductor print ``(-128)*(s//2) + 128*s`` into a workspace slice without
parentheses, which broke a split-K reduction on CUDA (see :func:`nanobatch_sizes`).

A block is never split when that could change results or force recompiles; it is left
whole and the reason recorded (shown by ``kareus.explain``): a static or too small batch,
a graph break or a different structure inside the block, in-place mutation of a value
from outside the block (a buffer, an input), an op not known to act per sample (see
:mod:`kareus.passes.per_sample`: unknown ops are never split), random ops (unless
``Config.allow_random_split``), a size derived from the batch outside the block, or block
code interleaved with other code.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.batch_dims import (
    BatchInfo,
    rows_dim,
    rows_per_sample,
    size_reason,
    split_info,
)
from kareus.passes.census import census
from kareus.passes.links import collectives_of, why_nothing_to_hide
from kareus.passes.op_effects import draws_random, op_name, switches_mode, writes_in_place
from kareus.passes.per_sample import why_not_per_sample
from kareus.passes.routing import route
from kareus.passes.sequence_halves import attend_to_earlier, in_positions
from kareus.passes.subgraphs import own_bodies
from kareus.passes.tags import NodeTag, set_tag

_SDPA = "scaled_dot_product_attention"
_BATCH_NORMS = frozenset({"batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"})


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How one block is split: which inputs are cut where, and which outputs are joined."""

    batch_inputs: tuple[tuple[str, int], ...]  # (node name, batch dim)
    batch_sizes: tuple[tuple[str, int], ...]  # (SymInt node, k): it is k x the batch size
    outputs: tuple[tuple[str, int | str | None], ...]
    """(node name, batch dim): None for a batch-free output, "size" for k x the batch size."""
    along: str = "batch"  # or "sequence": the nanobatches are halves of each sequence
    attention: tuple[str, ...] = ()  # (sequence) causal attentions given earlier halves' keys


class SplitNanobatches(GraphPass):
    """Split every block that can be split safely into ``Config.nanobatches`` halves."""

    name = "split_nanobatches"
    graphs = frozenset({"dynamo"})
    reads = frozenset({"find_blocks"})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Split the blocks; record a reason for each block left whole."""
        blockset = ctx.findings.blocks
        if blockset is None or not blockset.blocks:
            return PassResult(gm, modified=False)
        if ctx.config.nanobatches == 1:
            plan = ctx.inputs.plan
            reason = (
                "the plan runs the layers whole: no split plan beat per-instruction clocks alone"
                if plan is not None and plan.nanobatches == 1
                else "Config.nanobatches=1 turns the split off"
            )
            for b in blockset.blocks:
                blockset.skipped[b.name] = reason
            return PassResult(gm, modified=False)
        batch = split_info(gm.graph, ctx.config.batch_dim or 0, ctx.config.split_along)
        # Decide on the graph as captured (whose metadata is complete), then rewrite.
        by_name = {n.name: n for n in gm.graph.nodes}
        plans: list[tuple[str, tuple[str, ...], SplitPlan, list[fx.Node]]] = []
        expected = census(gm)
        for block in blockset.blocks:
            if block.name in blockset.mismatched:
                blockset.skipped[block.name] = blockset.mismatched[block.name]
                continue
            if ctx.config.nanobatches is None and not _communicates(gm, block.nodes, by_name):
                blockset.skipped[block.name] = (
                    "it holds no collective: nothing to overlap, and a split would only double "
                    "its kernels (Config.nanobatches=2 splits it anyway)"
                )
                continue
            why = _not_paying(ctx, block.name, [by_name[n] for n in block.nodes])
            if why is not None:
                blockset.skipped[block.name] = why
                continue
            plan = find_split(gm.graph, block.nodes, batch, ctx.config.allow_random_split)
            if isinstance(plan, str):
                blockset.skipped[block.name] = plan
                continue
            nodes = [by_name[n] for n in block.nodes]
            shared = shared_nodes(nodes, plan, by_name)  # run once, read by both nanobatches
            once = set(shared)
            per_nanobatch = [n.name for n in nodes if n not in once]
            if ctx.config.nanobatches is None and not _communicates(gm, per_nanobatch, by_name):
                blockset.skipped[block.name] = (
                    "its collectives act on nothing that carries the batch (a parameter's "
                    "all-gather, as SimpleFSDP issues them): both nanobatches would share them, "
                    "leaving nothing to overlap within it; they can overlap the compute before or "
                    "after them instead (Config.nanobatches=2 splits it anyway)"
                )
            else:
                plans.append((block.name, block.nodes, plan, shared))
                # its collectives run once per nanobatch, those it shares once: the count
                # announced lets the runner tell a lost collective from a duplicated one
                expected.update(census(gm, (by_name[n] for n in per_nanobatch)))
        joined: dict[str, fx.Node] = {}  # outputs of split blocks -> their joined node
        made: list[fx.Node] = []
        sizes = nanobatch_sizes(batch) if plans else None
        for name, names, plan, shared in plans:
            made += rewrite_split(gm.graph, name, names, plan, joined, shared, sizes=sizes)
            blockset.split.append(name)
            blockset.split_along[name] = plan.along
        _erase_unused(gm.graph, made)
        return PassResult(gm, modified=bool(plans), collectives=expected)


def _not_paying(ctx: PassContext, block: str, nodes: list[fx.Node]) -> str | None:
    """Say why the split of ``block`` cannot pay, where it is priced; None to split it.

    A verdict of an earlier lowering stands (:attr:`RegionInputs.priced`); else a block
    none of whose collectives can fly beside compute stays whole without tracing its split
    (:func:`kareus.passes.links.why_nothing_to_hide`); the rest is priced on the split
    graphs (:mod:`kareus.compiler.split_pricing`).
    """
    on = ctx.inputs.pricing
    if on is None or ctx.config.nanobatches is not None:
        return None
    if ctx.inputs.priced is not None and block in ctx.inputs.priced:
        split, text = ctx.inputs.priced[block]
        return None if split else text
    why = why_nothing_to_hide(collectives_of(nodes), on)
    if why is None:
        return None
    return f"kept whole: the split cannot pay, {why} (Config.nanobatches=2 splits it anyway)"


def _communicates(gm: fx.GraphModule, names: Sequence[str], by_name: dict[str, fx.Node]) -> bool:
    """Whether the block of nodes ``names`` issues a collective, forward or backward.

    Its functional collectives are in the graph (in autograd.Function bodies too, see
    :func:`~kareus.passes.census.census`); a DTensor's are not yet (AOTAutograd inserts
    them when it traces through the subclass), so a DTensor on a mesh of more than one
    rank, used or made in the block, counts as one.
    """
    nodes = [by_name[n] for n in names]
    if census(gm, nodes):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a build without torch.distributed
        return False
    for node in nodes:
        for value in (node, *node.all_input_nodes):
            v = value.meta.get("example_value")
            if isinstance(v, DTensor) and v.device_mesh.size() > 1:
                return True
    return False


def find_split(
    graph: fx.Graph, names: Sequence[str], batch: BatchInfo, allow_random: bool
) -> SplitPlan | str:
    """Decide whether the block made of nodes ``names`` can be split.

    Returns:
        A :class:`SplitPlan`, or the reason the block must stay whole (along the sequence:
        said in positions, not samples).
    """
    found = _find_split(graph, names, batch, allow_random)
    if isinstance(found, str) and batch.along == "sequence":
        return f"along the sequence: {in_positions(found)}"
    return found


def _find_split(
    graph: fx.Graph, names: Sequence[str], batch: BatchInfo, allow_random: bool
) -> SplitPlan | str:
    reason = size_reason(graph, batch)
    if reason is not None:
        return reason
    sym, sequence = batch.symbol, batch.along == "sequence"
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    nodes = [by_name[n] for n in names]
    inside = set(nodes)
    batch_inputs: dict[fx.Node, int] = {}
    batch_sizes: dict[fx.Node, int] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp in inside or inp in batch_inputs or inp in batch_sizes:
                continue
            value = inp.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                dim = _batch_dim(value, sym)
                if dim is not None:
                    batch_inputs[inp] = dim
                elif _mentions(value.shape, sym):
                    return f"input {inp.name} has the batch merged into another dimension"
            elif isinstance(value, torch.SymInt) and _mentions((value,), sym):
                times = rows_per_sample(value, sym)
                if times is None:
                    return (
                        f"it uses {inp.name} = {value.node.expr}, a size derived from the batch "
                        "outside the block"
                    )
                batch_sizes[inp] = times
    if not batch_inputs:
        return "no input of the block carries the batch dimension"
    reason = _unsafe_op(nodes, inside, sym, allow_random, sequence)
    if reason:
        return reason
    last = order[nodes[-1]]
    outputs = []
    for node in nodes:
        outside_users = [u for u in node.users if u not in inside]
        if not outside_users:
            continue
        value = node.meta.get("example_value")
        joined: int | str | None = rows_dim(value, sym) if isinstance(value, torch.Tensor) else None
        if isinstance(value, torch.SymInt) and rows_per_sample(value, sym) is not None:
            joined = "size"  # a size the next block reads (Dynamo computes it once): k x B
        if joined is None and not _batch_free(node, inside, set(batch_inputs) | set(batch_sizes)):
            return f"output {node.name} of the block has no batch dimension to join halves on"
        if any(order[u] < last for u in outside_users):
            return f"block code is interleaved with other code (output {node.name} used early)"
        outputs.append((node.name, joined))
    return SplitPlan(
        tuple((n.name, d) for n, d in batch_inputs.items()),
        tuple((n.name, k) for n, k in batch_sizes.items()),
        tuple(outputs),
        batch.along,
        tuple(n.name for n in nodes if sequence and op_name(n) == _SDPA),
    )


def _batch_dim(value: torch.Tensor, sym: Any) -> int | None:
    dims = [
        i for i, s in enumerate(value.shape) if isinstance(s, torch.SymInt) and s.node.expr == sym
    ]
    return dims[0] if len(dims) == 1 else None


def _mentions(sizes: Sequence[Any], sym: Any) -> bool:
    return any(isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols for s in sizes)


def _unsafe_op(
    nodes: list[fx.Node], inside: set[fx.Node], sym: Any, allow_random: bool, sequence: bool
) -> str:
    """Return why an op of the block makes splitting unsafe, or ''.

    A token routing (:mod:`kareus.passes.routing`) is judged as a whole: its sort, gathers,
    counts and grouped GEMMs are per token together, not one by one.
    """
    routing = route(nodes, sym)
    if routing.reason:
        return routing.reason
    for node in nodes:
        name = op_name(node)
        if name in _BATCH_NORMS:
            return f"{node.name} ({name}) normalises across the batch"
        if not allow_random and draws_random(node):
            return (
                f"{node.name} ({name}) draws random numbers, whose stream would change; set "
                "Config(allow_random_split=True) to split anyway, or disable dropout"
            )
        if writes_in_place(node) and node not in routing.proven:  # (a routing's counts
            # added to a statistic outside: each copy adds its own, summing to the whole)
            target = node.args[0] if node.args else None
            if isinstance(target, fx.Node) and target not in inside:
                return (
                    f"{node.name} ({name}) mutates {target.name}, from outside the block, in place"
                )
        reason = "" if node in routing.proven else why_not_per_sample(node, sym, sequence=sequence)
        if reason:
            return reason
    return ""


def _bounds(
    graph: fx.Graph,
    block: str,
    after: fx.Node,
    first: fx.Node,
    dim: int,
    sizes: tuple[int, int] | None,
) -> tuple[list[fx.Node], tuple[tuple[Any, Any], ...]]:
    """Return the nodes that size the nanobatches (after ``after``) and their (start, length).

    ``sizes`` None: two equal halves of the symbolic batch of ``first`` (it is even:
    guarded), ``b // 2`` each; else the constants of a batch specialised to its value.
    """
    if sizes is not None:
        return [], ((0, sizes[0]), (sizes[0], sizes[1]))
    prefix = block.replace(".", "_")
    with graph.inserting_after(after):
        size = _named(graph, graph.call_method("size", (first, dim)), f"{prefix}_batch")
    with graph.inserting_after(size):
        half = _named(graph, graph.call_function(operator.floordiv, (size, 2)), f"{prefix}_half")
    return [size, half], ((0, half), (half, half))


def _args(*args: Any) -> tuple[Any, ...]:
    return args


def nanobatch_sizes(batch: BatchInfo) -> tuple[int, int] | None:
    """Choose how a symbolic batch is cut, and guard on the choice.

    Returns None for equal symbolic halves (``s//2`` each): the batch is even, and a guard
    that it stays even is added to the shape environment (Dynamo installs it with the
    region's guards, so an odd batch recompiles). An odd batch is specialised (a guard
    ``s == hint``) and cut into two constants, ``(hint//2, hint - hint//2)``.

    Either way no nanobatch size is a sum of terms: Inductor prints a size into indexing
    code as text, and once printed ``s - s//2`` times a stride as ``(-128)*(s//2) +
    128*s * 2048`` (a workspace slice of a split-K reduction on CUDA, at batch 8 x seq 2048).
    """
    size, hint = batch.size, batch.hint
    if not isinstance(size, torch.SymInt) or hint is None:
        return None if hint is None else (hint // 2, hint - hint // 2)
    if hint % 2 == 0:
        torch._check(size % 2 == 0)  # guard: an odd batch recompiles
        return None
    torch._check(size == hint)  # guard: this graph is for this odd batch only
    return hint // 2, hint - hint // 2


def rewrite_split(
    graph: fx.Graph,
    block: str,
    names: Sequence[str],
    plan: SplitPlan,
    joined: dict[str, fx.Node] | None = None,
    shared: Sequence[fx.Node] | None = None,
    *,
    sizes: tuple[int, int] | None = None,
) -> list[fx.Node]:
    """Replace the block's nodes by one copy per nanobatch and join the outputs.

    Args:
        graph: the Dynamo graph.
        block: the block's name, for tags and node names.
        names: the block's nodes, in order.
        plan: from :func:`find_split` on the graph before any rewrite.
        joined: outputs of blocks rewritten earlier, by their old name, mapped to the nodes
            that replaced them; this block's are added.
        shared: the block's nodes both nanobatches share (:func:`shared_nodes`, found before
            any rewrite; None finds them here).
        sizes: the nanobatches' sizes as constants (an odd batch, specialised), or None for
            two equal halves of the symbolic batch (:func:`nanobatch_sizes`).

    Returns:
        The nodes the rewrite inserted that are not copies of the block's own nodes (sizes,
        narrows, joins): the only ones :func:`_erase_unused` may remove.
    """
    joined = {} if joined is None else joined
    by_name = {n.name: n for n in graph.nodes} | joined
    nodes = [by_name[n] for n in names]
    first_input, first_dim = plan.batch_inputs[0]
    made, bounds = _bounds(graph, block, nodes[-1], by_name[first_input], first_dim, sizes)
    cursor = made[-1] if made else nodes[-1]
    # What the block computes from nothing that carries the batch (a parameter all-gathered
    # as SimpleFSDP does, a weight's cast, positions' rotary tables) is the same in both
    # nanobatches: computed once, before them, and read by both (a collective on it would
    # otherwise move its data twice).
    once: dict[fx.Node, fx.Node] = {}
    for node in shared_nodes(nodes, plan, by_name) if shared is None else shared:
        with graph.inserting_after(cursor):
            new = graph.node_copy(node, functools.partial(_lookup, once))
        set_tag(new, NodeTag(block))
        cursor = once[node] = _named(graph, new, f"{node.name}_shared")
    copies: list[dict[fx.Node, Any]] = []
    for nb, (start, length) in enumerate(bounds):
        env, cursor = _sizes(graph, plan, by_name, (nb, length), (cursor, made))
        env |= once
        for name, dim in plan.batch_inputs:
            source = by_name[name]
            parts = _joined_parts(source, dim)
            if parts is not None:
                # The previous block's halves, as they were: nanobatch k of this block needs
                # only nanobatch k of the last, so the two chains stay independent.
                env[source] = parts[nb]
                continue
            with graph.inserting_after(cursor):
                cursor = _named(
                    graph,
                    graph.call_function(torch.narrow, _args(source, dim, start, length)),
                    f"{name}_nb{nb}",
                )
            env[source] = cursor
            made.append(cursor)
        for node in (n for n in nodes if n not in once):
            with graph.inserting_after(cursor):
                new = graph.node_copy(node, functools.partial(_lookup, env))
            new.meta.pop("example_value", None)  # its shape is the whole batch's: stale
            if nb and node.name in plan.attention:
                for part in attend_to_earlier(graph, new, node, [*copies, env], bounds[nb]):
                    set_tag(part, NodeTag(block, nb))
                    _named(graph, part, f"{node.name}_{part.name}_nb{nb}")
            set_tag(new, NodeTag(block, nb))
            own_bodies(new, f"nb{nb}", functools.partial(set_tag, tag=NodeTag(block, nb)))
            cursor = env[node] = _named(graph, new, f"{node.name}_nb{nb}")
        copies.append(env)
    made += _join_outputs(graph, plan, by_name, copies, set(nodes), (cursor, joined))
    for node in reversed(nodes):
        graph.erase_node(node)
    return made


def _sizes(
    graph: fx.Graph,
    plan: SplitPlan,
    by_name: dict[str, fx.Node],
    copy: tuple[int, Any],
    at: tuple[fx.Node, list[fx.Node]],
) -> tuple[dict[fx.Node, Any], fx.Node]:
    """Map the block's batch sizes (k x the batch) to nanobatch ``copy``'s (k x its length).

    Nodes computing them go after ``at[0]`` and into ``at[1]``; returns the map and the
    last node inserted (else ``at[0]``).
    """
    (nb, length), (cursor, made) = copy, at
    env: dict[fx.Node, Any] = {}
    for name, times in plan.batch_sizes:
        if times == 1 or not isinstance(length, fx.Node):
            env[by_name[name]] = length if times == 1 else length * times
            continue
        with graph.inserting_after(cursor):
            cursor = graph.call_function(operator.mul, (length, times))
        env[by_name[name]] = _named(graph, cursor, f"{name}_nb{nb}")
        made.append(cursor)
    return env, cursor


def _join_outputs(
    graph: fx.Graph,
    plan: SplitPlan,
    by_name: dict[str, fx.Node],
    copies: list[dict[fx.Node, Any]],
    inside: set[fx.Node],
    at: tuple[fx.Node, dict[str, fx.Node]],
) -> list[fx.Node]:
    """Join each output's nanobatch copies after ``at[0]``; its users read the join.

    A batch-free output (dim None) is the first nanobatch's copy. ``at[1]`` maps each
    output's old name to what stands for it now. Returns the joins made.
    """
    cursor, joined = at
    made: list[fx.Node] = []
    for name, out_dim in plan.outputs:
        out = by_name[name]
        if out_dim is None:  # the same in both nanobatches: the first one's
            for user in [u for u in out.users if u not in inside]:
                user.replace_input_with(out, copies[0][out])
            joined[name] = copies[0][out]
            continue
        halves = [copies[0][out], copies[1][out]]
        with graph.inserting_after(cursor):
            join = (
                graph.call_function(operator.add, tuple(halves))  # k x b0 + k x b1 = k x B
                if out_dim == "size"
                else graph.call_function(torch.cat, (halves,), {"dim": out_dim})
            )
            cursor = _named(graph, join, f"{name}_joined")
        cursor.meta["example_value"] = out.meta.get("example_value")  # same shape as before
        for user in [u for u in out.users if u not in inside]:
            user.replace_input_with(out, cursor)
        joined[name] = cursor
        made.append(cursor)
    return made


def shared_nodes(
    nodes: Sequence[fx.Node], plan: SplitPlan, by_name: dict[str, fx.Node]
) -> list[fx.Node]:
    """Return the block's nodes that both nanobatches share, in order.

    Those computed from nothing that carries the batch (:func:`_batch_free`).
    """
    batch = {by_name[n] for n, _d in plan.batch_inputs} | {by_name[n] for n, _k in plan.batch_sizes}
    inside = set(nodes)
    return [n for n in nodes if _batch_free(n, inside, batch)]


def _batch_free(node: fx.Node, inside: set[fx.Node], batch: set[fx.Node]) -> bool:
    """Whether ``node`` is computed, inside the block, from nothing that carries the batch.

    Such an output (a constant a cache keeps, a value of the weights alone) is the same in
    both nanobatches, so the first one's stands for the whole; a random draw on the way is
    not (the two copies would draw twice).
    """
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in batch or (n in inside and (draws_random(n) or switches_mode(n))):
            return False  # (a mode switch stays in each copy, in order: not hoisted)
        todo.extend(i for i in n.all_input_nodes if i in inside or i in batch)
    return True


def _erase_unused(graph: fx.Graph, made: Sequence[fx.Node]) -> None:
    """Erase the inserted nodes nobody uses (a join the next block reads by halves).

    Only nodes the split inserted are candidates: fx's own dead-code elimination treats
    in-place method calls (``copy_``, which writes a collective's result back into an
    in-place ``dist`` call's buffer) as pure, also inside higher-order-op bodies, and would
    drop collectives with them.
    """
    candidates = set(made)
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users:
            graph.erase_node(node)


def _joined_parts(node: fx.Node, dim: int) -> tuple[fx.Node, fx.Node] | None:
    """Return the halves ``node`` joins, if it is a split block's output joined on ``dim``."""
    if (
        node.target is not torch.cat
        or node.kwargs.get("dim") != dim
        or not node.name.endswith("_joined")
    ):
        return None
    parts = node.args[0]
    if isinstance(parts, (list, tuple)) and len(parts) == 2:
        return parts[0], parts[1]  # type: ignore[return-value]
    return None


def _lookup(env: dict[fx.Node, Any], node: fx.Node) -> Any:
    return env.get(node, node)


def _named(graph: fx.Graph, node: fx.Node, name: str) -> fx.Node:
    node._rename(name)  # readable in print_readable: linear_nb0, x_1_joined
    return node

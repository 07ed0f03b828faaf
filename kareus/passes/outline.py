"""Trace each repeated block through AOTAutograd once: outline before, inline after.

AOTAutograd traces every op of the Dynamo graph (functionalization, fake tensors, autograd)
at a few hundred microseconds each, and the nanobatch split doubles the ops of every split
block: on a 16-layer model that trace was most of ``kareus.compile``'s first call. The
blocks of one family, and the two nanobatch copies of a split block, compute the same ops
on different tensors, so before AOTAutograd each block occurrence (the nodes of one block
tag: block and nanobatch) is *outlined* into a call of PyTorch's ``invoke_subgraph``
higher-order op on a body shared by all structurally equal occurrences
(:func:`outline_blocks`). AOTAutograd traces a body once per operand layout and reuses its
forward and backward graphs for every call with that layout (:func:`call_body` names it).

AOTAutograd partitions each body's joint graph on its own, then the region's joint graph,
whose calls pass the saved values from a forward body to its backward body. The forward
and backward graphs are then *inlined* (:func:`inline_bodies`): every call replaced by a
copy of its body, each copy tagged as the occurrence that called it, so the passes
downstream see flat graphs holding the same ops as without outlining. A body that draws
random numbers (its partition could recompute a draw) or writes a tensor in place (which
``invoke_subgraph`` cannot train through) is not outlined: its region is lowered op by op.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import operator
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import SEQ_NR, call_id, invoke_subgraph
from kareus.passes.op_effects import draws_random, writes_in_place
from kareus.passes.subgraphs import bodies, copy_graph
from kareus.passes.tags import NodeTag, get_tag, set_tag

_COMPUTE = frozenset({"call_function", "call_method"})
_PREFIX = "kareus_block_"


class OutlineError(RuntimeError):
    """A graph cannot be outlined or inlined; lower it flat instead."""


def outline_blocks(gm: fx.GraphModule, min_calls: int = 2) -> tuple[fx.GraphModule, int, int]:
    """Return a copy of ``gm`` whose tagged block occurrences call shared bodies.

    Occurrences are outlined when their body would be called at least ``min_calls`` times
    (at least twice: a body called once saves nothing).

    Returns:
        The outlined module, the number of calls and the number of distinct bodies (no
        calls: ``gm`` itself, unchanged).
    """
    occurrences: dict[NodeTag, list[fx.Node]] = collections.defaultdict(list)
    for node in gm.graph.nodes:
        tag = get_tag(node)
        if tag is not None and node.op in _COMPUTE:
            occurrences[tag].append(node)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    candidates = []
    for tag, nodes in occurrences.items():
        found = _occurrence(nodes, position, gm)
        if found is not None:
            candidates.append((tag, *found))
    shared = collections.Counter(key for *_, key in candidates)
    candidates = [c for c in candidates if shared[c[-1]] >= max(min_calls, 2)]
    if not candidates:
        return gm, 0, 0
    out = fx.GraphModule(gm, copy_graph(gm.graph), class_name=type(gm).__name__)
    names = {n.name: n for n in out.graph.nodes}
    attrs: dict[str, str] = {}  # structural key -> the body's attribute
    for tag, nodes, inputs, outputs, key in candidates:
        local = [names[n.name] for n in nodes]
        ins = [names[n.name] for n in inputs if n.op != "get_attr"]  # bodies live inside
        outs = [names[n.name] for n in outputs]
        attr = attrs.get(key)
        if attr is None:
            attr = attrs[key] = f"{_PREFIX}{len(attrs)}"
            out.register_module(attr, _body(out, local, [names[n.name] for n in inputs], outs))
        with out.graph.inserting_after(local[-1]):
            getter = out.graph.get_attr(attr)
        with out.graph.inserting_after(getter):
            call = out.graph.call_function(call_body, (getter, attr, *ins))
        set_tag(call, tag)
        inside = set(local)
        previous = call
        for i, value in enumerate(outs):
            with out.graph.inserting_after(previous):
                item = out.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(value.meta)
            value.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)  # noqa: B023
            names[value.name] = item  # a later occurrence's input: this call's result
            previous = item
        for node in reversed(local):
            out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    return out, len(candidates), len(attrs)


def _occurrence(
    nodes: list[fx.Node], position: dict[fx.Node, int], gm: fx.GraphModule
) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node], str] | None:
    """Return (nodes, inputs, outputs, structural key) of one occurrence, or None.

    None when the nodes cannot become one call placed where their last node is: a value
    they produce is used before that point, or they use a module the body cannot carry.
    """
    if any(_mutates(n) for n in nodes):
        return None  # AOTAutograd cannot train through a body that writes its inputs
    inside = set(nodes)
    inputs: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in seen:
                if arg.op == "get_attr" and not isinstance(
                    getattr(gm, str(arg.target), None), fx.GraphModule
                ):
                    return None
                value = arg.meta.get("example_value")
                if arg.op != "get_attr" and not isinstance(
                    value, (torch.Tensor, int, torch.SymInt, type(None))
                ):
                    return None  # invoke_subgraph takes tensors and integers only
                seen.add(arg)
                inputs.append(arg)
    last = position[nodes[-1]]
    outputs = []
    for node in nodes:
        outside = [u for u in node.users if u not in inside]
        if any(position[u] < last for u in outside):
            return None  # used before the call could run
        if outside:
            outputs.append(node)
    if not outputs:
        return None
    index = {n: ("in", i) for i, n in enumerate(inputs)}
    index.update({n: ("op", i) for i, n in enumerate(nodes)})
    parts: list[tuple[Any, ...]] = [
        ("body", _structure(getattr(gm, str(n.target))))  # a higher-order op's body
        for n in inputs
        if n.op == "get_attr"
    ]
    parts += [_node_key(n, index) for n in nodes]
    parts.append(("out", tuple(index[n] for n in outputs)))
    return nodes, inputs, outputs, repr(parts)


def _node_key(node: fx.Node, index: dict[fx.Node, Any]) -> tuple[Any, ...]:
    """Return what ``node`` computes, its arguments named by position (``index``)."""
    return (
        node.op,
        node.target,
        fx.node.map_arg(node.args, lambda a: index[a]),
        fx.node.map_arg(node.kwargs, lambda a: index[a]),
    )


def call_body(body: fx.GraphModule, name: str, *operands: Any) -> Any:
    """Call ``body`` on ``operands`` through ``invoke_subgraph`` (an outlined occurrence).

    AOTAutograd reuses a body's trace for every call with its identifier, so the identifier
    names the operands as traced too (shape, stride, dtype, gradient; value of integers):
    calls share a trace only where it is valid for all of them (the two nanobatches of an
    odd batch, for one, do not).
    """
    signature = repr([_signature(o) for o in operands]).encode()
    identifier = f"{name}_{hashlib.blake2s(signature, digest_size=8).hexdigest()}"
    return invoke_subgraph()(body, identifier, *operands)


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            tuple(str(d) for d in value.shape),
            tuple(str(d) for d in value.stride()),
            str(value.storage_offset()),
            value.dtype,
            value.device,
            value.requires_grad,
        )
    return (type(value).__name__, str(value))


def _mutates(node: fx.Node) -> bool:
    """Return whether ``node`` (or a body it calls) may write a tensor in place."""
    if writes_in_place(node):
        return True
    return any(
        _mutates(n) for _arg, body in bodies(node) for n in body.graph.nodes if n.op in _COMPUTE
    )


def _structure(body: fx.GraphModule) -> str:
    """Return what a higher-order op's body computes; equal only for interchangeable bodies."""
    index: dict[fx.Node, Any] = {n: i for i, n in enumerate(body.graph.nodes)}
    parts = []
    for n in body.graph.nodes:
        held = getattr(body, str(n.target), None) if n.op == "get_attr" else None
        # A body that holds a value (not a graph) is shared only with itself.
        kept = _structure(held) if isinstance(held, fx.GraphModule) else id(held)
        parts.append((*_node_key(n, index), None if held is None else kept))
    return repr(parts)


def _body(
    owner: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
) -> fx.GraphModule:
    """Return a graph module computing ``outputs`` from ``inputs`` with copies of ``nodes``."""
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    operands = itertools.count()
    for node in inputs:
        if node.op == "get_attr":
            name = str(node.target)
            root.add_module(name, getattr(owner, name))
            env[node] = graph.get_attr(name)
        else:
            env[node] = graph.placeholder(f"arg{next(operands)}")
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(root, graph)


def is_outlined(gm: fx.GraphModule) -> bool:
    """Return whether ``gm`` calls a body (an ``invoke_subgraph`` node)."""
    return any(_is_call(n) for n in gm.graph.nodes)


def _is_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is invoke_subgraph()


def inline_bodies(*graphs: fx.GraphModule, recompile: bool = True) -> int:
    """Replace every ``invoke_subgraph`` call in ``graphs`` by a copy of its body.

    Each inlined node is tagged as the call that ran it. Pass a partition's forward and
    backward together: their copies' autograd sequence numbers are made to agree. Without
    ``recompile`` a changed module's code is stale: the caller replaces the module.
    Returns the number of calls inlined (0: the graphs are unchanged).

    Raises:
        OutlineError: a call's results are used other than through indexing.
    """
    # A body is traced once, so its nodes' autograd sequence numbers (which pair a forward
    # op with its backward) are the same in every copy: number them per call instead.
    renumber = _Renumber()
    # A backward call is tagged as the forward call it differentiates: AOTAutograd pairs
    # them by a call number (its own metadata on the backward node is not reliable).
    by_call = {
        call_id(n): tag
        for gm in graphs
        for n in gm.graph.nodes
        if _is_call(n) and call_id(n) is not None and (tag := get_tag(n)) is not None
    }
    count = 0
    for gm in graphs:
        inlined = 0
        while calls := [n for n in gm.graph.nodes if _is_call(n)]:  # bodies may call bodies
            for call in calls:
                _inline(gm, call, renumber, by_call.get(call_id(call), get_tag(call)))
                inlined += 1
        if inlined:
            for name, _child in list(gm.named_children()):
                if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                    delattr(gm, name)
            if recompile:
                gm.recompile()
        count += inlined
    return count


def check_no_random(gm: fx.GraphModule, *, bodies_only: bool = False) -> None:
    """Raise :class:`OutlineError` when ``gm`` (``bodies_only``: a body it calls) is random.

    Partitioning a body on its own could recompute a random op in the backward (drawing
    again), and draws inlined where a call stood could come in another order than traced
    op by op; the region is then lowered without outlining.
    """
    for node in gm.graph.nodes:
        if bodies_only:
            if _is_call(node):
                check_no_random(getattr(gm, str(node.args[0].target)))  # type: ignore[union-attr]
        elif draws_random(node):
            raise OutlineError(
                f"a block draws random numbers ({node.target}): traced without outlining"
            )


_NUMBERS = itertools.count(1 << 40)
"""Sequence numbers of inlined nodes: unique in the process, like autograd's own (which
stay far below), so a region lowered for several batch sizes never reuses one."""


class _Renumber:
    """Sequence numbers for inlined nodes: one per (calling occurrence, number in body)."""

    def __init__(self) -> None:
        self._given: dict[tuple[NodeTag | None, int], int] = {}

    def __call__(self, tag: NodeTag | None, number: int) -> int:
        key = (tag, number)
        if key not in self._given:
            self._given[key] = next(_NUMBERS)
        return self._given[key]


def _inline(gm: fx.GraphModule, call: fx.Node, renumber: _Renumber, tag: NodeTag | None) -> None:
    getter, _identifier, *operands = call.args
    if not isinstance(getter, fx.Node) or getter.op != "get_attr":
        raise OutlineError(f"{call.name} calls {getter!r}, not a graph module attribute")
    body = getattr(gm, str(getter.target))
    if not isinstance(body, fx.GraphModule):
        raise OutlineError(f"{call.name}'s body is a {type(body).__name__}")
    env: dict[fx.Node, Any] = {}
    placeholders = iter(operands)
    result: Any = None
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], lambda a: env[a])
            elif node.op == "get_attr":
                name = _unique(gm, f"{getter.target}_{node.target}")
                gm.register_module(name, getattr(body, str(node.target)))
                env[node] = gm.graph.get_attr(name)
            else:
                copy = gm.graph.node_copy(node, lambda a: env[a])
                if tag is not None:
                    set_tag(copy, tag)
                if isinstance(copy.meta.get(SEQ_NR), int):
                    copy.meta[SEQ_NR] = renumber(tag, copy.meta[SEQ_NR])
                env[node] = copy
    values = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(call.users):
        index = user.args[1] if len(user.args) == 2 else None
        if user.target is not operator.getitem or not isinstance(index, int):
            raise OutlineError(f"{call.name}'s result is used by {user.name} other than indexed")
        user.replace_all_uses_with(values[index])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)
    if not getter.users:
        gm.graph.erase_node(getter)


def _unique(gm: fx.GraphModule, name: str) -> str:
    base = name.replace(".", "_")
    out, i = base, 0
    while hasattr(gm, out):
        i += 1
        out = f"{base}_{i}"
    return out

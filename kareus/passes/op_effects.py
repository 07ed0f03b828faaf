"""What an op of an FX graph does besides computing its result: its name, its writes, its draws.

One place that reads ops' schemas and tags, for every pass that must know whether a node
writes an argument in place (no split, no outlining across it) or draws random numbers
(the split changes the random stream).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import OpOverload, OpOverloadPacket, dynamo_function_name
from kareus.passes.census import qualified_name


def arg_value(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Return the value ``node`` passes as argument ``index`` or keyword ``name``.

    Of a custom op declared alike to a known one with its own arguments
    (:func:`declare_alike`'s ``args``), the known op's argument.
    """
    args, kwargs = call_args(node)
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def call_args(node: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``node``'s arguments, as the known op takes them where declared alike to one."""
    adapt = _ADAPT.get(qualified_name(node.target) or "") if _ADAPT else None
    if adapt is None:
        return node.args, node.kwargs  # read, never written: no copies
    return adapt(*node.args, **node.kwargs)


_ALIKE: dict[str, str] = {}
"""Custom ops declared to compute what a known op computes: qualified name -> its name."""

_ADAPT: dict[str, Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]] = {}
"""Of those, the ones that take other arguments: how to read them as the known op's."""


def declare_alike(
    op: Any,
    known: Any,
    args: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
) -> None:
    """Declare that custom op ``op`` computes what the known op ``known`` computes.

    Every pass then reads ``op`` as ``known`` (its name in the allow-lists and the rules): a
    library's fallback or deterministic variant of an op kareus knows, such as
    ``declare_alike(torch.ops.transformers.grouped_mm_fallback, torch._grouped_mm)`` or
    ``declare_alike(torch.ops.torchtitan.deterministic_scatter_add, torch.scatter_add)``.
    Where its arguments are not the known op's, in its order, ``args`` maps them
    (``lambda out, index, src: ((out, 0, index, src), {})`` for a scatter-add along
    dimension 0 that takes no ``dim``).

    Args:
        op: the custom op (``torch.ops.ns.name`` or an overload) or its qualified name.
        known: a torch function, method or ``aten`` op, or its name (``"scatter_add"``).
        args: maps the op's positional and keyword arguments to the known op's
            ``(args, kwargs)``.
    """
    name = (op if isinstance(op, str) else qualified_name(op) or str(op)).split(".")[0]
    alias = known if isinstance(known, str) else getattr(known, "__name__", str(known))
    _ALIKE[name] = alias.split(".")[-1]
    if args is not None:
        _ADAPT[name] = args


def alike(node: fx.Node) -> str | None:
    """Return the known op's name ``node``'s custom op was declared alike to (else None)."""
    if not _ALIKE or node.op != "call_function":
        return None
    qualified = qualified_name(node.target)
    return _ALIKE.get(qualified) if qualified else None


def op_name(node: fx.Node) -> str:
    """Return the short name of ``node``'s op (``linear``, ``flip``, ``add``...).

    A custom op declared alike to a known one (:func:`declare_alike`) has the known one's.
    """
    if (known := alike(node)) is not None:
        return known
    target = node.target
    if node.op == "call_module":
        owner = node.graph.owning_module
        if owner is not None:
            return type(owner.get_submodule(str(target))).__name__
    if isinstance(target, str):
        return target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return str(schema.name).split("::")[-1]
    name = getattr(target, "__name__", None) or getattr(target, "_name", None)
    return dynamo_function_name(str(name or target))


_IN_PLACE_OPERATORS = frozenset(
    {"setitem"}
    | {n for n in dir(operator) if n.startswith("i") and n[1:] in dir(operator) and n != "index"}
)
"""Python's own in-place operators (``x[i] = v``, ``x += y``): no torch schema describes them."""

_ATEN_ALIASES = {f"dropout{n}d": "feature_dropout" for n in (1, 2, 3)}
"""torch.nn.functional names whose aten op has another name."""


def torch_overloads(node: fx.Node) -> list[Any]:
    """Return the torch op overloads ``node`` may call: what its schema and tags are read from.

    A torch op (an overload, or a packet: each of its overloads); a torch function or tensor
    method of a Dynamo graph (``torch.rand``, ``F.dropout``, ``x.uniform_``): the ``aten``
    op of that name, which it runs. Nothing for Python operators and unknown callables.
    """
    target = node.target
    if isinstance(target, OpOverload):
        return [target]
    if isinstance(target, OpOverloadPacket):
        return [getattr(target, o) for o in target.overloads()]
    if node.op not in ("call_function", "call_method") or qualified_name(target):
        return []
    name = op_name(node)
    packet = getattr(torch.ops.aten, _ATEN_ALIASES.get(name, name), None)
    if not isinstance(packet, OpOverloadPacket):
        return []
    return [getattr(packet, o) for o in packet.overloads()]


def writes_in_place(node: fx.Node) -> bool:
    """Return whether ``node`` may write one of its arguments in place.

    From the schema of the op it calls (an argument annotated as written, as ``add_``,
    ``copy_`` and a custom op with ``mutates_args`` are), Python's in-place operators
    (``setitem``, ``iadd``...), or its arguments (``inplace=True``, ``out=``). Names are not
    read: a custom op called ``relu_`` that writes nothing does not write.
    """
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    overloads = torch_overloads(node)
    if overloads:
        # an overload with out= arguments is only chosen with them (checked above)
        plain = [o for o in overloads if not any(a.is_out for a in o._schema.arguments)]
        return any(_writes(o) for o in plain or overloads)
    return node.op == "call_function" and op_name(node) in _IN_PLACE_OPERATORS


def _writes(overload: Any) -> bool:
    return any(
        a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments
    )


_MODE_SWITCHES = frozenset(
    {"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled"}
)
"""Calls that switch a mode every later op runs under (``torch.no_grad()`` in a graph)."""


def switches_mode(node: fx.Node) -> bool:
    """Return whether ``node`` switches a global mode (grad, autocast) for the ops after it."""
    return node.op == "call_function" and op_name(node) in _MODE_SWITCHES


def draws_random(node: fx.Node) -> bool:
    """Return whether ``node`` draws random numbers: the one predicate every pass asks.

    From the op's ``torch.Tag.nondeterministic_seeded`` tag, then its arguments: a dropout
    with ``p=0`` or not training, and attention with ``dropout_p=0``, draw nothing.
    """
    overloads = torch_overloads(node)
    if not any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads):
        return False
    p = _argument(node, overloads, ("p", "dropout_p"))
    training = _argument(node, overloads, ("train", "training"))
    if isinstance(p, (int, float)) and p == 0:
        return False
    return training is not False


def _argument(node: fx.Node, overloads: list[Any], names: tuple[str, ...]) -> Any:
    """Return the value ``node`` passes for the first of ``names`` its op's schema has."""
    for name in names:
        if name in node.kwargs:
            return node.kwargs[name]
    for overload in overloads:
        for i, arg in enumerate(overload._schema.arguments):
            if arg.name in names:
                if i < len(node.args):
                    return node.args[i]
                return arg.default_value if arg.has_default_value() else None
    return None

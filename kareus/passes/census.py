"""Count the live collectives of a graph, inside higher-order-op bodies too.

A rewrite that loses a collective computes wrong results without an error: a tensor-parallel
partial sum is used as if it were reduced. The pass runner therefore counts the collectives
of every graph before and after every pass (:func:`census`) and fails the pass when the
count changes in a way the pass did not announce; the backend checks AOTAutograd's joint
graph against the Dynamo graph the same way (:func:`lost`).

A collective counts when its result is used: through its ``wait_tensor`` by anything (a
``copy_`` back into an in-place ``dist`` call's buffer counts; a wait nobody reads does
not, because AOTAutograd then drops the collective). Collectives inside the bodies of
higher-order ops (``autograd_function_apply``, activation checkpointing, ``wrap``) are
counted once per call of the body: an ``autograd_function_apply``'s backward body counts on
the backward side, every other body on the forward side.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import resolve_group
from kareus.ir.costs import CollectiveKind
from kareus.passes.subgraphs import bodies

Key = tuple[str, str, str]
"""(side, kind, group): side is "forward" or "backward"; kind the op's name; group its
ranks ("ranks 0,1"), or its name where it cannot be resolved."""

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
"""The op namespaces of PyTorch's functional collectives (what Dynamo turns ``dist`` calls,
DTensor's redistributions and ``funcol`` into): the one place kareus names them."""

_NAMESPACES = tuple(f"{ns}::" for ns in COLLECTIVE_NAMESPACES)


def qualified_name(target: object) -> str:
    """Return ``ns::name`` of a torch op (overload or packet), or "" for anything else."""
    schema = getattr(target, "_schema", None)
    return str(schema.name if schema is not None else getattr(target, "_qualified_op_name", ""))


def _qualified(node: fx.Node) -> str:
    return qualified_name(node.target)


def collective_kind(node: fx.Node) -> str | None:
    """Return the functional collective ``node`` issues (e.g. ``all_reduce``), or None."""
    if node.op != "call_function":
        return None
    return collective_kind_of(_qualified(node))


def collective_kind_of(qualified: str) -> str | None:
    """Return the functional collective an op's ``ns::name`` issues, or None (a wait too).

    The one classifier: the passes ask it of graph nodes (:func:`collective_kind`), the
    test helpers of the op names in Inductor's generated code.
    """
    for ns in _NAMESPACES:
        if qualified.startswith(ns):
            kind = qualified[len(ns) :]
            return None if kind == "wait_tensor" else kind
    return None


def priced_kind(node: fx.Node) -> CollectiveKind | None:
    """Return the cost model's kind of the collective ``node`` issues; None if none.

    (A collective kareus has no cost for is None here; :func:`cost_kind` raises on it.)
    """
    kind = collective_kind(node)
    return COST_KINDS.get(kind) if kind is not None else None


def group_name(node: fx.Node) -> str:
    """Return the registered name of the group a functional collective runs on ("?": none)."""
    group = node.kwargs.get("group_name")
    if group is None:
        strings = [a for a in node.args if isinstance(a, str)]
        group = strings[-1] if strings else "?"
    return str(group)


def _group(node: fx.Node) -> str:
    return _ranks(group_name(node))


@functools.lru_cache(maxsize=256)
def _ranks(name: str) -> str:
    """Name a group by its ranks: the SM-share communicators of one group are the same."""
    try:
        import torch.distributed as dist

        pg = resolve_group(name)
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(pg)))
    except Exception:  # not initialised, or an unregistered name: keep the name
        return name


def is_functional_collective(node: fx.Node) -> bool:
    """Return whether ``node`` is a functional collective's issue or its wait."""
    return node.op == "call_function" and _qualified(node).startswith(_NAMESPACES)


COST_KINDS: dict[str, CollectiveKind] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
"""The cost model's kind (:data:`kareus.ir.costs.CollectiveKind`) of each functional
collective kareus prices: the one table a new collective is added to."""


def cost_kind(node: fx.Node) -> CollectiveKind:
    """Return the cost model's kind of the collective ``node`` issues.

    Raises:
        ValueError: ``node`` issues a collective kareus has no cost for (named, with the
            ones it has), rather than pricing it as another kind.
    """
    kind = collective_kind(node)
    if kind is None or kind not in COST_KINDS:
        raise ValueError(
            f"{node.name} issues {kind or node.target}, a collective kareus has no cost for "
            f"(it prices {', '.join(sorted(COST_KINDS))}); add it to "
            "kareus.passes.census.COST_KINDS with the kind its cost follows"
        )
    return COST_KINDS[kind]


def is_wait(node: fx.Node) -> bool:
    """Return whether ``node`` waits on a functional collective (``wait_tensor``)."""
    return is_wait_of(_qualified(node))


def is_wait_of(qualified: str) -> bool:
    """Return whether an op's ``ns::name`` is a functional collective's wait."""
    return qualified.endswith("::wait_tensor")


def wait_now(value: Any) -> None:
    """Wait on the functional collective whose result is ``value`` (a tensor or a list)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    for t in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(t, torch.Tensor):
            wait(t)


def _live(node: fx.Node) -> bool:
    users = list(node.users)
    for user in users:
        if is_wait(user):
            if user.users:
                return True
        elif user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem":
            if _live(user):
                return True
        else:
            return True
    return False


def census(gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None) -> collections.Counter[Key]:
    """Count the live collectives of ``gm`` (or of ``nodes`` of its graph), by side/kind/group.

    Args:
        gm: a graph module; bodies of higher-order ops are its ``get_attr`` submodules.
        nodes: restrict the count to these nodes of ``gm.graph`` (their bodies included).
    """
    out: collections.Counter[Key] = collections.Counter()
    for node, side, _body in _live_collectives(gm.graph.nodes if nodes is None else nodes):
        out[(side, collective_kind(node) or "", _group(node))] += 1
    return out


def _live_collectives(
    nodes: Iterable[fx.Node], side: str = "forward", body: bool = False
) -> Iterator[tuple[fx.Node, str, bool]]:
    """Yield each live collective of ``nodes``, with its side and whether it lies in a body.

    Bodies of higher-order ops count once per call.
    """
    for node in nodes:
        if collective_kind(node) is not None:
            if _live(node):
                yield node, side, body
            continue
        is_function = getattr(node.target, "__name__", "") == "autograd_function_apply"
        for i, (_arg, sub) in enumerate(bodies(node)):
            # An autograd.Function's second body is its backward.
            body_side = "backward" if is_function and i == 1 else side
            yield from _live_collectives(sub.graph.nodes, body_side, True)


VolumeKey = tuple[str, str, str, str]
"""(side, kind, group, dtype) of collectives whose sizes :func:`volume` sums."""


def volume(gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None) -> dict[VolumeKey, Any]:
    """Sum the elements the live collectives of ``gm`` produce, by side, kind, group, dtype.

    Sizes are sympy expressions of the graph's symbolic sizes (a split block's two halves
    add up to the whole: ``s//2 * h + (s - s//2) * h == s * h``), or None for a key with a
    collective whose size the graph does not record (one inside a higher-order op's body,
    traced once for calls of several sizes). Where :func:`census` counts, this
    weighs: a collective resized, or swapped for another tensor's of another size or type,
    changes it.
    """
    import sympy

    out: dict[VolumeKey, Any] = {}
    for node, side, body in _live_collectives(gm.graph.nodes if nodes is None else nodes):
        value = node.meta.get("val", node.meta.get("example_value"))
        key = (side, collective_kind(node) or "", _group(node), str(getattr(value, "dtype", "?")))
        # a body's sizes are those it was traced with, not each call's: unknown
        if body or not isinstance(value, torch.Tensor):
            out[key] = None
        elif key not in out or out[key] is not None:
            numel = value.numel()
            size = numel.node.expr if isinstance(numel, torch.SymInt) else sympy.Integer(numel)
            out[key] = out.get(key, sympy.Integer(0)) + size
    return out


def resized(before: dict[VolumeKey, Any], after: dict[VolumeKey, Any]) -> list[str]:
    """Say how the collectives' sizes changed between two :func:`volume` weighings."""
    import sympy

    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if key in before and key in after and (a is None or b is None):
            continue  # a size the graph does not record: the count alone is checked
        if a is None or b is None or sympy.expand(a - b) != 0:
            side, kind, group, dtype = key
            where = group if group.startswith("ranks ") else repr(group)
            out.append(
                f"{side} {kind} on {where} ({dtype}): {a if a is not None else 0} elements "
                f"before, {b if b is not None else 0} after"
            )
    return out


def as_side(counts: collections.Counter[Key], side: str) -> collections.Counter[Key]:
    """Return ``counts`` with every collective moved to ``side`` (for a joint comparison)."""
    out: collections.Counter[Key] = collections.Counter()
    for (_s, kind, group), n in counts.items():
        out[(side, kind, group)] += n
    return out


def lost(
    expected: collections.Counter[Key], got: collections.Counter[Key]
) -> collections.Counter[Key]:
    """Return the collectives of ``expected`` missing from ``got`` (empty when none)."""
    return collections.Counter(
        {k: n - got.get(k, 0) for k, n in expected.items() if got.get(k, 0) < n}
    )


def describe(counts: collections.Counter[Key]) -> str:
    """Render counts as ``2 forward all_reduce on ranks 0,1``, comma-separated."""
    return ", ".join(
        f"{n} {side} {kind} on {group if group.startswith('ranks ') else repr(group)}"
        for (side, kind, group), n in sorted(counts.items())
    )

"""How a process group's collectives run in this process: what the split's pricing asks.

A collective hides behind the other nanobatch's compute only where it runs beside that
compute without taking it: NCCL's kernels on a GPU do (they take some SMs, which the
hardware model prices); gloo's threads on a CPU do not (they share the cores the compute
runs on); a group of one rank moves nothing; a group may declare the time each of its
collectives takes (an emulated link, :class:`kareus.testing.EmulatedGroup`, which takes no
compute). The split pricing (``split_nanobatches`` before the split,
:mod:`kareus.compiler.split_pricing` after it) asks this module, by the group's registered
name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from kareus._torch_internals import resolve_group
from kareus.passes.annotate_costs import nbytes
from kareus.passes.census import collective_kind, group_name, priced_kind
from kareus.passes.subgraphs import bodies

HOST = "host"
"""The split pricing's device where no GPU prices it: the CPU the model runs on."""

UNKNOWN = "?"
"""A group kareus cannot name here (its collectives are priced after the split)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """What kareus knows of one process group's collectives.

    Attributes:
        group: the registered name.
        size: its ranks (0: the name resolves to no group of this process, which is then
            not judged before the split).
        backend: its backend's name ("gloo", "nccl", ...; "" unknown).
        declared: seconds a collective takes, from its kind and its input's bytes, where
            the group says (then it takes no compute); else None.
    """

    group: str
    size: int
    backend: str
    declared: Callable[[str, int], float] | None = None

    def why_nothing_to_hide(self, on: str) -> str | None:
        """Say why overlapping this group's collectives hides nothing on ``on``, or None.

        ``on``: :data:`HOST` (a CPU prices the split) or a GPU type.
        """
        if self.declared is not None or self.size == 0:  # an emulated link; one unknown
            return None
        if self.size == 1:
            return f"group {self.group!r} has one rank: its collectives move nothing"
        if on == HOST:
            backend = self.backend or "its backend"
            return (
                f"on the CPU, {backend}'s collectives (group {self.group!r}) run on the cores "
                "the compute runs on: overlapping them hides nothing"
            )
        return None


def link_of(group: str) -> Link:
    """Return the :class:`Link` of the group registered as ``group``."""
    try:
        pg = resolve_group(group)
    except Exception:  # not initialised, or a name no group of this process has
        return Link(group, 0, "")
    declared = getattr(pg, "collective_time_s", None)
    try:
        size = int(pg.size())
    except Exception:
        size = 0
    return Link(group, size, _backend_name(pg), declared if callable(declared) else None)


def _backend_name(pg: object) -> str:
    for attr in ("getBackendName", "name", "_get_backend_name"):
        fn = getattr(pg, attr, None)
        if callable(fn):
            try:
                return str(fn())
            except Exception:  # a backend that does not say
                continue
    return ""


@dataclasses.dataclass(frozen=True)
class Seen:
    """A collective as the graph before the split shows it (kind and bytes where known)."""

    group: str
    kind: str | None = None
    nbytes: int | None = None


def collectives_of(nodes: Iterable[fx.Node]) -> list[Seen]:
    """Return the collectives ``nodes`` issue, inside bodies and DTensors too.

    A DTensor's collectives are not in Dynamo's graph yet (AOTAutograd inserts them): a
    DTensor on a mesh of more than one rank, used or made here, counts as one of its group,
    of unknown kind and size.
    """
    found: list[Seen] = []
    for node in nodes:
        if collective_kind(node) is not None:  # (priced or not: its group counts)
            found.append(Seen(group_name(node), priced_kind(node), _full_bytes(node)))
        for _arg, sub in bodies(node):
            found += collectives_of(sub.graph.nodes)
        for value in (node, *node.all_input_nodes):
            found += [Seen(g) for g in _mesh_groups(value.meta.get("example_value"))]
    return found


def _full_bytes(node: fx.Node) -> int | None:
    """Return the bytes of a collective's full tensor (its input or output, the larger).

    At the example inputs' sizes (a symbolic size's hint); None where one has none.
    """
    values = [node.meta.get("example_value")]
    values += [a.meta.get("example_value") for a in node.all_input_nodes]
    try:
        return max((nbytes(v) for v in values if isinstance(v, torch.Tensor)), default=None)
    except TypeError:  # a size without a hint (data-dependent)
        return None


def _mesh_groups(value: object) -> set[str]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a build without torch.distributed
        return set()
    if not isinstance(value, DTensor):
        return set()
    mesh = value.device_mesh
    mesh = getattr(mesh, "real_obj", mesh)  # Dynamo's example values hold it as an opaque
    try:
        return {g.group_name for g in mesh.get_all_groups() if g.size() > 1}
    except Exception:  # a mesh that does not say: priced after the split instead
        return {UNKNOWN}


def why_nothing_to_hide(seen: Iterable[Seen], on: str) -> str | None:
    """Say why overlapping the collectives ``seen`` hides nothing on ``on``, or None.

    None as soon as one collective could hide behind compute: then only pricing the split
    graphs tells. A group that declares its durations hides nothing where it declares each
    of its collectives here takes no time.
    """
    by_group: dict[str, list[Seen]] = {}
    for s in seen:
        by_group.setdefault(s.group, []).append(s)
    reasons = []
    for name, colls in sorted(by_group.items()):
        link = link_of(name)
        why = link.why_nothing_to_hide(on)
        if why is None and link.declared is not None:
            why = _declares_nothing(link, colls)
        if why is None:
            return None
        reasons.append(why)
    return "; ".join(reasons) if reasons else None


def _declares_nothing(link: Link, colls: list[Seen]) -> str | None:
    assert link.declared is not None
    for c in colls:
        if c.kind is None or c.nbytes is None or link.declared(c.kind, c.nbytes) > 0:
            return None
    return f"group {link.group!r} declares that its collectives here take no time"


def declared_time(group: str, kind: str, nbytes: float) -> float | None:
    """Return the seconds ``group`` declares a collective takes, or None where it does not."""
    link = link_of(group) if group else None
    if link is None or link.declared is None:
        return None
    return float(link.declared(kind, int(nbytes)))

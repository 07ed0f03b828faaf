"""Cut each split block's compute at its collectives and form partitions.

Per AOT graph (forward, backward) and per split block, each nanobatch copy is cut into
*segments*: the compute up to one collective (Megatron layers have two per direction:
attention and MLP). Segments of consecutive blocks form one chain per nanobatch; with X
the nanobatch that runs first in the graph and Y the other, the skewed interleave

    partition(k, X) = compute of segment k of X  ‖  collective of segment k-1 of Y
    partition(k, Y) = compute of segment k of Y  ‖  collective of segment k   of X

overlaps every collective but the last with compute of the other nanobatch. Compute after a
block's last collective (the residual add) joins the next block's first segment. Partitions
with the same op-class sequence and collective share a type.

A graph whose blocks all stay whole has no nanobatch to interleave, but a collective there
may still need nothing its block's compute before it produces (a weight all-gathered in
the graph) or be read by nothing until a later block (its gradient's reduce-scatter): such
a collective is paired with the nearest run of a whole block's compute that lies between
its input and its first reader (:func:`_overlap_whole_blocks`). The result is a
:class:`~kareus.ir.partitions.PartitionSet` (plain data) under this pass's name in the region's
findings; the graph does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import resolve_group
from kareus.ir.costs import CollectiveCost, OpCost
from kareus.ir.partitions import Partition, PartitionSet, PartitionType, Slot
from kareus.passes.annotate_costs import NODES_KEY, cost_of, moves_freely, nbytes
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.blocks import BlockSet
from kareus.passes.census import cost_kind, group_name


@dataclasses.dataclass
class Segment:
    """Compute of one nanobatch up to (not including) a collective, and that collective."""

    block: str
    nanobatch: int
    index: int
    compute: list[fx.Node]
    issue: fx.Node | None = None
    wait: fx.Node | None = None


class CutPartitions(GraphPass):
    """Form the partitions of the forward and backward graphs."""

    name = "cut_partitions"
    graphs = frozenset({"forward", "backward", "inference"})
    finds = "partitions"
    reads = frozenset({"find_blocks"})
    after = frozenset({"annotate_costs"})  # reads the costs it annotated on the nodes

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Needs the costs (``annotate_costs``) of the graph's nodes."""
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        if calls and not any("kareus" in n.meta for n in calls):
            raise ValueError("run annotate_costs first: the nodes carry no cost")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Record the partitions of this graph in the region's ``PartitionSet``."""
        pset = ctx.findings.partitions or PartitionSet()  # the forward's, in the backward
        blockset = ctx.findings.blocks
        cut_graph(gm.graph, ctx.graph, blockset, pset, fuse=ctx.config.fuses_memory_ops)
        return PassResult(gm, modified=False, found=pset)


def collective_cost(issue: fx.Node) -> CollectiveCost:
    """Return kind, bytes, group size and nodes spanned of a collective's issue node.

    The nodes are those ``annotate_costs`` recorded (1 where it recorded none).
    """
    cost = cost_of(issue)
    nodes = int(issue.meta.get(NODES_KEY, 1))
    size = _group_size(issue)
    return CollectiveCost(cost_kind(issue), cost.bytes, size, issue.name, nodes, group_name(issue))


def _group_size(issue: fx.Node) -> int:
    name = next((a for a in reversed(issue.args) if isinstance(a, str)), None)
    sizes = [a for a in issue.args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    if sizes and cost_kind(issue) != "all_reduce":  # an all-reduce passes no group size
        return int(sizes[0])
    try:
        return resolve_group(name).size()
    except Exception:  # no process group at hand (tracing only): count two ranks
        return 2


def _segments(
    graph: fx.Graph, names: list[str], block: str, nb: int
) -> tuple[list[Segment], list[fx.Node]]:
    """Cut one block copy; return its segments and the compute after its last collective."""
    by_name = {n.name: n for n in graph.nodes}
    segs: list[Segment] = []
    current: list[fx.Node] = []
    for name in names:
        node = by_name[name]
        cls = cost_of(node).op_class
        if cls == "collective_issue":
            waits = [u for u in node.users if cost_of(u).op_class == "collective_wait"]
            segs.append(Segment(block, nb, len(segs), current, node, waits[0] if waits else None))
            current = []
        elif cls != "collective_wait":
            current.append(node)
    return segs, current


def _slots(
    nodes: list[fx.Node], fuse: bool = False, breaks: frozenset[str] = frozenset()
) -> tuple[Slot, ...]:
    slots: list[tuple[str, list[fx.Node]]] = []
    pending_views: list[str] = []
    for node in nodes:
        cost = cost_of(node)
        if cost.op_class == "view":
            pending_views.append(node.name)
            continue
        first = pending_views[0] if pending_views else node.name
        pending_views = []
        if (
            cost.op_class == "memory"
            and node.name not in breaks
            and slots
            and cost_of(slots[-1][1][-1]).op_class == "memory"
        ):
            slots[-1][1].append(node)
        else:
            slots.append((first, [node]))
    return tuple(Slot(first, _costs(run, fuse)) for first, run in slots)


def partition_costs(
    nodes: list[fx.Node], fuse: bool, breaks: frozenset[str] = frozenset()
) -> tuple[OpCost, ...]:
    """Return the costs of a run of compute nodes, slot by slot (``fuse``: see ``Config``).

    Partition types, the work outside partitions and extracted programs are all costed
    through this one function. A memory op named in ``breaks`` starts a kernel of its own
    (:func:`gaps`).
    """
    return tuple(c for slot in _slots(nodes, fuse, breaks) for c in slot.ops)


def step_index(graph: fx.Graph) -> dict[fx.Node, int]:
    """Return each op's position among the graph's ops that run (views aside)."""
    steps = [n for n in graph.nodes if n.op == "call_function" and cost_of(n).op_class != "view"]
    return {n: i for i, n in enumerate(steps)}


def gaps(index: dict[fx.Node, int], nodes: list[fx.Node]) -> frozenset[str]:
    """Return the memory ops of ``nodes`` that cannot share a kernel with the one before.

    ``nodes`` is work outside partitions (a block's weight gradients and residual tail, a
    block left whole, the embedding and head): in graph order, but not contiguous — other
    blocks' compute, collectives and their waits can run between two of its memory ops.
    One fused kernel cannot span those (the later op may read what they produce), so two
    memory ops share one only where nothing but views lies between them in the graph
    (``index``: its :func:`step_index`). Partition compute needs none: a segment is
    contiguous, and codegen runs it so.
    """
    out: set[str] = set()
    before: fx.Node | None = None
    for node in nodes:
        if node not in index:  # a view
            continue
        adjacent = before is not None and index[node] == index[before] + 1
        if _memory(node) and before is not None and _memory(before) and not adjacent:
            out.add(node.name)
        before = node
    return frozenset(out)


def _costs(run: list[fx.Node], fuse: bool) -> tuple[OpCost, ...]:
    """Return the costs of a run of ops: memory ops as one fused kernel when ``fuse``."""
    costs = tuple(cost_of(n) for n in run)
    if not fuse or len(run) < 2 or costs[0].op_class != "memory":
        return costs
    return (fused_cost(run),)


def _out_bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return float(sum(nbytes(v) for v in vals if isinstance(v, torch.Tensor)))


def _source(node: fx.Node) -> fx.Node:
    """Return the node whose storage a chain of views reads."""
    while cost_of(node).op_class == "view" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def fused_cost(run: list[fx.Node]) -> OpCost:
    """Cost of memory-bound ops fused into one kernel.

    The kernel reads each tensor from outside the run once and writes each value used
    outside the run (or by no one inside it) once; intermediates stay in registers.
    """
    inside = set(run)
    read: dict[fx.Node, float] = {}
    for node in run:
        for arg in node.all_input_nodes:
            src = _source(arg)
            if src not in inside:
                read.setdefault(src, _out_bytes(arg))
    written = sum(
        _out_bytes(n) for n in run if not n.users or any(_source_user(u, inside) for u in n.users)
    )
    first = cost_of(run[0])
    return OpCost(
        "memory",
        sum(cost_of(n).flops for n in run),
        float(sum(read.values()) + written),
        first.dtype,
        f"fused[{run[0].name}..{run[-1].name}]",
    )


def _source_user(user: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether ``user`` (through views) is outside the fused run."""
    if user in inside:
        return False
    if cost_of(user).op_class == "view":
        return any(_source_user(u, inside) for u in user.users) or not user.users
    return True


def cut_graph(
    graph: fx.Graph,
    kind: str,
    blockset: BlockSet | None,
    pset: PartitionSet,
    *,
    fuse: bool = False,
) -> None:
    """Add the partitions of one AOT graph to ``pset`` (``fuse``: see ``Config``)."""
    spans = blockset.spans.get(kind, {}) if blockset else {}
    chain: list[tuple[str, dict[int, tuple[list[Segment], list[fx.Node]]]]] = []
    for block in blockset.split if blockset else []:
        per_nb = spans.get(block, {})
        if not {0, 1} <= set(per_nb):
            continue
        cut = {nb: _segments(graph, per_nb[nb], block, nb) for nb in (0, 1)}  # type: ignore[index]
        if not cut[0][0] or len(cut[0][0]) != len(cut[1][0]):
            continue
        chain.append((block, cut))
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    # Blocks run in reverse in the backward graph: follow this graph's order.
    chain.sort(key=lambda item: min(order[s.issue.name] for s in item[1][0][0] if s.issue))
    if chain:
        _interleave(graph, kind, chain, pset, fuse)
    elif not _overlap_whole_blocks(graph, kind, pset, spans or _whole_graph(graph), fuse):
        pset.notes[kind] = "no split block with collectives: frequency planning only"
    rest, per_block, exposed, alone = outside_nodes(graph, kind, pset, spans, fuse)
    index = step_index(graph)
    pset.block_other[kind] = {
        block: partition_costs(nodes, fuse, gaps(index, nodes))
        for block, nodes in per_block.items()
    }
    pset.other[kind] = partition_costs(rest, fuse, gaps(index, rest))
    pset.exposed[kind] = tuple(collective_cost(n) for n in exposed)
    pset.block_exposed[kind] = {
        block: tuple(collective_cost(n) for n in issues) for block, issues in alone.items()
    }


WHOLE_GRAPH = "graph"
"""The block name of partitions cut from a graph without layer blocks (compiled autograd's
backward, a model without a layer list): the graph is one run of compute, left whole."""


def _whole_graph(graph: fx.Graph) -> dict[str, dict[None, list[str]]]:
    """Spans of a graph without layer blocks: the whole graph as one block left whole."""
    return {WHOLE_GRAPH: {None: [n.name for n in graph.nodes if n.op == "call_function"]}}


def _join_runs(graph: fx.Graph, rest: list[fx.Node], per_block: dict[str, list[fx.Node]]) -> None:
    """Give each run of adjacent memory ops outside partitions to one owner, in place.

    A fused kernel does not stop where block ownership changes: the residual add that ends
    one layer and the norm that starts the next are adjacent memory ops, and in a backward
    graph the residual gradient's accumulation (owned by the block whose span holds the
    chain) sits inside each layer's norm backward. Such a run — memory ops with nothing but
    views between them in ``graph`` — is one kernel, costed where its first op belongs (the
    block, or ``rest``); without this a block left whole paid one more write and read of the
    residual stream per layer than the same layers split. Lists stay in graph order.
    """
    position = {n: i for i, n in enumerate(graph.nodes)}
    index = step_index(graph)
    owner: dict[fx.Node, str | None] = {n: None for n in rest}
    owner.update({n: block for block, nodes in per_block.items() for n in nodes})
    memory = sorted((n for n in owner if n in index and _memory(n)), key=index.__getitem__)
    runs: list[list[fx.Node]] = []
    for node in memory:
        if runs and index[node] == index[runs[-1][-1]] + 1:
            runs[-1].append(node)
        else:
            runs.append([node])
    moved = False
    for run in runs:
        for node in run[1:]:
            if owner[node] != owner[run[0]]:
                owner[node] = owner[run[0]]
                moved = True
    if not moved:
        return
    lists: dict[str | None, list[fx.Node]] = {None: []}
    lists.update({block: [] for block in per_block})
    for node in sorted(owner, key=position.__getitem__):
        lists[owner[node]].append(node)
    rest[:] = lists[None]
    for block in per_block:
        per_block[block][:] = lists[block]


def _memory(node: fx.Node) -> bool:
    return cost_of(node).op_class == "memory"


def outside_nodes(
    graph: fx.Graph, kind: str, pset: PartitionSet, spans: dict[str, Any], fuse: bool = False
) -> tuple[list[fx.Node], dict[str, list[fx.Node]], list[fx.Node], dict[str, list[fx.Node]]]:
    """Return the compute of ``graph`` outside its partitions, and its exposed collectives.

    Partition cutting and extraction both take the work outside partitions from here, so
    that what is costed and what is extracted are the same runs (``fuse``: a block's
    runs of adjacent memory ops are costed where they start, :func:`_join_runs`).

    Returns:
        The compute outside blocks (embedding, head, loss); per block, its compute outside
        partitions (a split block's weight gradients and residual tail, a block left whole
        entirely); the issue nodes of collectives that overlap no compute; and per block,
        those of them it runs. All in graph order.
    """
    parts = [p for p in pset.partitions if p.instruction == kind]
    inside = {n for p in parts for n in (*p.compute, *(p.collective or ()))}
    owner = {
        name: block
        for block, per_nb in spans.items()
        for names in per_nb.values()
        for name in names
    }
    rest: list[fx.Node] = []
    per_block: dict[str, list[fx.Node]] = {}
    exposed: list[fx.Node] = []
    alone: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.name in inside:
            continue
        cls = cost_of(n).op_class
        if cls == "collective_issue":
            exposed.append(n)
            if n.name in owner:
                alone.setdefault(owner[n.name], []).append(n)
        elif cls in ("gemm", "attention", "memory", "view"):
            if n.name in owner:
                per_block.setdefault(owner[n.name], []).append(n)
            else:
                rest.append(n)
    if fuse:
        _join_runs(graph, rest, per_block)
    return rest, per_block, exposed, alone


def _interleave(
    graph: fx.Graph, kind: str, chain: list[Any], pset: PartitionSet, fuse: bool
) -> None:
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    first_block = chain[0][1]
    # X: the nanobatch whose first segment runs first in this graph.
    x = min((0, 1), key=lambda nb: order[first_block[nb][0][0].issue.name])
    y = 1 - x
    segs: dict[int, list[Segment]] = {x: [], y: []}
    for i, (_block, cut) in enumerate(chain):
        for nb in (x, y):
            block_segs, tail = cut[nb]
            segs[nb].extend(block_segs)
            if i + 1 < len(chain):  # the residual tail joins the next block's first segment
                chain[i + 1][1][nb][0][0].compute[:0] = tail
    for k in range(len(segs[x])):
        for nb, overlapped in ((x, segs[y][k - 1] if k else None), (y, segs[x][k])):
            seg = segs[nb][k]
            coll = collective_cost(overlapped.issue) if overlapped and overlapped.issue else None
            key, slots = _type_of(pset, kind, seg.compute, coll, fuse)
            pset.partitions.append(
                Partition(
                    kind,
                    seg.block,
                    nb,
                    seg.index,
                    key,
                    tuple(n.name for n in seg.compute),
                    slots,
                    (overlapped.issue.name, overlapped.wait.name)
                    if overlapped and overlapped.issue and overlapped.wait
                    else None,
                )
            )


def _type_of(
    pset: PartitionSet, kind: str, compute: list[fx.Node], coll: CollectiveCost | None, fuse: bool
) -> tuple[str, tuple[Slot, ...]]:
    """Return the type of a partition of ``compute`` overlapping ``coll``, and its slots.

    A partition whose ops and collective match a known type's is of that type; else a new
    type is added, keyed by its instruction and number (``forward.2``).
    """
    slots = _slots(compute, fuse)
    costs = tuple(c for s in slots for c in s.ops)  # partition_costs, slots kept
    sig = _signature(costs, coll)
    for key, t in pset.types.items():
        if _signature(t.compute, t.collective) == sig:
            return key, slots
    key = f"{kind}.{sum(1 for t in pset.types.values() if t.instruction == kind)}"
    pset.types[key] = PartitionType(key, kind, costs, tuple(s.label for s in slots), coll)
    return key, slots


def _overlap_whole_blocks(
    graph: fx.Graph, kind: str, pset: PartitionSet, spans: dict[str, Any], fuse: bool
) -> bool:
    """Overlap collectives that run alone with compute of a whole block they need not wait for.

    A collective that reads nothing the compute before it produces (a weight all-gathered
    in the graph, as SimpleFSDP issues it before each use) can be issued earlier; one whose
    result nothing reads until later (the weight gradient's reduce-scatter) can be waited
    for later. Blocks left whole are cut at their own collectives into segments, as split
    blocks are; a collective takes the nearest segment that lies wholly after its input is
    ready and before its result is first read (reads through views and memory-bound ops
    count where those are read in turn, since they can move), and the two form a partition
    like the split's, with the same knobs (clock, launch slot, SM share). A segment leaves
    out the views and memory-bound ops that read a collective's result (they run after its
    wait); segments without a matmul hide next to nothing and take none. A segment
    overlaps one collective at most, and none where a collective still left alone runs
    inside it. Returns whether any partition was formed.
    """
    exposed = outside_nodes(graph, kind, pset, spans)[2]
    if not exposed:
        return False
    position = {n: i for i, n in enumerate(graph.nodes)}
    after = _after_waits(graph, exposed)
    windows: list[tuple[int, int, str, list[fx.Node]]] = []
    for block, per_nb in spans.items():
        if set(per_nb) != {None}:
            continue
        segs, tail = _segments(graph, per_nb[None], block, 0)
        for run in [s.compute for s in segs] + [tail]:
            compute = [n for n in run if n not in after]
            ran = [position[n] for n in compute if cost_of(n).op_class != "view"]
            if ran and any(cost_of(n).op_class in ("gemm", "attention") for n in compute):
                windows.append((min(ran), max(ran), block, compute))
    movable, needed_at = _movable(graph), _needed_at(graph, position)
    chosen: dict[fx.Node, int] = {}
    for issue in exposed:
        waits = [u for u in issue.users if cost_of(u).op_class == "collective_wait"]
        if len(waits) != 1:
            continue
        ready = max((position[i] for i in issue.all_input_nodes if i not in movable), default=-1)
        need, at = needed_at[waits[0]], position[issue]
        held = _held_back(issue, movable)
        fits = [
            (max(lo - at, at - hi), i)
            for i, (lo, hi, _b, compute) in enumerate(windows)
            if ready < lo and hi < need and i not in chosen.values() and held.isdisjoint(compute)
        ]
        if fits:
            chosen[issue] = min(fits)[1]
    # A window inside which a collective still runs alone would overlap two: drop it, and
    # again until none is left (dropping one leaves its collective alone where it ran).
    while bad := {
        c
        for c, i in chosen.items()
        if any(windows[i][0] < position[a] < windows[i][1] for a in exposed if a not in chosen)
    }:
        for c in bad:
            del chosen[c]
    for issue, i in sorted(chosen.items(), key=lambda item: windows[item[1]][0]):
        _lo, _hi, block, compute = windows[i]
        wait = next(u for u in issue.users if cost_of(u).op_class == "collective_wait")
        key, slots = _type_of(pset, kind, compute, collective_cost(issue), fuse)
        names = tuple(n.name for n in compute)
        pset.partitions.append(
            Partition(kind, block, 0, 0, key, names, slots, (issue.name, wait.name), whole=True)
        )
    return bool(chosen)


def _cheap(node: fx.Node) -> bool:
    return node.op == "call_function" and cost_of(node).op_class in ("view", "memory")


def _movable(graph: fx.Graph) -> set[fx.Node]:
    """Return the inputs, and the views and memory-bound ops of inputs alone."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") or (
            _cheap(n) and all(i in out for i in n.all_input_nodes)
        ):
            out.add(n)
    return out


def _held_back(issue: fx.Node, movable: set[fx.Node]) -> set[fx.Node]:
    """Return the ops before ``issue`` that feed it and cannot move up to the graph's start.

    A collective whose input is made from the graph's inputs by memory-bound ops can be
    issued early only with them: ops on inputs alone (a weight's cast) move up freely
    (:func:`~kareus.passes.annotate_costs.moves_freely`, as the overlap scheduler moves
    them), but one that reads another op (DDP's gradient copied and divided before its
    all-reduce, in compiled autograd's backward) stays where it is, so a window holding it
    cannot hold the collective launched before it.
    """
    seen: set[fx.Node] = set()
    stack = [i for i in issue.all_input_nodes if i in movable]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(i for i in n.all_input_nodes if i in movable)
    return {n for n in seen if not moves_freely(n)}


def _needed_at(graph: fx.Graph, position: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Return where each node's value is first needed.

    A view or memory-bound op that reads a value is needed where its own value is (it can
    move later with it); any other reader, or the graph's output, needs it where it stands.
    """
    at: dict[fx.Node, int] = {}
    for n in reversed(graph.nodes):
        at[n] = min((at[u] if _cheap(u) else position[u] for u in n.users), default=len(position))
    return at


def _after_waits(graph: fx.Graph, issues: list[fx.Node]) -> set[fx.Node]:
    """Return the views and memory-bound ops that read the result of one of ``issues``.

    Directly or through one another: a cast or copy of a collective's result (the gathered
    weight's view, the reduced gradient's cast back to fp32) runs after its wait, so it
    cannot sit in another collective's window that ends before that wait.
    """
    waits = {u for i in issues for u in i.users if cost_of(u).op_class == "collective_wait"}
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if _cheap(n) and any(i in waits or i in out for i in n.all_input_nodes):
            out.add(n)
    return out


def _signature(costs: tuple[OpCost, ...], coll: CollectiveCost | None) -> tuple[Any, ...]:
    ops = tuple((c.op_class, c.flops, c.bytes, c.dtype) for c in costs)
    return ops, (coll.kind, coll.bytes, coll.world_size, coll.nodes) if coll else None

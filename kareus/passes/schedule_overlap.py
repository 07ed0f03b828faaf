"""Reorder the AOT graphs so that each collective overlaps the other nanobatch's compute.

For every partition, the collective's issue node is moved to the start of the decided
launch slot inside the partition's compute, and its wait to the end of the partition; a
"no overlap" decision issues and waits right where the collective's input is ready. The
decision's SM share selects the collective's communicator (process group) from the pool.
Without a plan, every type gets the published nanobatching default: launch at the start of
the partition, default communicator.

Reordering is a stable topological sort by desired position, so data dependencies always
hold; the pass checks afterwards that every issue has its wait after it.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

import torch.fx as fx

from kareus.ir.partitions import Decision, PartitionSet
from kareus.passes.annotate_costs import moves_freely
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.census import collective_kind, is_wait
from kareus.runtime.comm_pool import CommunicatorPool

DEFAULT_DECISION = Decision(launch_slot=0, sm_share=None)


def decision_for(decisions: Mapping[str, Decision], key: str) -> Decision:
    """Return the decision for a type: its own, else the ``"*"`` entry, else the default."""
    return decisions.get(key, decisions.get("*", DEFAULT_DECISION))


class ScheduleOverlap(GraphPass):
    """Move collectives' issue and wait nodes to the decided positions."""

    name = "schedule_overlap"
    graphs = frozenset({"forward", "backward", "inference"})
    reads = frozenset({"cut_partitions"})
    after = frozenset({"check_plan"})  # applies the decisions the plan check kept

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Reorder ``gm``; report a change only when the node order moved."""
        pset = ctx.findings.partitions
        if pset is None or not any(p.instruction == ctx.graph for p in pset.partitions):
            return PassResult(gm, modified=False)
        check = ctx.findings.plan_check
        decisions: Mapping[str, Decision] = (
            check.decisions
            if check is not None and check.decisions is not None
            else ctx.inputs.decisions or {}
        )
        pool: CommunicatorPool | None = ctx.inputs.communicator_pool
        before = [n.name for n in gm.graph.nodes]
        regroup = rewrite_schedule(gm.graph, ctx.graph, pset, decisions, pool)
        return PassResult(gm, modified=regroup or before != [n.name for n in gm.graph.nodes])

    def ensures(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Every collective issue is followed, later in the graph, by its wait."""
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in gm.graph.nodes:
            if collective_kind(node) is not None:
                waits = [u for u in node.users if is_wait(u)]
                if not waits or any(order[w] < order[node] for w in waits):
                    raise ValueError(f"collective {node.name} has no wait after it")


def desired_order(
    graph: fx.Graph, kind: str, pset: PartitionSet, decisions: Mapping[str, Decision]
) -> list[str]:
    """Return the partition nodes (compute, issues, waits) in the order the decisions ask."""
    by_name = {n.name: n for n in graph.nodes}
    seq: list[str] = []
    for part in (p for p in pset.partitions if p.instruction == kind):
        dec = decision_for(decisions, part.type_key)
        slot = None if dec.launch_slot is None else min(dec.launch_slot, len(part.slots) - 1)
        issue, wait = part.collective if part.collective else (None, None)
        if issue and slot is None:
            seq += [issue, wait]  # type: ignore[list-item]
        starts = {s.first: i for i, s in enumerate(part.slots)}
        for name in part.compute:
            if issue and slot is not None and starts.get(name) == slot:
                seq.append(issue)
            seq.append(name)
        if issue and slot is not None:
            if issue not in seq:  # an empty slot list: issue at the start
                seq.insert(len(seq) - len(part.compute), issue)
            seq.append(wait)  # type: ignore[arg-type]
    return [n for n in seq if n in by_name]


def rewrite_schedule(
    graph: fx.Graph,
    kind: str,
    pset: PartitionSet,
    decisions: Mapping[str, Decision],
    pool: CommunicatorPool | None = None,
) -> bool:
    """Reorder ``graph`` per the decisions; return whether a communicator was changed."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    wanted = [by_name[n] for n in desired_order(graph, kind, pset, decisions)]
    key: dict[fx.Node, float] = {n: float(i) for n, i in index.items()}
    placed = set(wanted)
    if wanted:
        lo = min(index[n] for n in wanted)
        hi = max(index[n] for n in wanted)
        step = (hi - lo) / max(len(wanted), 1)
        for j, n in enumerate(wanted):
            key[n] = lo + j * step
    # Other nodes follow their latest input (a residual add after a wait goes with it)...
    for n in nodes:
        if n not in placed and n.all_input_nodes:
            key[n] = max(key[n], max(key[i] for i in n.all_input_nodes) + 1e-6)
    # ... and are wanted no later than their earliest user, so that a size computation or a
    # view shared by both nanobatches (AOT de-duplicates them) never holds back the
    # partition node that needs it. Free nodes (views, work on parameters alone) may move
    # up the same way even when a partition lists them.
    for n in reversed(nodes):
        if n.users and (n not in placed or moves_freely(n)):
            key[n] = min(key[n], min(key[u] for u in n.users))
    _reorder(graph, nodes, key)
    if pool is None:
        return False
    requests = []
    for part in (p for p in pset.partitions if p.instruction == kind and p.collective):
        share = decision_for(decisions, part.type_key).sm_share
        if share is not None:
            requests.append((by_name[part.collective[0]], share))  # type: ignore[index]
    return pool.regroup(requests)


def _reorder(graph: fx.Graph, nodes: list[fx.Node], key: dict[fx.Node, float]) -> None:
    """Stable topological sort by ``key``; placeholders stay first, output last."""
    indegree = {n: len(set(n.all_input_nodes)) for n in nodes}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for i in set(n.all_input_nodes):
            users[i].append(n)
    heap = [(key[n], i, n) for i, n in enumerate(nodes) if indegree[n] == 0]
    heapq.heapify(heap)
    position = {n: i for i, n in enumerate(nodes)}
    out: list[fx.Node] = []
    while heap:
        _k, _i, n = heapq.heappop(heap)
        out.append(n)
        for u in users[n]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(heap, (key[u], position[u], u))
    if len(out) != len(nodes):
        raise ValueError("the graph has a cycle; cannot reorder")
    placeholders = [n for n in out if n.op == "placeholder"]
    rest = [n for n in out if n.op != "placeholder"]
    cursor = placeholders[-1] if placeholders else None
    for n in rest:
        if cursor is not None:
            cursor.append(n)  # moves n right after cursor
        cursor = n

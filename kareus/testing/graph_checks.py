"""What kareus did to a compiled region: blocks split, collectives overlapped, clocks set.

Read from the graphs that run (the rewritten FX graphs, or the code Inductor generated
from them), so that a test asserts the work was done, not only that results are equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kareus._torch_internals import HigherOrderOperator
from kareus.passes.census import (
    COLLECTIVE_NAMESPACES,
    collective_kind,
    collective_kind_of,
    is_functional_collective,
    is_wait,
    is_wait_of,
)


def overlap_problems(region: Any) -> list[str]:
    """Say where a compiled region's graphs do not overlap its partitions' collectives.

    For each partition, its collective must be issued before the last of the partition's
    compute and waited for after all of it, in the graph as it runs (empty: all are).
    ``region``: one of ``kareus.explain(model).regions``.
    """
    problems = []
    pset = region.findings.partitions
    lines = {kind: node_lines(graph.final_code) for kind, graph in region.graphs.items()}
    for part in (p for p in pset.partitions if p.collective):
        at = lines[part.instruction]
        issue, wait = part.collective
        ran = [at[n] for n in part.compute if n in at]
        if not ran or not (at[issue] < max(ran) and at[wait] > max(ran)):
            problems.append(
                f"{part.instruction} {part.block}: {issue}/{wait} not around its compute"
            )
    return problems


def _running_graph(region: Any, kind: str | None) -> torch.fx.GraphModule | None:
    """Return the rewritten graph of ``kind`` that runs (default: forward, else inference)."""
    for k in (kind,) if kind else ("forward", "inference"):
        record = region.graphs.get(k)
        if record is not None and record.final is not None:
            return record.final  # type: ignore[no-any-return]
    return None


def split_blocks(region: Any, kind: str | None = None) -> list[str]:
    """Return the blocks the region's graph computes as two nanobatch copies, as it runs.

    Read from the rewritten graph that runs (the forward's, or ``kind``'s), not from what
    the split pass recorded: a block is split when its compute ops appear tagged with
    nanobatch 0 and with nanobatch 1, every op of the first copy in the second (which holds
    more where the block is split along the sequence: the second half's attention joins
    the first half's keys and values under a mask). In graph order. An
    activation-checkpointed layer's ops are there too: each nanobatch's copy calls a body of
    its own, whose tags AOTAutograd carries onto the ops it inlines. ``region``: one of
    ``kareus.explain(model).regions``.
    """
    gm = _running_graph(region, kind)
    if gm is None:
        return []
    copies = _nanobatch_copies(gm)
    return [b for b, (first, second) in copies.items() if first and not first - second]


def _nanobatch_copies(gm: torch.fx.GraphModule) -> dict[str, tuple[Any, Any]]:
    """Count each block's compute ops per nanobatch copy (graphs it calls included)."""
    from collections import Counter

    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    copies: dict[str, tuple[Counter[str], Counter[str]]] = {}
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    for node in nodes:
        tag = get_tag(node)
        if node.op != "call_function" or tag is None or tag.nanobatch not in (0, 1):
            continue
        body = isinstance(node.target, HigherOrderOperator)  # a checkpointed body
        if (moves_freely(node) and not body) or is_functional_collective(node):
            continue
        copies.setdefault(tag.block, (Counter(), Counter()))[tag.nanobatch][str(node.target)] += 1
    return copies


def blocks_run(region: Any) -> Any:
    """Return the region's blocks (``findings.blocks``) once the graph confirms them.

    The blocks kareus records as split must be the blocks the graph that runs computes in
    two nanobatch copies (:func:`split_blocks`): a record the graph does not bear out fails
    here (AssertionError). Tests read what was split through it, never the record alone.
    """
    recorded = region.findings.blocks
    if _running_graph(region, None) is not None:
        ran = split_blocks(region)
        assert set(ran) == set(recorded.split), (
            f"kareus records {recorded.split} as split; the graph that runs splits {ran}"
        )
    return recorded


def clocks_on_device(runtime: Any) -> list[float]:
    """Return the clocks the runtime's device was set to, in order (resets left out).

    Read from the device (an emulated GPU's ``history``), not the runtime's records: a
    runtime that records a switch and sets nothing shows nothing here.
    """
    history = getattr(runtime.controller, "history", None)
    assert history is not None, (
        f"the {runtime.controller.name} controller keeps no history: test on an emulated GPU"
    )
    return [f for f in history if f is not None]


def overlapped_collectives(region: Any, kind: str = "forward") -> list[str]:
    """Return the collectives of the running ``kind`` graph that fly over the other copy.

    A collective flies over the other nanobatch's compute when a compute op of the other
    nanobatch runs between its issue and its wait.

    Read from the order of the rewritten graph that runs (what the python codegen runs op
    by op, and what Inductor is given); :func:`inductor_windows` reads Inductor's code.
    """
    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    gm = _running_graph(region, kind)
    if gm is None:
        return []
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    flying = []
    for node in nodes:
        if collective_kind(node) is None:
            continue
        nanobatch = _nanobatch_of(node)
        waits = [u for u in node.users if is_wait(u)]
        if nanobatch is None or not waits:
            continue
        between = nodes[at[node] + 1 : min(at[w] for w in waits)]
        other = [
            n
            for n in between
            if n.op == "call_function"
            and not moves_freely(n)
            and not is_functional_collective(n)
            and (t := get_tag(n)) is not None
            and t.nanobatch == 1 - nanobatch
        ]
        if other:
            flying.append(node.name)
    return flying


def flying_when_run(step: Any) -> list[str]:
    """Run ``step()``; return the collectives that flew over other ops as the ops ran.

    Read from what executes, not from any graph: PyTorch's profiler records every op
    ``step`` runs, in every thread (the backward's too), and a collective counts when an
    ATen op started after its launch returned and before the first wait after it (the ops
    the collective runs inside itself do not count). A runner that waits on each
    collective at once (whatever the graph's order) shows none. (A dispatch mode would not
    do: Dynamo's guards see it and run another graph.)
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ran = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.name.startswith("aten::") or collective_kind_of(e.name) or is_wait_of(e.name)
    )
    flying = []
    for i, (_start, launched, name) in enumerate(ran):
        kind = collective_kind_of(name)
        if kind is None:
            continue
        later = [(t, n) for t, _end, n in ran[i + 1 :] if t >= launched]  # not its own ops
        waited = next((t for t, n in later if is_wait_of(n)), None)
        if any(n.startswith("aten::") and (waited is None or t < waited) for t, n in later):
            flying.append(f"{kind}#{i}")
    return flying


def _nanobatch_of(node: torch.fx.Node) -> int | None:
    """Return the nanobatch of the nearest tagged ops ``node`` reads (collectives have none)."""
    from kareus.passes.tags import get_tag

    seen, frontier = set(), list(node.all_input_nodes)
    while frontier:
        found = {t.nanobatch for n in frontier if (t := get_tag(n)) and t.nanobatch in (0, 1)}
        if found:
            return found.pop() if len(found) == 1 else None
        seen.update(frontier)
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
    return None


@dataclasses.dataclass
class Window:
    """One collective in Inductor's code: its line, its nanobatch, what runs while it flies.

    Attributes:
        issue: the line that launches the collective.
        nanobatch: the nanobatch it belongs to (None: unknown or shared).
        overlapped: the kernel lines of the other nanobatch between its launch and wait.
        waited: whether its wait follows in the same code.
    """

    issue: str
    nanobatch: int | None
    overlapped: list[str]
    waited: bool


_ISSUE = re.compile(
    r"(?:(\w+) = )?torch\.ops\.("
    + "|".join(map(re.escape, COLLECTIVE_NAMESPACES))
    + r")\.(\w+)\.default\(([^,)]*)"
)
"""A functional collective's issue or wait in Inductor's code: (result, namespace, op, first
argument); which it is, the census's classifier says (:func:`_classified`)."""
_CALL = re.compile(r"^\s*(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|torch\.ops\.\w+)")
_BUFFER = re.compile(r"\bbuf\d+\b")


@contextlib.contextmanager
def inductor_buffers() -> Iterator[list[dict[str, list[torch.fx.Node]]]]:
    """Record, meanwhile, the graph nodes each buffer of Inductor's code was made from.

    Yields a list that gets one dict per graph Inductor schedules, in the order it compiles
    them (as ``run_and_get_code`` lists their code), by buffer name as in its code: read
    one with :func:`inductor_windows`. Inductor's FX graph cache is off meanwhile (a cache
    hit schedules nothing).
    """
    from kareus._torch_internals import inductor_config as _config

    inductor_config = _config()

    graphs: list[dict[str, list[torch.fx.Node]]] = []

    def record(nodes: list[Any]) -> list[Any]:
        made: dict[str, list[torch.fx.Node]] = {}
        graphs.append(made)
        for fused in nodes:
            for node in fused.get_nodes():
                origins = list(getattr(getattr(node, "node", None), "origins", ()) or ())
                for name in node.get_buffer_names():
                    made[name] = origins
        return nodes

    with inductor_config.patch(_post_fusion_custom_pass=record, fx_graph_cache=False):
        yield graphs


def _classified(op: re.Match[str] | None) -> str | None:
    """Return "wait", the collective's kind, or None (no collective) of a matched call."""
    if op is None:
        return None
    qualified = f"{op.group(2)}::{op.group(3)}"
    if is_wait_of(qualified):
        return "wait"
    return collective_kind_of(qualified)


def inductor_windows(code: str, made: Mapping[str, Sequence[torch.fx.Node]]) -> list[Window]:
    """Return the collectives of Inductor's ``code``, each with what overlaps it.

    ``made``: the graph nodes each buffer was made from (:func:`inductor_buffers`). A
    kernel's nanobatch is that of the ops (their kareus tags) that made the buffers it
    reads and writes; a collective's, that of its buffer; its wait is the
    ``wait_tensor`` of that buffer.
    """
    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    def nanobatch(line: str) -> int | None:
        nodes = [n for b in _BUFFER.findall(line) for n in made.get(b, ())]
        nodes = [n for n in nodes if not is_functional_collective(n)]
        # Views serve both nanobatches: the ops that compute say which one a kernel is,
        # unless none is tagged.
        computing = [n for n in nodes if n.op == "call_function" and not moves_freely(n)]
        for group in (computing, nodes):
            found = {t.nanobatch for n in group if (t := get_tag(n)) and t.nanobatch is not None}
            if found:
                return found.pop() if len(found) == 1 else None
        return None

    events: list[tuple[str, int | None, str, str]] = []  # (kind, nanobatch, buffer, line)
    for line in code.splitlines():
        if not _CALL.match(line):
            continue
        op = _ISSUE.search(line)
        kind = _classified(op)
        if op is None or kind is None:
            events.append(("compute", nanobatch(line), "", line.strip()))
        elif kind == "wait":
            events.append(("wait", None, _buffer(op.group(4)), line.strip()))
        else:
            buffer = _buffer(op.group(4))
            events.append(("issue", nanobatch(buffer), op.group(1) or buffer, line.strip()))
    windows = []
    for i, (kind, nb, buffer, line) in enumerate(events):
        if kind != "issue":
            continue
        end = next(
            (j for j in range(i + 1, len(events)) if events[j][0::2] == ("wait", buffer)), None
        )
        between = events[i + 1 : end] if end is not None else []
        other = [t for k, n, _b, t in between if k == "compute" and nb is not None and n == 1 - nb]
        windows.append(Window(line, nb, other, end is not None))
    return windows


def _buffer(arg: str) -> str:
    """Return the buffer an argument of Inductor's code names (``reinterpret_tensor(buf3``)."""
    return arg.replace("reinterpret_tensor(", "").strip()


def node_lines(code: str) -> dict[str, int]:
    """Return the line of each node's assignment in a graph's code (its place in the order)."""
    at = {}
    for i, line in enumerate(code.splitlines()):
        name, _, rest = line.strip().partition(" = ")
        if rest and name.isidentifier():
            at[name] = i
    return at

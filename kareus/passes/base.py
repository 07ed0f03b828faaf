"""The pass infrastructure: a pass base class with checked conditions, and the runner.

A pass takes a GraphModule and returns one together with an honest "modified" flag. The
runner checks the pass's pre- and post-conditions, verifies the flag against the graph's
structure, records name, duration and node counts, and turns any failure into a
:class:`~kareus.errors.PassError` that names the pass, the graph, the node and the passes
already run.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch.fx as fx

from kareus.errors import NodeError, PassError
from kareus.passes import census as _census
from kareus.passes.findings import Findings


class PassConfig(Protocol):
    """What the passes read of the compile call's settings.

    ``kareus.compiler.config.Config`` has them all; declared here, so that the passes need
    nothing from the compiler above them.
    """

    @property
    def nanobatches(self) -> int | None:
        """Nanobatches per block (None: the default choice)."""

    @property
    def batch_dim(self) -> int | None:
        """The inputs' batch dimension (None: 0)."""

    @property
    def split_along(self) -> str:
        """The dimension blocks are split along: "auto", "batch" or "sequence"."""

    @property
    def allow_random_split(self) -> bool:
        """Whether blocks that draw random numbers may be split."""

    @property
    def disable_passes(self) -> tuple[str, ...]:
        """Names of passes not to run."""

    @property
    def extract_partitions(self) -> bool:
        """Whether partition types are kept as runnable programs."""

    @property
    def fuses_memory_ops(self) -> bool:
        """Whether runs of memory-bound ops are costed as fused kernels."""

    @property
    def gpus_per_node(self) -> int | None:
        """GPUs an NVLink domain joins."""

    @property
    def strict(self) -> bool | None:
        """Whether a failed pass or a plan mismatch raises."""

    @property
    def inductors_graphs(self) -> bool:
        """Whether the graphs are Inductor's (its decompositions and joint-graph passes)."""


@dataclasses.dataclass(frozen=True)
class RegionInputs:
    """What the compiler supplies a region's passes: read, never written, by them.

    Attributes:
        index: the region's number, unique in the process (clock switch sites use it).
        code: the function a layer's region was traced from, when it is one whole call of
            it (per-block compile), else None.
        compiled_autograd: whether the region is a backward graph of compiled autograd.
        plan: the plan being applied (None: none).
        plan_stage: the pipeline stage of the plan this model runs.
        planned: the plan was made for this very region at compile time (nothing to check).
        decisions: the overlap decisions to apply, by partition type (``"*"``: all), as
            given: ``check_plan`` finds those that fit the region
            (:class:`~kareus.passes.findings.PlanCheck`), which ``schedule_overlap`` applies.
        clock_runtime: the clock runtime switches go to (None: no clock plan).
        clock_stage: the stage whose clock steps this region's switches count.
        communicator_pool: the communicators that overlap collectives use (None: default).
        pricing: what prices whether a block's split pays: a GPU type, ``"host"`` (this
            CPU), or None where the split is not priced (forced, or a plan's).
        priced: the verdicts of an earlier lowering of this region, per block (split or
            not, and what was predicted); they stand, and are not priced again.
    """

    index: int = 0
    code: str | None = None
    compiled_autograd: bool = False
    plan: Any = None
    plan_stage: int = 0
    planned: bool = False
    decisions: Any = None
    clock_runtime: Any = None
    clock_stage: int = 0
    communicator_pool: Any = None
    pricing: str | None = None
    priced: Mapping[str, tuple[bool, str]] | None = None


GRAPH_KINDS = ("dynamo", "forward", "backward", "inference")
"""The graphs of one compiled region: Dynamo's (before autograd) and AOTAutograd's three."""


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed it.

    Attributes:
        gm: the graph module after the pass.
        modified: whether the pass changed the graph (checked against its code).
        collectives: the live collectives the graph holds after the pass
            (:func:`kareus.passes.census.census`), when the pass changed them on purpose
            (the nanobatch split doubles a split block's); None means "unchanged". The
            runner fails the pass when the graph's count differs.
        found: what the pass found, stored by the runner in the region's findings under
            the field the pass declares (:attr:`GraphPass.finds`); None: nothing new.
    """

    gm: fx.GraphModule
    modified: bool
    collectives: collections.Counter[_census.Key] | None = None
    found: Any = None


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One entry of a region's pass history."""

    name: str
    graph: str
    status: str  # "ran", "disabled" or "failed"
    modified: bool = False
    duration_s: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    error: str = ""


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides its graph.

    Attributes:
        config: the compile call's configuration.
        graph: which graph of the region this is (one of :data:`GRAPH_KINDS`).
        findings: what the passes of one compiled region found (the blocks ``find_blocks``
            found, read later by the AOT passes), typed; the runner stores each pass's
            result there, and a pass reads those it declares (:attr:`GraphPass.reads`).
        example_inputs: the example inputs the graph was captured with.
        passes_run: names of the passes already run on this graph.
        inputs: what the compiler supplies (plan, decisions, clock runtime...).
    """

    config: PassConfig
    graph: str
    findings: Findings
    example_inputs: Sequence[Any] = ()
    passes_run: list[str] = dataclasses.field(default_factory=list)
    inputs: RegionInputs = dataclasses.field(default_factory=RegionInputs)


class GraphPass(abc.ABC):
    """Base class of every kareus graph pass.

    Subclasses set :attr:`name` and :attr:`graphs`, declare :attr:`reads` and :attr:`after`,
    implement :meth:`run`, and may add checks in :meth:`requires` (before) and
    :meth:`ensures` (after; the runner always lints). A pass that finds something
    declares the field of :class:`~kareus.passes.findings.Findings` it fills
    (:attr:`finds`) and returns the finding (``PassResult.found``); the runner stores it.
    ``PIPELINE`` is checked against the declarations (:func:`check_order`).
    """

    name: ClassVar[str]
    graphs: ClassVar[frozenset[str]]
    reads: ClassVar[frozenset[str]] = frozenset()
    """The passes whose findings this one reads (they must run before it)."""
    after: ClassVar[frozenset[str]] = frozenset()
    """Passes that must run before this one although it reads nothing of theirs (their
    rewrites of the graph)."""
    finds: ClassVar[str | None] = None
    """The field of :class:`~kareus.passes.findings.Findings` the pass fills (a name not
    among its fields, or None for the pass's own name: an entry of ``Findings.extra``)."""

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:  # noqa: B027
        """Raise :class:`NodeError` or ``ValueError`` when ``gm`` lacks what the pass needs."""

    @abc.abstractmethod
    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Rewrite or analyse ``gm``; return the result and an honest ``modified`` flag."""

    def ensures(self, gm: fx.GraphModule, ctx: PassContext) -> None:  # noqa: B027
        """Raise when the rewritten ``gm`` breaks a promise of the pass."""


def check_order(passes: Sequence[GraphPass]) -> None:
    """Raise ValueError when ``passes`` break their declarations.

    Every name unique; every pass a pass reads or runs after is in the list, earlier.
    """
    seen: set[str] = set()
    for p in passes:
        if p.name in seen:
            raise ValueError(f"pass {p.name!r} is in the pipeline twice")

        missing = sorted((p.reads | p.after) - seen)
        if missing:
            raise ValueError(
                f"pass {p.name!r} must run after {', '.join(missing)}, which "
                f"{'do' if len(missing) > 1 else 'does'} not run before it"
            )
        seen.add(p.name)


def structure(graph: fx.Graph) -> list[tuple[Any, ...]]:
    """Return what the graph computes, node by node: name, op, target, arguments.

    Equal structures (:func:`same_structure`) generate equal code; comparing them costs a
    fraction of generating the code (which the runner did before and after every pass).
    """
    return [(n.name, n.op, n.target, n.args, n.kwargs) for n in graph.nodes]


def same_structure(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Return whether two :func:`structure` records describe the same computation.

    A node a pass left alone keeps its very argument tuple, so arguments are rendered
    (by node name) only where they are not the same object.
    """
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x[0] != y[0] or x[1] != y[1] or (x[2] is not y[2] and x[2] != y[2]):
            return False
        for i in (3, 4):
            if x[i] is not y[i] and _rendered(x[i]) != _rendered(y[i]):
                return False
    return True


def _rendered(args: Any) -> str:
    return repr(fx.node.map_arg(args, lambda n: n.name))


def run_passes(
    gm: fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run the passes that apply to ``ctx.graph`` in order.

    Returns:
        The final graph module and one record per pass that applied (disabled ones included).

    Raises:
        PassError: a pass failed a condition, raised, or reported no change but changed
            the graph. ``error.records`` holds the records made so far.
    """
    records: list[PassRecord] = []
    counted: tuple[Any, Any] | None = None  # the graph's collectives and their sizes
    for p in passes:
        if ctx.graph not in p.graphs:
            continue
        if p.name in ctx.config.disable_passes:
            records.append(PassRecord(p.name, ctx.graph, "disabled"))
            continue
        before = structure(gm.graph)
        nodes_before = len(before)
        start = time.perf_counter()
        try:
            # counted once, and again only after a pass that changed the graph
            counted = counted or (_census.census(gm), _census.volume(gm))
            p.requires(gm, ctx)
            result = p.run(gm, ctx)
            result.gm.graph.lint()
            p.ensures(result.gm, ctx)
            unchanged = same_structure(structure(result.gm.graph), before)
            if not result.modified and not unchanged:
                raise ValueError("the pass reported no change but changed the graph")
            if not unchanged or result.collectives is not None:
                counted = (
                    _check_collectives(counted[0], result),
                    _check_sizes(counted[1], result),
                )
        except Exception as exc:
            err = _as_pass_error(p.name, ctx, exc)
            records.append(
                PassRecord(
                    p.name,
                    ctx.graph,
                    "failed",
                    duration_s=time.perf_counter() - start,
                    nodes_before=nodes_before,
                    error=str(err),
                )
            )
            err.records = records  # type: ignore[attr-defined]
            raise err from exc
        gm = result.gm
        if result.modified:
            gm.recompile()
        if result.found is not None:
            ctx.findings.store(p.finds or p.name, result.found)
        records.append(
            PassRecord(
                p.name,
                ctx.graph,
                "ran",
                modified=result.modified,
                duration_s=time.perf_counter() - start,
                nodes_before=nodes_before,
                nodes_after=len(gm.graph.nodes),
            )
        )
        ctx.passes_run.append(p.name)
    return gm, records


def _check_collectives(
    before: collections.Counter[_census.Key], result: PassResult
) -> collections.Counter[_census.Key]:
    """Raise when the pass lost (or added) collectives it did not announce; return them."""
    expected = before if result.collectives is None else result.collectives
    after = _census.census(result.gm)
    missing, extra = _census.lost(expected, after), _census.lost(after, expected)
    if missing or extra:
        parts = [f"lost {_census.describe(missing)}"] if missing else []
        parts += [f"added {_census.describe(extra)}"] if extra else []
        raise ValueError(
            "the pass changed the graph's collectives: "
            + "; ".join(parts)
            + " (a lost collective means wrong results, so the rewrite is refused)"
        )
    return after


def _check_sizes(
    before: dict[_census.VolumeKey, Any], result: PassResult
) -> dict[_census.VolumeKey, Any]:
    """Raise when the pass changed how much its collectives move (a split conserves it)."""
    after = _census.volume(result.gm)
    changed = _census.resized(before, after)
    if changed:
        raise ValueError(
            "the pass changed the sizes of the graph's collectives: "
            + "; ".join(changed)
            + " (a collective resized or swapped for another tensor's moves the wrong data, "
            "so the rewrite is refused)"
        )
    return after


def _as_pass_error(name: str, ctx: PassContext, exc: Exception) -> PassError:
    if isinstance(exc, PassError):
        return exc
    node = exc.node if isinstance(exc, NodeError) else None
    message = exc.message if isinstance(exc, NodeError) else f"{type(exc).__name__}: {exc}"
    return PassError(name, ctx.graph, message, node=node, passes_run=ctx.passes_run)

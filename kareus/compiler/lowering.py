"""Lowering a region through AOTAutograd with kareus's graph compilers.

The backend (:mod:`kareus.compiler.backend`) runs the structural passes on the Dynamo graph;
this module hands the result to AOTAutograd (TorchInductor:
:mod:`kareus.compiler.inductor_lowering`), checks on the way that no collective was lost,
traces repeated blocks once where that compiles faster, and lowers a region per batch size
when the batch is its only symbolic size. Which passes run on each graph is the caller's
(``run_passes``); what happens once both training graphs exist is too (``on_graphs``).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import (
    InductorLowering,
    inductor_lowering,
    input_mutation_check_off,
    outlining_problem,
)
from kareus.compiler.config import Config
from kareus.compiler.region import Region
from kareus.errors import PassError
from kareus.passes.batch_dims import MIN_NANOBATCH
from kareus.passes.census import Key, as_side, census, collective_kind, describe, is_wait, lost
from kareus.passes.outline import (
    check_no_random,
    inline_bodies,
    is_outlined,
    outline_blocks,
)
from kareus.passes.subgraphs import copy_graph

_log = logging.getLogger(__name__)

RunPasses = Callable[[str, fx.GraphModule, Sequence[Any]], fx.GraphModule]
"""Runs kareus's passes on one graph of a kind ("forward", "backward", "inference")."""

Compiled = dict[str, tuple[fx.GraphModule, Sequence[Any], fx.GraphModule]]
"""Per graph kind: the graph AOTAutograd made, its inputs, and the graph that runs."""

OnPartition = Callable[[Mapping[str, fx.GraphModule]], None]
"""Sees a region's forward and backward as partitioned, before any pass; may raise
:class:`StopLowering`."""


class StopLowering(Exception):
    """Raised by an ``on_partition`` hook to end a lowering: no fallback lowering is tried."""


AUTO_OUTLINE_CALLS = 16
"""Calls of one block body from which tracing it once compiles faster than tracing each.

Each traced body carries a fixed cost (its schema, a backward per gradient layout), so a
few calls compile faster traced op by op; the measurements behind 16 are in
docs/limits.md ("The split needs Dynamo's graph")."""

SPECIALISATIONS_WARNED = 8
"""Batch sizes a region is lowered for before kareus says that each new one costs a compile."""


def lower_with_aot(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: Config,
    region: Region,
    run_passes: RunPasses,
    on_graphs: Callable[[Compiled], None],
    on_partition: OnPartition | None = None,
) -> Callable[..., Any]:
    """Hand the Dynamo graph to AOTAutograd with kareus's compilers; return what runs.

    ``on_graphs`` is called once the backward is compiled (both training graphs exist); it
    may replace their rewritten graphs, which the returned functions look up at each call.
    ``on_partition`` sees both as partitioned, before any pass (it may raise).

    Raises:
        LostCollectivesError: AOTAutograd's graphs lack a collective the Dynamo graph
            holds (checked on the joint graph, or on the inference graph).
    """
    from functorch.compile import make_boxed_func

    from kareus._torch_internals import aot_autograd_backend as aot_autograd

    expected = census(gm)
    compiled: Compiled = {}
    # Forward runs before the backward was compiled (at the first backward): a plan made then
    early = {"forward": 0, "open": 1}  # counts them, as their clock switch did not run

    def compiler(kind: str, g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        if kind == "inference":
            check_no_random(g, bodies_only=True)
            inline_bodies(g)
            check_lowered(g, expected, "inference")
        compiled[kind] = (g, inputs, run_passes(kind, g, inputs))
        if kind == "backward" and "forward" in compiled:
            region.early_forward_runs, early["open"] = early["forward"], 0
            on_graphs(compiled)

        def run(*args: Any) -> Any:  # looks the graph up: planning may replace it
            if kind == "forward" and early["open"]:
                early["forward"] += 1
            return compiled[kind][2](*args)

        return make_boxed_func(run)

    inductor = _inductor_stages(config, region)

    def lower(graph: fx.GraphModule, outlined: bool = False) -> Callable[..., Any]:
        return aot_autograd(  # type: ignore[no-any-return]
            fw_compiler=functools.partial(compiler, "forward"),
            bw_compiler=functools.partial(compiler, "backward"),
            inference_compiler=functools.partial(compiler, "inference"),
            **_partitioning(expected, outlined, config.min_cut, inductor, on_partition),
        )(graph, example_inputs)

    outlined, calls, shared = _outlined(gm, config, region)
    if not calls:
        return lower(gm)
    return _lower_outlined(lower, gm, outlined, region, compiled, (calls, shared))


def _lower_outlined(
    lower: Callable[..., Callable[..., Any]],
    gm: fx.GraphModule,
    outlined: fx.GraphModule,
    region: Region,
    compiled: Compiled,
    counts: tuple[int, int],
) -> Callable[..., Any]:
    """Lower ``outlined`` (its blocks traced once); where that fails, ``gm`` op by op."""
    history = len(region.history)
    try:
        # The tracing context is where invoke_subgraph keeps the traced bodies.
        # No outlined body writes a tensor in place (outline_blocks), so invoke_subgraph's
        # per-call re-trace looking for input mutation, most of the trace's time, is skipped.
        with tracing_context(), input_mutation_check_off(), warnings.catch_warnings():
            # A body's backward traced again for other gradient layouts: expected.
            warnings.filterwarnings("ignore", "invoke_subgraph traced multiple backward")
            fn = lower(outlined, outlined=True)
    except StopLowering:
        raise
    except Exception as err:
        del region.history[history:]
        compiled.clear()
        region.notes.append(
            f"blocks traced one by one: tracing each repeated block once failed "
            f"({type(err).__name__}: {err})"
        )
        _log.info("region %d: outlined lowering failed: %s", region.index, err)
        return lower(gm)
    calls, shared = counts
    region.notes.append(
        f"{calls} block calls traced through AOTAutograd from {shared} shared "
        f"bod{'y' if shared == 1 else 'ies'} (Config.trace_blocks_once)"
    )
    return fn


def _partitioning(
    expected: Counter[Key],
    outlined: bool,
    min_cut: bool,
    inductor: InductorLowering | None,
    on_partition: OnPartition | None = None,
) -> dict[str, Any]:
    """AOTAutograd's partition function (and decompositions) for kareus's lowering."""
    partition = functools.partial(
        checked_partition, expected, outlined=outlined, min_cut=min_cut, on_partition=on_partition
    )
    if inductor is None:
        return {"partition_fn": partition}
    return {  # Inductor's graphs: its decompositions, its joint-graph passes, then ours
        "decompositions": inductor.decompositions,
        "partition_fn": functools.partial(inductor.partition_fn, partitioner_fn_override=partition),
    }


def _inductor_stages(config: Config, region: Region) -> InductorLowering | None:
    """Return Inductor's stages where the python codegen runs its graphs (else None)."""
    if not config.inductor_graphs:
        return None
    found = inductor_lowering()
    if found is None:
        region.warn(
            f"inductor_graphs=True: torch {torch.__version__}'s Inductor has no partition "
            "step that takes a partitioner; AOTAutograd's plain graphs run instead"
        )
    return found


def _outlined(
    gm: fx.GraphModule, config: Config, region: Region
) -> tuple[fx.GraphModule, int, int]:
    """Return ``gm`` with its blocks outlined, the calls and the bodies (no calls: ``gm``).

    Not outlined where ``Config.trace_blocks_once`` is False, where too few blocks repeat,
    or where this PyTorch cannot lower outlined blocks soundly (warned once, noted).
    """
    once = config.trace_blocks_once
    if once is False:
        return gm, 0, 0
    outlined, calls, shared = outline_blocks(gm, min_calls=2 if once else AUTO_OUTLINE_CALLS)
    if calls and (problem := outlining_problem()) is not None:
        _warn_internals(f"blocks are traced one by one: {problem}")
        region.notes.append(f"blocks traced one by one: {problem}")
        return gm, 0, 0
    return outlined, calls, shared


@functools.cache
def _warn_internals(message: str) -> None:
    """Warn once per process that this PyTorch costs kareus an optimisation."""
    warnings.warn(
        f"kareus: {message} (torch {torch.__version__}); results are unchanged, the "
        "first call's tracing is slower",
        RuntimeWarning,
        stacklevel=2,
    )


def specialise_ints(gm: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule:
    """Return a copy of ``gm`` whose int inputs' uses read the values in ``inputs``.

    A region lowered per batch size (:class:`Specialised`) is lowered for concrete sizes,
    but in the shape environment Inductor's cache needs, AOTAutograd gives every int
    input (Dynamo's batch size) a fresh symbol: the graphs would be symbolic again. The
    input stays (the calling convention is Dynamo's); its uses read the constant.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    ints = [
        (node, value)
        for node, value in zip(placeholders, inputs, strict=False)
        if type(value) is int and node.users
    ]
    if not ints:
        return gm
    work = copy_module(gm)
    by_name = {n.name: n for n in work.graph.find_nodes(op="placeholder")}
    for node, value in ints:
        ph = by_name[node.name]

        def read(arg: fx.Node, ph: fx.Node = ph, value: int = value) -> Any:
            return value if arg is ph else arg

        for user in list(ph.users):
            user.args = fx.node.map_arg(user.args, read)
            user.kwargs = fx.node.map_arg(user.kwargs, read)
    work.recompile()
    return work


def reads_scalar_inputs(gm: fx.GraphModule) -> bool:
    """Return whether ``gm`` reads the value of an input tensor as a Python number.

    Under ``dynamic=True`` Dynamo passes a module's float attribute (a norm's ``eps``) as a
    0-d tensor input read by ``.item()``: a value that may change between calls, which a
    lowering for concrete sizes alone (:class:`Specialised`) cannot read (fake tensors hold
    no values).
    """
    return any(
        node.op == "call_method" and node.target == "item" and node.args[0].op == "placeholder"
        for node in gm.graph.nodes
    )


def symbols(values: Sequence[Any]) -> set[Any]:
    """Return the free symbols of the sizes of ``values`` (tensors, SymInts, SymFloats)."""
    found: set[Any] = set()
    for v in values:
        sizes = tuple(v.shape) if isinstance(v, torch.Tensor) else (v,)
        for size in sizes:
            if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                found |= size.node.expr.free_symbols
    return found


class Specialised:
    """A region's compiled function, lowered through AOTAutograd once per batch size.

    Dynamo hands kareus the graph with a symbolic batch, which the nanobatch split needs to
    find the batch dimension. Tracing forward and backward with symbolic sizes costs about
    2.5 times the static trace, so when the batch is the graph's only symbolic size, each
    batch size (the one the training loop uses, a smaller last batch) is lowered with
    concrete sizes on its first call, as Dynamo would recompile a static graph.
    """

    def __init__(
        self,
        lower: Callable[[Sequence[Any]], Callable[..., Any]],
        region: Region,
        *,
        batch_at: int | None = None,
        whole: Callable[[Sequence[Any]], Callable[..., Any]] | None = None,
    ):
        self._lower = lower
        self._region = region
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._batch_at = batch_at  # the argument that is the batch size
        self._whole = whole  # lowers the region unsplit (for a batch too small to split)

    def __call__(self, *args: Any) -> Any:
        """Run the function lowered for these inputs' sizes (lowering it on first sight)."""
        if self._batch_at is not None:
            # The region's one symbol is the batch, passed as this argument: it decides
            # every size (Dynamo guards the rest), so it is the key (a cheaper one per call).
            key: tuple[Any, ...] = (args[self._batch_at],)
        else:
            key = tuple(
                (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                for a in args
                if isinstance(a, (torch.Tensor, int, float, bool))
            )
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._compile(args)
        return fn(*args)

    def _compile(self, args: Sequence[Any]) -> Callable[..., Any]:
        done = len(self._compiled)
        shape = next((tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), ())
        if done:
            note = f"lowered again for new input shapes (first input {shape}; {done + 1} so far)"
            if done + 1 == SPECIALISATIONS_WARNED:
                note += (
                    ": each new batch size costs a compile; give the loader a fixed batch "
                    "size (drop_last=True) to avoid them"
                )
                self._region.warn(note)
            else:
                self._region.notes.append(note)
        _log.info("region %d: lowering for first input %s", self._region.index, shape)
        batch = args[self._batch_at] if self._batch_at is not None else None
        if self._whole is not None and isinstance(batch, int) and batch // 2 < MIN_NANOBATCH:
            # Each split precondition holds for each batch size lowered: a nanobatch of one
            # would specialise (and broadcast) where the split graph assumed a batch.
            self._region.notes.append(
                f"batch {batch} runs whole: a nanobatch of {batch // 2} is too small to split "
                f"(the split needs batches of {2 * MIN_NANOBATCH} or more)"
            )
            return self._whole(list(args))
        return self._lower(list(args))


class LostCollectivesError(PassError):
    """AOTAutograd's graphs of a rewritten region lack collectives its Dynamo graph holds."""


def check_lowered(
    g: fx.GraphModule, expected: Counter[Key], graph: str, *, joint: bool = False
) -> None:
    """Raise :class:`LostCollectivesError` when ``g`` lacks a collective of ``expected``.

    A joint graph holds both sides; a forward-only (inference) graph only the forward side.
    """
    got = as_side(census(g), "forward")
    want = as_side(
        expected if joint else Counter({k: n for k, n in expected.items() if k[0] == "forward"}),
        "forward",
    )
    missing = lost(want, got)
    if missing:
        raise LostCollectivesError(
            "aot_autograd",
            graph,
            f"AOTAutograd's {graph} graph lacks {describe(missing)} of the Dynamo graph",
        )


def checked_partition(
    expected: Counter[Key],
    joint: fx.GraphModule,
    joint_inputs: Any,
    *,
    outlined: bool = False,
    min_cut: bool = False,
    on_partition: OnPartition | None = None,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition the joint graph, after checking its collectives; drop dead collectives.

    ``min_cut``: Inductor's min-cut rematerialisation partition (what torch.compile runs),
    else AOTAutograd's default. With ``outlined`` (blocks lowered as ``invoke_subgraph``
    calls), AOTAutograd first partitions each body's joint graph (as it is: a body that
    draws random numbers ends the outlined lowering), then the region's, whose calls pass
    each forward body's saved values to its backward body; the census counts the bodies'
    collectives. The forward and backward graphs are inlined before they are returned:
    kareus's passes see flat graphs, and so does ``on_partition`` (the region's, not a
    body's).
    """
    partition = partition_function(min_cut)
    if outlined and not is_outlined(joint):  # one body's joint graph
        check_no_random(joint)
        return partition(joint, joint_inputs, **kwargs)  # type: ignore[no-any-return]
    check_lowered(joint, expected, "joint", joint=True)  # the census counts bodies too
    forward, backward = partition(joint, joint_inputs, **kwargs)
    if inline_bodies(forward, backward, recompile=False):  # the passes see flat graphs
        forward, backward = lazy(forward), lazy(backward)  # code made when needed
    drop_dead_collectives(backward)
    if on_partition is not None:
        on_partition({"forward": forward, "backward": backward})
    return forward, backward


def partition_function(min_cut: bool) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """Return Inductor's min-cut partition (``min_cut``) or AOTAutograd's default one.

    Either takes the keywords its caller passes that it knows (Inductor passes
    ``compiler=``, which only the min-cut partition takes).
    """
    import inspect

    from kareus._torch_internals import aot_partitions

    default_partition, min_cut_partition = aot_partitions()
    chosen = min_cut_partition if min_cut else default_partition
    known = inspect.signature(chosen).parameters

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        return chosen(joint, inputs, **{k: v for k, v in kwargs.items() if k in known})

    return partition


def drop_dead_collectives(backward: fx.GraphModule) -> None:
    """Remove dead code from the backward, collectives whose result nothing reads included.

    A partitioner copies into the backward forward nodes it can recompute from the saved
    values and then removes dead code except collectives: the output projection and FC2 of
    a tensor-parallel layer (with static shapes, attention too) would run again, unused, in
    every backward, and so would the head's logits GEMM feeding a copy of the
    vocab-parallel loss's max all-reduce whose result nothing reads. A functional
    collective whose result is unused is dead on every rank alike (each runs this graph),
    so it goes too; random ops count as pure: eager never ran these.
    """
    if backward.graph.eliminate_dead_code(impure_unless_collective):
        backward.recompile()


def lazy(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """Return ``gm`` (with ``graph``) as a module whose code is made when first run or read."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(gm, gm.graph if graph is None else graph, class_name=type(gm).__name__)


def impure_unless_collective(node: fx.Node) -> bool:
    """DCE's test: impure nodes stay, except functional collectives and their waits."""
    kind = collective_kind(node)
    if is_wait(node) or (kind is not None and not kind.endswith("_")):  # in-place ones stay
        return False
    return node.is_impure(impure_random=False)


def tracing_context(static_inputs: Sequence[Any] | None = None) -> Any:
    """Return a tracing context for AOTAutograd unless one is active (Dynamo's).

    A region lowered per batch size runs outside Dynamo's: without one, ``invoke_subgraph``
    finds no cache for traced bodies. With ``static_inputs`` the context also has a shape
    environment, without which Inductor's FX graph cache bypasses the graph; AOTAutograd
    would then give every input size a symbol, so those of ``static_inputs`` are declared
    static (lowered per batch size, as without the environment).
    """
    import contextlib

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kareus._torch_internals import dynamo_tracing, fake_tensor_mode_type

    LocalSource, _attr, TracingContext, tracing = dynamo_tracing()
    FakeTensorMode = fake_tensor_mode_type()

    if TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    if static_inputs is None:
        return tracing(TracingContext(FakeTensorMode()))
    context = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    for i, value in enumerate(static_inputs):
        if isinstance(value, torch.Tensor):
            context.tensor_to_context[value] = static_context(
                value, LocalSource(f"kareus_input_{i}")
            )
    return tracing(context)


def static_context(value: torch.Tensor, source: Any) -> Any:
    """Return a symbolic context that keeps every size of ``value`` static.

    For a tensor subclass (a DTensor parameter of a TP layer), one per inner tensor too, as
    Dynamo builds them: a plain context for a DTensor failed AOTAutograd's fake-tensor
    conversion.
    """
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        StatefulSymbolicContext,
        SubclassSymbolicContext,
    )
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from kareus._torch_internals import dynamo_tracing

    _local, AttrSource, _context, _tracing = dynamo_tracing()

    static = [DimDynamic.STATIC] * value.dim()
    if not is_traceable_wrapper_subclass(value):
        return StatefulSymbolicContext(dynamic_sizes=static, tensor_source=source)
    attrs, _ = type(value).__tensor_flatten__(value)  # type: ignore[attr-defined]
    inner = {
        attr: static_context(getattr(value, attr), AttrSource(source, attr))
        for attr in attrs
        if isinstance(getattr(value, attr), torch.Tensor)
    }
    return SubclassSymbolicContext(dynamic_sizes=static, tensor_source=source, inner_contexts=inner)


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy ``gm``'s graph and those of its graph submodules (higher-order-op bodies).

    Parameters and other modules are shared; bodies are copied so that a pass that changes
    one (or fails half-way) leaves the captured graph whole.
    """
    work = lazy(gm, copy_graph(gm.graph))  # code made when needed, not per copy and pass
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            setattr(work, name, copy_module(child))
    return work

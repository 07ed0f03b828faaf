"""``kareus.compile`` and the ``torch.compile`` backend that does the work.

The backend receives each Dynamo graph, runs the structural passes on it, then hands it to
AOTAutograd with kareus's own forward, backward and inference compilers. Those run the
analysis and codegen passes and return the rewritten graphs, executed as plain Python (or
handed to TorchInductor when ``Config.codegen == "inductor"``).
"""

from __future__ import annotations

import functools
import logging
import pathlib
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from kareus import passes
from kareus.compiler.config import Config
from kareus.compiler.region import GraphRecord, Region
from kareus.errors import PassError, PlanMismatchError
from kareus.ir.partitions import Decision
from kareus.ir.plan_file import PIPELINE_SCHEDULES, Plan
from kareus.passes.base import PassContext, run_passes
from kareus.passes.census import Key, as_side, census, collective_kind, describe, is_wait, lost
from kareus.passes.outline import (
    check_no_random,
    inline_bodies,
    is_outlined,
    outline_blocks,
    tracing_bodies,
)
from kareus.passes.subgraphs import copy_graph
from kareus.runtime.clocks import ClockController, default_controller
from kareus.runtime.comm_pool import CommunicatorPool, job_pool
from kareus.runtime.switcher import ClockRuntime, IterationEnergy, Step

_log = logging.getLogger(__name__)
T = TypeVar("T")
_ORIG = "_orig_mod."


class KareusBackend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=KareusBackend(config))``.

    One backend instance keeps the regions it compiled, which :func:`kareus.explain` reads.

    Args:
        config: the settings; ``Config()`` when omitted.
        **overrides: fields of :class:`Config` that replace the config's.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        decisions: Mapping[str, Decision] | None = None,
        plan: Plan | str | pathlib.Path | None = None,
        stage: int = 0,
        clocks: ClockController | None = None,
        journal: str | pathlib.Path | None = None,
        on_iteration: Callable[[IterationEnergy], None] | None = None,
        measure: bool | None = None,
        schedule: str | None = None,
        **overrides: Any,
    ) -> None:
        base = config if config is not None else Config()
        if not isinstance(base, Config):
            raise TypeError(f"config must be a kareus.Config, got {type(base).__name__}")
        self.config = base.replace(**overrides) if overrides else base
        self.plan = Plan.load(plan) if isinstance(plan, (str, pathlib.Path)) else plan
        if self.plan is not None and self.plan.nanobatches == 1:
            # The plan found that splitting does not pay here: it runs the original graphs.
            if self.config.nanobatches == 2:
                raise PlanMismatchError(
                    "the plan runs the original graphs (nanobatches 1: no split plan beat "
                    "per-instruction clocks alone), but nanobatches=2 was asked for: drop "
                    "nanobatches=2, or plan again"
                )
            self.config = self.config.replace(nanobatches=1)
        # Without a plan or decisions, compile plans by itself for a known GPU type.
        self._plan_for = (
            (self.config.gpu or _this_gpu()) if plan is None and decisions is None else None
        )
        if measure is None:
            import importlib.util

            measure = torch.cuda.is_available() and importlib.util.find_spec("zeus") is not None
        self._runtime_options: dict[str, Any] = {
            "journal": journal,
            "on_iteration": on_iteration,
            "measure": measure,
        }
        self._clocks = clocks
        if self.plan is not None:
            _check_schedule(self.plan, schedule)
        if self.plan is not None and stage not in self.plan.stages():
            raise PlanMismatchError(
                f"stage={stage} is not in the plan: it schedules stages "
                f"{self.plan.stages()} ({self.plan.parallel}); pass the pipeline stage this "
                "process runs"
            )
        self.stage = stage
        if decisions is None and self.plan is not None:
            decisions = self.plan.decisions_for(stage)
        self.decisions: dict[str, Decision] = dict(decisions or {})
        self.runtime: ClockRuntime | None = None
        if self.plan is not None:
            self.runtime = self._runtime_with(
                [
                    Step(s.kind, s.freq_mhz, s.time_s, s.dynamic_energy_j, s.stage, s.microbatch)
                    for s in self.plan.schedule
                    if s.stage == stage
                ],
                self.plan,
            )
        for key, dec in self.decisions.items():
            if not isinstance(dec, Decision):
                raise TypeError(f"decisions[{key!r}] must be a kareus.Decision, got {dec!r}")
        self.regions: list[Region] = []
        self._pool: CommunicatorPool | None = None

    def __repr__(self) -> str:
        return f"KareusBackend({self.config!r}, regions={len(self.regions)})"

    def _runtime_with(self, steps: list[Step], plan: Plan) -> ClockRuntime:
        """Return the runtime of this process's GPU with ``steps`` added (one per GPU)."""
        if self._clocks is None:
            self._clocks = default_controller()
        return ClockRuntime.for_device(
            steps,
            self._clocks,
            static_power_w=plan.static_power_w,
            iteration_time_s=plan.chosen.time_s,
            **self._runtime_options,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Compile one Dynamo graph (called by Dynamo, once per graph and recompile)."""
        compile_id = torch._guards.CompileContext.current_compile_id()
        region = Region(index=len(self.regions), compile_id=str(compile_id))
        self.regions.append(region)
        region.findings["decisions"] = _Decisions(self.decisions)
        if self.plan is not None:
            region.findings["plan"] = self.plan
            region.findings["plan_stage"] = self.stage
        region.findings["region_index"] = region.index
        if self.runtime is not None:
            region.findings["clock_runtime"] = self.runtime
            region.findings["clock_stage"] = self.stage
        if self.decisions and dist.is_available() and dist.is_initialized():
            self._pool = job_pool()
            region.findings["communicator_pool"] = self._pool
        captured = gm
        gm = self._run_graph_passes(region, "dynamo", gm, example_inputs)
        lower = functools.partial(self._lower_or_captured, region, gm, captured)
        if len(_symbols(example_inputs)) > 1:
            return lower(example_inputs)  # sizes besides the batch vary: lower symbolically
        return _Specialised(lower, region)

    def _lower_or_captured(
        self,
        region: Region,
        gm: fx.GraphModule,
        captured: fx.GraphModule,
        example_inputs: Sequence[Any],
    ) -> Callable[..., Any]:
        """Lower the rewritten Dynamo graph; if that loses collectives, the captured one."""
        try:
            return self._lower(region, gm, example_inputs)
        except LostCollectivesError as err:
            if gm is captured or self.config.strict:
                raise
            # The rewritten graph lost collectives on its way through AOTAutograd: run the
            # region as captured, and say so loudly.
            note = f"region runs as captured, unchanged: {err}"
            _warn(region, note)
            _undo_split(region, err.detail)
            region.graphs["dynamo"].final_code = region.graphs["dynamo"].captured_code
            return self._lower(region, captured, example_inputs)

    def _lower(
        self, region: Region, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        """Hand the Dynamo graph to AOTAutograd (or Inductor) with kareus's compilers.

        Raises:
            LostCollectivesError: AOTAutograd's graphs lack a collective the Dynamo graph
                holds (checked on the joint graph, or on the inference graph).
        """
        expected = census(gm)
        if self.config.codegen == "inductor":
            return self._hand_to_inductor(region, gm, example_inputs, expected)

        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        compiled: dict[str, tuple[fx.GraphModule, Sequence[Any], fx.GraphModule]] = {}

        def compiler(kind: str, g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            if kind == "inference":
                check_no_random(g, bodies_only=True)
                inline_bodies(g)
                _check_lowered(g, expected, "inference")
            compiled[kind] = (g, inputs, self._run_graph_passes(region, kind, g, inputs))
            planned = region.findings.get("planned")
            if kind == "backward" and self._plan_for and "forward" in compiled and not planned:
                self._plan_region(region, compiled)

            def run(*args: Any) -> Any:  # looks the graph up: planning may replace it
                return compiled[kind][2](*args)

            return make_boxed_func(run)

        def lower(graph: fx.GraphModule, outlined: bool = False) -> Callable[..., Any]:
            return aot_autograd(  # type: ignore[no-any-return]
                fw_compiler=functools.partial(compiler, "forward"),
                bw_compiler=functools.partial(compiler, "backward"),
                inference_compiler=functools.partial(compiler, "inference"),
                partition_fn=functools.partial(_checked_partition, expected, outlined=outlined),
            )(graph, example_inputs)

        once = self.config.trace_blocks_once
        outlined, calls, shared = (
            (gm, 0, 0)
            if once is False
            else outline_blocks(gm, min_calls=2 if once else AUTO_OUTLINE_CALLS)
        )
        if calls:
            history = len(region.history)
            try:
                # The tracing context is where invoke_subgraph keeps the traced bodies.
                with _tracing_context(), tracing_bodies(), warnings.catch_warnings():
                    # A body's backward traced again for other gradient layouts: expected.
                    warnings.filterwarnings("ignore", "invoke_subgraph traced multiple backward")
                    fn = lower(outlined, outlined=True)
            except Exception as err:
                del region.history[history:]
                compiled.clear()
                region.notes.append(
                    f"blocks traced one by one: tracing each repeated block once failed "
                    f"({type(err).__name__}: {err})"
                )
                _log.info("region %d: outlined lowering failed: %s", region.index, err)
            else:
                region.notes.append(
                    f"{calls} block calls traced through AOTAutograd from {shared} shared "
                    f"bod{'y' if shared == 1 else 'ies'} (Config.trace_blocks_once)"
                )
                return fn
        return lower(gm)

    def _plan_region(
        self,
        region: Region,
        compiled: dict[str, tuple[fx.GraphModule, Sequence[Any], fx.GraphModule]],
    ) -> None:
        """Plan this region's forward and backward with the hardware model; apply the plan.

        Both graphs are rewritten by the plan (the functions already returned pick the new
        code up at their next call).
        """
        from kareus.hardware import gpu
        from kareus.ir.partitions import PartitionSet
        from kareus.planner import Parallelism, plan_for_gpu

        pset: PartitionSet = region.findings["cut_partitions"]
        sizes = [
            c.world_size
            for t in pset.types.values()
            for c in ([t.collective] if t.collective else [])
        ] + [c.world_size for cs in pset.exposed.values() for c in cs]
        spec = gpu(str(self._plan_for))
        try:
            result = plan_for_gpu(
                pset,
                spec,
                parallel=Parallelism(tp=max(sizes, default=1)),
                policy=self.config.select,
            )
        except Exception as err:  # planning must never stop training
            note = f"planning for {spec.name} failed, nanobatching defaults kept: {err}"
            _warn(region, note)
            return
        plan = result.plan
        region.findings["plan"] = plan
        region.findings["planned"] = True  # made for this very graph: nothing to check
        region.findings["decisions"] = _Decisions(plan.decisions_for(0))
        if dist.is_available() and dist.is_initialized():
            self._pool = job_pool()
            region.findings["communicator_pool"] = self._pool
        # One runtime for the GPU: each planned region's instructions are a "stage" of it,
        # numbered by region, so that its switches apply its own clocks.
        self.runtime = self._runtime_with(
            [
                Step(s.kind, s.freq_mhz, s.time_s, s.dynamic_energy_j, region.index, s.microbatch)
                for s in plan.schedule
            ],
            plan,
        )
        region.findings["clock_runtime"] = self.runtime
        region.findings["clock_stage"] = region.index
        region.notes.append(
            f"planned at compile time for {spec.name} with the hardware model "
            f"(policy {self.config.select}; modelled {plan.chosen.time_s:.6f} s, "
            f"{plan.chosen.energy_j:.3f} J per forward and backward)"
        )
        # Rewrite both graphs by the plan, from the captured graphs.
        region.findings["cut_partitions"] = PartitionSet()
        for kind in ("forward", "backward"):
            g, inputs, _old = compiled[kind]
            compiled[kind] = (g, inputs, self._run_graph_passes(region, kind, g, inputs))

    def _hand_to_inductor(
        self,
        region: Region,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        expected: Counter[Key],
    ) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        if self._plan_for:
            region.notes.append(
                "not planned at compile time: that needs codegen='python'; plan with "
                "`kareus plan` and pass plan=... to apply clocks and overlap with Inductor"
            )

        def inner(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                kind = "backward"
            elif kwargs.get("is_inference"):
                kind = "inference"
            else:
                kind = "forward"
            if kind != "backward":
                _check_lowered(g, expected, kind)
            return compile_fx_inner(
                self._run_graph_passes(region, kind, g, inputs), inputs, **kwargs
            )

        # kareus's passes run inside inner_compile, after AOTAutograd: its cache, keyed by
        # the graph before them, would skip them silently on a hit, so it stays off.
        # Inductor's FX graph cache is keyed by the graph compile_fx_inner receives, the
        # one the passes made (plan, clock switches and overlap order in it): a hit reuses
        # the code generated for exactly that graph. It needs a shape environment, which a
        # region lowered per batch size (outside Dynamo's tracing context) lacks: give it
        # one (without it every graph bypassed the cache: "No shape env").
        with (
            _tracing_context(static_inputs=example_inputs),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            return compile_fx(gm, example_inputs, inner_compile=inner)  # type: ignore[return-value]

    def _run_graph_passes(
        self, region: Region, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> fx.GraphModule:
        """Run the pipeline on one graph; on failure keep the captured graph unless strict."""
        record = GraphRecord(kind, gm, num_inputs=len(example_inputs))
        region.graphs[kind] = record
        ctx = PassContext(self.config, kind, region.findings, example_inputs)
        # The passes rewrite a copy of the graph so that a failure leaves the captured one.
        work = _copy_module(gm)
        try:
            out, records = run_passes(work, passes.PIPELINE, ctx)
        except PassError as err:
            region.history.extend(getattr(err, "records", []))
            if isinstance(err.__cause__, PlanMismatchError):
                raise err.__cause__ from None  # the message says all; no pass went wrong
            if self.config.strict:
                raise
            note = f"{kind} graph runs as captured, unchanged: {err}"
            _warn(region, note)
            record.final_code = record.captured_code
            if kind == "dynamo":
                _undo_split(region, err.detail)
            return gm
        region.history.extend(records)
        record.final_code = out.code  # generated when the last pass that changed it ran
        return out


AUTO_OUTLINE_CALLS = 16
"""Calls of one block body from which tracing it once compiles faster than tracing each.

Each traced body carries a fixed cost (its schema, a backward per gradient layout), so a
few calls compile faster traced op by op. First call against ``aot_eager`` of the tiny
Llama split in two nanobatches, tracing once and tracing each (fresh processes, 2 cores): 4
layers (8 calls) 1.89x and 1.39x, 8 layers (16 calls) 1.54x and 1.57x, 16 layers 1.30x and
1.91x; ``python benchmarks/compile_overhead.py --presets tiny-8l``: 1.49x and 1.50x."""

SPECIALISATIONS_WARNED = 8
"""Batch sizes a region is lowered for before kareus says that each new one costs a compile."""


def _symbols(values: Sequence[Any]) -> set[Any]:
    """Return the free symbols of the sizes of ``values`` (tensors, SymInts, SymFloats)."""
    found: set[Any] = set()
    for v in values:
        sizes = tuple(v.shape) if isinstance(v, torch.Tensor) else (v,)
        for size in sizes:
            if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                found |= size.node.expr.free_symbols
    return found


class _Specialised:
    """A region's compiled function, lowered through AOTAutograd once per batch size.

    Dynamo hands kareus the graph with a symbolic batch, which the nanobatch split needs to
    find the batch dimension. Tracing forward and backward with symbolic sizes costs about
    2.5 times the static trace, so when the batch is the graph's only symbolic size, each
    batch size (the one the training loop uses, a smaller last batch) is lowered with
    concrete sizes on its first call, as Dynamo would recompile a static graph.
    """

    def __init__(self, lower: Callable[[Sequence[Any]], Callable[..., Any]], region: Region):
        self._lower = lower
        self._region = region
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
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
                _warn(self._region, note)
            else:
                self._region.notes.append(note)
        _log.info("region %d: lowering for first input %s", self._region.index, shape)
        return self._lower(list(args))


class _Decisions(dict):  # type: ignore[type-arg]
    """The overlap decisions a region was compiled with, shown by ``kareus.explain``."""

    def to_text(self) -> str:
        if not self:
            return "none given: a split block's collectives launch at their partitions' start"
        return "\n".join(f"{k}: {v}" for k, v in self.items())


SCHEDULES = {
    alias + name.lower(): name for name in PIPELINE_SCHEDULES for alias in ("", "schedule")
}
"""Pipeline schedules by the names users give them (``"gpipe"``, ``"Schedule1F1B"``...)."""


def _check_schedule(plan: Plan, schedule: str | None) -> None:
    """Raise when the pipeline schedule the job runs is not the one the plan was made for."""
    if schedule is None:
        return
    name = SCHEDULES.get(schedule.replace("_", "").replace("-", "").lower())
    if name is None:
        raise PlanMismatchError(
            f"unknown pipeline schedule {schedule!r}: use one of {list(PIPELINE_SCHEDULES)}"
        )
    planned = plan.pipeline_schedule
    if name != planned:
        raise PlanMismatchError(
            f"the plan was made for the {planned} pipeline schedule, but this job runs "
            f"{name}: re-plan with `kareus plan --schedule {name}` (or run {planned})"
        )


def _warn(region: Region, note: str) -> None:
    """Record ``note`` in the region (``explain`` shows it) and warn with it."""
    region.notes.append(note)
    warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=3)


def _undo_split(region: Region, reason: str) -> None:
    """Record that the region's blocks run whole after all (the split was not kept)."""
    blockset = region.findings.get("find_blocks")
    if blockset is not None:
        for name in blockset.split:
            blockset.skipped[name] = f"split undone: {reason}"
        blockset.split.clear()


class LostCollectivesError(PassError):
    """AOTAutograd's graphs of a rewritten region lack collectives its Dynamo graph holds."""


def _check_lowered(
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


def _checked_partition(
    expected: Counter[Key],
    joint: fx.GraphModule,
    joint_inputs: Any,
    *,
    outlined: bool = False,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's default partition, after checking the joint graph's collectives.

    With ``outlined`` (blocks lowered as ``invoke_subgraph`` calls), AOTAutograd first
    partitions each body's joint graph (as it is: a body that draws random numbers ends
    the outlined lowering), then the region's, whose calls pass each forward body's saved
    values to its backward body; the census counts the bodies' collectives. The forward and
    backward graphs are inlined before they are returned: kareus's passes see flat graphs.
    """
    from torch._functorch.partitioners import default_partition

    if outlined and not is_outlined(joint):  # one body's joint graph
        check_no_random(joint)
        return default_partition(joint, joint_inputs, **kwargs)  # type: ignore[no-any-return]
    _check_lowered(joint, expected, "joint", joint=True)  # the census counts bodies too
    forward, backward = default_partition(joint, joint_inputs, **kwargs)
    if inline_bodies(forward, backward, recompile=False):  # the passes see flat graphs
        forward, backward = _lazy(forward), _lazy(backward)  # code made when needed
    # The partitioner copies into the backward every forward node it can recompute from the
    # saved values and then removes dead code except collectives: the output projection
    # and FC2 of a tensor-parallel layer (with static shapes, attention too) would run
    # again, unused, in every backward, and so would the head's logits GEMM feeding a
    # copy of the vocab-parallel loss's max all-reduce whose result nothing reads. A
    # functional collective whose result is unused is dead on every rank alike (each runs
    # this graph), so it goes too; random ops count as pure: eager never ran these.
    if backward.graph.eliminate_dead_code(_impure_unless_collective):
        backward.recompile()
    return forward, backward


def _lazy(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """Return ``gm`` (with ``graph``) as a module whose code is made when first run or read."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(gm, gm.graph if graph is None else graph, class_name=type(gm).__name__)


def _impure_unless_collective(node: fx.Node) -> bool:
    """DCE's test: impure nodes stay, except functional collectives and their waits."""
    kind = collective_kind(node)
    if is_wait(node) or (kind is not None and not kind.endswith("_")):  # in-place ones stay
        return False
    return node.is_impure(impure_random=False)


def _tracing_context(static_inputs: Sequence[Any] | None = None) -> Any:
    """Return a tracing context for AOTAutograd unless one is active (Dynamo's).

    A region lowered per batch size runs outside Dynamo's: without one, ``invoke_subgraph``
    finds no cache for traced bodies. With ``static_inputs`` the context also has a shape
    environment, without which Inductor's FX graph cache bypasses the graph; AOTAutograd
    would then give every input size a symbol, so those of ``static_inputs`` are declared
    static (lowered per batch size, as without the environment).
    """
    import contextlib

    from torch._dynamo.source import LocalSource
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatefulSymbolicContext,
    )

    if TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    if static_inputs is None:
        return tracing(TracingContext(FakeTensorMode()))
    context = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    for i, value in enumerate(static_inputs):
        if isinstance(value, torch.Tensor):
            context.tensor_to_context[value] = StatefulSymbolicContext(
                dynamic_sizes=[DimDynamic.STATIC] * value.dim(),
                tensor_source=LocalSource(f"kareus_input_{i}"),
            )
    return tracing(context)


def _this_gpu() -> str | None:
    """Return the kareus GPU type of this CUDA device, or None (no GPU or unknown)."""
    if not torch.cuda.is_available():
        return None
    from kareus.hardware.specs import spec_name_for_device

    return spec_name_for_device(torch.cuda.get_device_name())


def _copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy ``gm``'s graph and those of its graph submodules (higher-order-op bodies).

    Parameters and other modules are shared; bodies are copied so that a pass that changes
    one (or fails half-way) leaves the captured graph whole.
    """
    work = _lazy(gm, copy_graph(gm.graph))  # code made when needed, not per copy and pass
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            setattr(work, name, _copy_module(child))
    return work


default_backend = KareusBackend()
"""The backend behind ``torch.compile(model, backend="kareus")`` (shared by such calls)."""


def compile(
    model: T,
    *,
    config: Config | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    decisions: Mapping[str, Decision] | None = None,
    plan: Plan | str | pathlib.Path | None = None,
    **backend_options: Any,
) -> T:
    """Compile ``model`` with kareus; use the result exactly like ``torch.compile``'s.

    The result shares parameters with ``model``, works with any optimizer and with
    gradient accumulation, follows ``.train()``/``.eval()``, and its ``state_dict`` has the
    original model's keys, so checkpoints are interchangeable with the uncompiled model.

    Args:
        model: an ``nn.Module`` or a function.
        config: the settings; ``Config()`` when omitted.
        fullgraph: as in ``torch.compile``: raise on a graph break instead of splitting.
        dynamic: as in ``torch.compile``.
        decisions: per partition type (keys as ``kareus.explain`` lists them, ``"*"`` for
            all), where its collective is launched and with how many SMs. Without them, each
            collective launches at the start of its partition (nanobatching as published).
        plan: a :class:`~kareus.Plan` or the path of a saved one: its overlap decisions are
            applied, and its clock schedule by a clock runtime (``stage=``, ``clocks=``,
            ``journal=``, ``on_iteration=`` configure it; see :class:`KareusBackend`).
        **backend_options: fields of :class:`Config` that replace the config's, for example
            ``nanobatches=1``, and the clock runtime's options above.

    Returns:
        The compiled module or function.

    Raises:
        ConfigError: an override is not a Config field or has a value that is not allowed.
        TypeError: ``model`` is neither a module nor callable.
    """
    if not callable(model):
        raise TypeError(f"kareus.compile needs an nn.Module or a function, got {type(model)!r}")
    backend = KareusBackend(config, decisions=decisions, plan=plan, **backend_options)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(compiled, nn.Module):
        if backend.config.nanobatches != 1:
            dim = backend.config.batch_dim or 0
            compiled.register_forward_pre_hook(
                functools.partial(_mark_batch_dynamic, dim), with_kwargs=True
            )
        compiled._kareus_backend = backend  # type: ignore[assignment]
        compiled.register_state_dict_post_hook(_strip_orig_prefix)
        compiled.register_load_state_dict_pre_hook(_add_orig_prefix)
    else:
        compiled._kareus_backend = backend  # type: ignore[attr-defined]
    return compiled  # type: ignore[return-value]


def _mark_batch_dynamic(
    dim: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # The nanobatch split needs a symbolic batch: sizes like view(b, ...) must follow it.
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(value, dim)


def _strip_orig_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # torch.compile's wrapper names every key "_orig_mod.<key>"; give back the model's keys.
    for key in [k for k in state_dict if k.startswith(prefix + _ORIG)]:
        state_dict[prefix + key[len(prefix) + len(_ORIG) :]] = state_dict.pop(key)


def _add_orig_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    # Accept both the model's keys and torch.compile's "_orig_mod." keys.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if not rest.startswith(_ORIG):
            state_dict[prefix + _ORIG + rest] = state_dict.pop(key)


def find_backend(compiled: object) -> KareusBackend | None:
    """Return the kareus backend that compiled ``compiled``, or None."""
    backend = getattr(compiled, "_kareus_backend", None)
    if isinstance(backend, KareusBackend):
        return backend
    # torch.compile(model, backend=...) wraps the backend in a chain of callables.
    obj = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(16):
        if obj is None or isinstance(obj, KareusBackend):
            return obj
        nxt = getattr(obj, "_torchdynamo_orig_backend", None)
        obj = nxt if nxt is not None else getattr(obj, "compiler_fn", None)
    return None

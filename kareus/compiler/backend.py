"""``kareus.compile`` and the ``torch.compile`` backend that does the work.

The backend receives each Dynamo graph, runs the structural passes on it, then lowers it
(:mod:`kareus.compiler.lowering`: AOTAutograd with kareus's forward, backward and inference
compilers, or TorchInductor when ``Config.codegen == "inductor"``), which run the analysis and
codegen passes. A plan, given or made at compile time, is applied by
:mod:`kareus.compiler.apply_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import pathlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor, nn

from kareus._torch_internals import current_compile_id, dynamo_context, traced_frame
from kareus.compiler import apply_plan
from kareus.compiler.apply_plan import Decisions
from kareus.compiler.config import Config
from kareus.compiler.inductor_lowering import lower_with_inductor
from kareus.compiler.inductor_options import inductor_options, split_options
from kareus.compiler.lowering import (
    Compiled,
    LostCollectivesError,
    Specialised,
    copy_module,
    lower_with_aot,
    reads_scalar_inputs,
    symbols,
)
from kareus.compiler.module_hooks import BatchMarks, add_orig_prefix, strip_orig_prefix
from kareus.compiler.region import GraphRecord, Region
from kareus.compiler.split_pricing import SplitDeclined, after_declined, judge, pricing_device
from kareus.errors import ConfigError, PassError, PlanMismatchError
from kareus.ir.partitions import Decision
from kareus.ir.plan_file import Plan
from kareus.passes import pipeline
from kareus.passes.base import PassContext, RegionInputs, run_passes
from kareus.runtime.clocks import (
    ClockController,
    DryRunClocks,
    default_controller,
    local_cuda_index,
)
from kareus.runtime.comm_pool import CommunicatorPool, job_pool
from kareus.runtime.switcher import ClockRuntime, IterationEnergy, Step

_log = logging.getLogger(__name__)
T = TypeVar("T")
_REGION_IDS = itertools.count()
"""Process-wide region numbers: the clock runtime of a GPU counts each region's passes on
its own, and regions of different backends (a model compiled block by block) share it."""


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
        clocks: ClockController | str | None = None,
        journal: str | pathlib.Path | None = None,
        on_iteration: Callable[[IterationEnergy], None] | None = None,
        measure: bool | None = None,
        schedule: str | None = None,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        base = config if config is not None else Config()
        if not isinstance(base, Config):
            raise TypeError(f"config must be a kareus.Config, got {type(base).__name__}")
        inductor, fields = split_options(options)
        self.config = base.replace(**fields, **overrides) if fields or overrides else base
        self.mode = mode
        self.inductor_options = inductor_options(mode, inductor, self.config.codegen)
        if isinstance(plan, (str, pathlib.Path)):
            from kareus.hardware import clock_range

            plan = Plan.load(plan, clock_range)
        self.plan = plan
        if self.plan is not None:
            self.config = apply_plan.check_plan(self.plan, self.config, stage, schedule)
        # Without a plan or decisions, compile plans by itself for a known GPU type (which
        # GPU this process runs on is asked at the first compile, not here: a backend may be
        # made before torch.cuda.set_device).
        self._planning = plan is None and decisions is None
        # A plan or decisions say what is split (the plan priced split and whole itself):
        # nothing is priced again here.
        self._priced = plan is None and decisions is None
        self._plan_for_gpu: str | None = None
        self._runtime_options: dict[str, Any] = {
            "journal": journal,
            "on_iteration": on_iteration,
            "measure": measure,
        }
        self._clocks, self._apply_planned_clocks = _clock_choice(clocks)
        self.stage = stage
        if decisions is None and self.plan is not None:
            decisions = self.plan.decisions_for(stage)
        self.decisions: dict[str, Decision] = dict(decisions or {})
        for key, dec in self.decisions.items():
            if not isinstance(dec, Decision):
                raise TypeError(f"decisions[{key!r}] must be a kareus.Decision, got {dec!r}")
        self.runtime: ClockRuntime | None = None
        if self.plan is not None:
            self.runtime = self._runtime_with(apply_plan.steps(self.plan, stage), self.plan)
        self.regions: list[Region] = []
        self._pool: CommunicatorPool | None = None
        if self.inductor_options.get("triton.cudagraphs"):
            self._check_cuda_graphs()

    def _check_cuda_graphs(self) -> None:
        """Raise when CUDA graphs would replay the graphs without their clock switches.

        Raises:
            ConfigError: CUDA graphs are asked for (``mode="reduce-overhead"``) and a plan,
                given or made at compile time for this GPU, switches clocks.
        """
        switches = self.plan is not None or (self._planning and self._plan_for is not None)
        if not switches:
            return
        why = "plan=" if self.plan is not None else f"compile-time planning for {self._plan_for}"
        raise ConfigError(
            "mode",
            self.mode if self.mode is not None else "options={'triton.cudagraphs': True}",
            "a mode without CUDA graphs ('default', 'max-autotune-no-cudagraphs'): a CUDA "
            f"graph replays its kernels without the clock switches {why} puts between "
            "them. To keep CUDA graphs, drop the clock plan (decisions={} keeps the "
            "overlap without planning clocks)",
            owner="",
        )

    def __repr__(self) -> str:
        return f"KareusBackend({self.config!r}, regions={len(self.regions)})"

    @property
    def _plan_for(self) -> str | None:
        """The GPU type compile-time planning plans for (None: no planning)."""
        if self._planning and self._plan_for_gpu is None:
            self._plan_for_gpu = self.config.gpu or apply_plan.this_gpu() or ""
        return self._plan_for_gpu or None

    def _runtime_with(
        self, steps: list[Step], plan: Plan, clocks: ClockController | None = None
    ) -> ClockRuntime:
        """Return the runtime of this process's GPU with ``steps`` added (one per GPU)."""
        if clocks is None:
            if self._clocks is None:
                self._clocks = default_controller()
            clocks = self._clocks
        options = dict(self._runtime_options)
        if options["measure"] is None:
            import importlib.util

            zeus = importlib.util.find_spec("zeus") is not None
            options["measure"] = zeus and torch.cuda.is_available()
        return ClockRuntime.for_device(
            steps,
            clocks,
            static_power_w=plan.static_power_w,
            iteration_time_s=plan.chosen.time_s,
            **options,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Compile one Dynamo graph (called by Dynamo, once per graph and recompile)."""
        compile_id, frame = current_compile_id(), traced_frame()
        region = Region(
            index=len(self.regions),
            compile_id=str(compile_id),
            device=next((v.device.type for v in example_inputs if isinstance(v, Tensor)), ""),
            parameter_refs=tuple(weakref.ref(v) for v in _parameters(example_inputs)),
            graph_break=frame.break_reason,
        )
        if frame.piece or any(r.compile_id == region.compile_id for r in self.regions):
            region.notes.append(_PIECES)
        self.regions.append(region)
        if self.decisions and dist.is_available() and dist.is_initialized():
            self._pool = job_pool()
        region.inputs = RegionInputs(
            index=next(_REGION_IDS),
            # A layer's forward traced to its return: the region is one call of it.
            code=frame.qualname if frame.whole_call else None,
            compiled_autograd=getattr(compile_id, "compiled_autograd_id", None) is not None,
            plan=self.plan,
            plan_stage=self.stage,
            decisions=Decisions(self.decisions),
            clock_runtime=self.runtime,
            clock_stage=self.stage,
            communicator_pool=self._pool if self.decisions else None,
            pricing=pricing_device(self.config, region.device) if self._priced else None,
        )
        captured = gm
        gm = self._run_graph_passes(region, "dynamo", gm, example_inputs)
        lower = functools.partial(self._lower_or_captured, region, gm, captured)
        if len(symbols(example_inputs)) > 1 or reads_scalar_inputs(captured):
            # sizes besides the batch vary, or a value does (a float Dynamo left unspecialised,
            # read by .item(): dynamic=True): lower symbolically, once for all
            return lower(example_inputs)
        blockset = region.findings.blocks
        batch_at = next(
            (i for i, v in enumerate(example_inputs) if isinstance(v, torch.SymInt)), None
        )
        if gm is captured or blockset is None or not blockset.split:
            return Specialised(lower, region, batch_at=batch_at)
        whole = functools.partial(self._lower_whole, region, captured)
        return Specialised(lower, region, batch_at=batch_at, whole=whole)

    def _lower_whole(
        self, region: Region, captured: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        """Lower the captured (unsplit) graph: of the pipeline, only the clock switch runs."""
        switch = [p for p in pipeline.PIPELINE if p.name == "insert_clock_switches"]

        def switch_only(kind: str, g: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule:
            ctx = PassContext(self.config, kind, region.findings, inputs, inputs=region.inputs)
            out, records = run_passes(copy_module(g), switch, ctx)
            region.history.extend(records)
            return out

        if self.config.codegen == "inductor":
            return lower_with_inductor(
                captured,
                example_inputs,
                run_passes=switch_only,
                on_graphs=lambda _compiled: None,
                options=self.inductor_options,
                min_cut=self.config.min_cut,
            )
        return lower_with_aot(
            captured,
            example_inputs,
            config=self.config.replace(trace_blocks_once=False),
            region=region,
            run_passes=switch_only,
            on_graphs=lambda _compiled: None,
        )

    def _lower_or_captured(
        self,
        region: Region,
        gm: fx.GraphModule,
        captured: fx.GraphModule,
        example_inputs: Sequence[Any],
    ) -> Callable[..., Any]:
        """Lower the rewritten Dynamo graph; if that loses collectives, the captured one.

        Where a split block does not pay (:mod:`kareus.compiler.split_pricing`), the region's
        Dynamo graph is rewritten again from the captured one by those verdicts, and lowered.
        """
        try:
            return self._lower(region, gm, example_inputs)
        except SplitDeclined as declined:
            region.inputs = after_declined(region.inputs, declined)
            gm = self._run_graph_passes(region, "dynamo", captured, example_inputs)
            try:
                return self._lower(region, gm, example_inputs)
            finally:  # another batch size is priced afresh
                region.inputs = dataclasses.replace(region.inputs, priced=None)
        except LostCollectivesError as err:
            if gm is captured or self.config.strict:
                raise
            # The rewritten graph lost collectives on its way through AOTAutograd: run the
            # region as captured, and say so loudly.
            region.warn(f"region runs as captured, unchanged: {err}")
            region.undo_split(err.detail)
            region.graphs["dynamo"].final_code = region.graphs["dynamo"].captured_code
            return self._lower(region, captured, example_inputs)

    def _lower(
        self, region: Region, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        run = functools.partial(self._run_graph_passes, region)
        plan = functools.partial(self._plan_region, region)
        region.codegen = Codegen(self.config.codegen)

        def priced(graphs: Mapping[str, fx.GraphModule]) -> None:
            verdicts = judge(region.inputs, self.config, region.findings, graphs)
            region.split_prices.update(verdicts)
            if not all(split for split, _text in verdicts.values()):
                raise SplitDeclined(verdicts)

        if self.config.codegen == "inductor":
            return lower_with_inductor(
                gm,
                example_inputs,
                run_passes=run,
                on_graphs=plan,
                options=self.inductor_options,
                min_cut=self.config.min_cut,
                on_partition=priced,
            )
        return lower_with_aot(
            gm,
            example_inputs,
            config=self.config,
            region=region,
            run_passes=run,
            on_graphs=plan,
            on_partition=priced,
        )

    def _plan_region(self, region: Region, compiled: Compiled) -> None:
        """Plan the region at compile time (when asked to) and rewrite both graphs by it.

        The functions already returned pick the new graphs up at their next call.
        """
        if not self._plan_for and self._planning and self._apply_planned_clocks:
            note = (
                "no clock plan: clocks='auto' asked for one, but this process has no GPU "
                "kareus knows (pass gpu= to plan for a GPU type)"
            )
            if note not in region.notes:
                region.notes.append(note)
        if not self._plan_for or region.inputs.planned:
            return
        if self.config.gpu is None and region.device != "cuda":
            # The GPU this process could use is not the one this region runs on: no plan
            # for a model on the CPU unless gpu= names one.
            note = (
                f"no clock plan: the region runs on {region.device or 'no device'}, not on "
                f"this machine's {self._plan_for} (pass gpu= to plan for a GPU type anyway)"
            )
            if note not in region.notes:  # (lowered again for each batch size)
                region.notes.append(note)
            return
        plan = apply_plan.plan_region(region, str(self._plan_for), self.config.select)
        if plan is None:
            return
        pool = None
        if dist.is_available() and dist.is_initialized():
            self._pool = pool = job_pool()
        # One runtime for the GPU: each planned region's instructions are a "stage" of it,
        # numbered by region, so that its switches apply its own clocks. Clocks planned here
        # are applied only when asked (clocks="auto" or a controller): else a dry run.
        # (the dry run stands for this process's GPU: measured energy reads that one)
        dry = (
            None
            if self._apply_planned_clocks
            else DryRunClocks(
                index=local_cuda_index(), why="clocks= not given: planned clocks are recorded only"
            )
        )
        uid = region.inputs.index
        steps = apply_plan.steps(plan, 0, as_stage=uid)
        self.runtime = self._runtime_with(steps, plan, dry)
        if dry is not None:
            apply_plan.note_dry_run(region)
        region.inputs = dataclasses.replace(
            region.inputs,
            plan=plan,
            planned=True,  # made for this very graph: nothing to check
            decisions=Decisions(plan.decisions_for(0)),
            clock_runtime=self.runtime,
            clock_stage=uid,
            communicator_pool=pool,
        )
        # The forward that ran before the plan existed was this region's first instruction.
        self.runtime.count_unswitched(uid, "forward", uid, region.early_forward_runs)
        # Rewrite both graphs by the plan, from the captured graphs.
        region.findings.partitions = None  # cut again from the plan's rewrite
        for kind in ("forward", "backward"):
            g, inputs, _old = compiled[kind]
            compiled[kind] = (g, inputs, self._run_graph_passes(region, kind, g, inputs))

    def _run_graph_passes(
        self, region: Region, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> fx.GraphModule:
        """Run the pipeline on one graph; on failure keep the captured graph unless strict."""
        record = GraphRecord(kind, gm, num_inputs=len(example_inputs))
        region.graphs[kind] = record
        ctx = PassContext(self.config, kind, region.findings, example_inputs, inputs=region.inputs)
        # The passes rewrite a copy of the graph so that a failure leaves the captured one.
        work = copy_module(gm)
        try:
            out, records = run_passes(work, pipeline.PIPELINE, ctx)
        except PassError as err:
            region.history.extend(getattr(err, "records", []))
            if isinstance(err.__cause__, PlanMismatchError):
                raise err.__cause__ from None  # the message says all; no pass went wrong
            if self.config.strict:
                raise
            region.warn(f"{kind} graph runs as captured, unchanged: {err}")
            record.final_code = record.captured_code
            if kind == "dynamo":
                region.undo_split(err.detail)
            return gm
        region.history.extend(records)
        record.final_code = out.code  # generated when the last pass that changed it ran
        record.final = out
        return out


class Codegen(str):
    """Which codegen ran a region's rewritten graphs, as ``kareus.explain`` shows it."""

    def to_text(self) -> str:
        """Say which codegen ran and what it means."""
        if self == "inductor":
            return "inductor: TorchInductor compiled the rewritten graphs (fused kernels)"
        return (
            "python: the rewritten graphs ran op by op as eager PyTorch's kernels (a "
            "debugging codegen; the default is inductor)"
        )


_PIECES = (
    "this graph is one of several pieces of one Dynamo graph (under DDP, Dynamo's DDPOptimizer "
    "cuts a graph at the gradient buckets): a layer cut between pieces is left whole. Set "
    "torch._dynamo.config.optimize_ddp = False (DDP still overlaps its all-reduces with the "
    "backward of the layers before), or make the buckets hold whole layers (bucket_cap_mb)"
)


class _DefaultBackend:
    """The backend behind ``torch.compile(model, backend="kareus")``, made on first use.

    Made at import, a :class:`KareusBackend` would depend on the machine before the program
    chose a GPU (``torch.cuda.set_device``); this stand-in makes it when Dynamo first hands
    it a graph. ``torch.compile``'s ``mode=`` and ``options=`` reach it as keywords: each
    combination has its own backend (``options`` may hold Config fields too).
    """

    def __init__(self) -> None:
        self._backends: dict[str, KareusBackend] = {}

    @property
    def backend(self) -> KareusBackend:
        """The shared backend without a mode or options (made now if it was not)."""
        return self.backend_for()

    def backend_for(
        self, mode: str | None = None, options: Mapping[str, Any] | None = None
    ) -> KareusBackend:
        """Return the shared backend of ``mode`` and ``options`` (made now if it was not)."""
        key = repr((mode, sorted((options or {}).items())))
        if key not in self._backends:
            self._backends[key] = KareusBackend(mode=mode, options=options)
        return self._backends[key]

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """Compile one Dynamo graph with the shared backend of ``mode`` and ``options``."""
        return self.backend_for(mode, options)(gm, example_inputs)

    def __repr__(self) -> str:
        made = ", ".join(map(repr, self._backends.values()))
        return f"default {made}" if made else "default KareusBackend (unused)"


def _parameters(example_inputs: Sequence[Any]) -> list[nn.Parameter]:
    """Return the parameters among a graph's inputs (the model's, which Dynamo passes in)."""
    return [v for v in example_inputs if isinstance(v, nn.Parameter)]


default_backend = _DefaultBackend()
"""The backend behind ``torch.compile(model, backend="kareus")`` (shared by such calls)."""


def _clock_choice(clocks: ClockController | str | None) -> tuple[ClockController | None, bool]:
    """Return the controller asked for and whether compile-time plans' clocks are applied.

    The controller None means this process's GPU's, made when needed. Clocks planned at
    compile time are applied only when asked: ``"auto"`` or a controller.

    Raises:
        ValueError: ``clocks`` is a string other than ``"auto"``.
    """
    if isinstance(clocks, str):
        if clocks != "auto":
            raise ValueError(
                f"clocks={clocks!r}: pass 'auto' to apply the clocks kareus plans at compile "
                "time on this process's GPU, or a kareus.runtime.clocks controller"
            )
        return None, True
    return clocks, clocks is not None


def compile(
    model: T,
    *,
    config: Config | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    disable: bool = False,
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
        mode: as in ``torch.compile``: ``"default"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``, or ``"reduce-overhead"`` (CUDA graphs) where
            no clock plan switches clocks between kernels.
        options: as in ``torch.compile``, Inductor's config options; Config fields are
            taken too.
        disable: as in ``torch.compile``: return ``model`` unchanged (a no-op).
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
    backend = KareusBackend(
        config, decisions=decisions, plan=plan, mode=mode, options=options, **backend_options
    )
    if disable:
        return model
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(compiled, nn.Module):
        marks = BatchMarks(
            backend.config.batch_dim or 0,
            model,
            mark=backend.config.nanobatches != 1,
            along=backend.config.split_along,
        )
        compiled.register_forward_pre_hook(marks.mark, with_kwargs=True)
        compiled.register_forward_hook(marks.unmark, always_call=True)
        compiled._kareus_backend = backend  # type: ignore[assignment]
        compiled.register_state_dict_post_hook(strip_orig_prefix)
        compiled.register_load_state_dict_pre_hook(add_orig_prefix)
    else:
        compiled._kareus_backend = backend  # type: ignore[attr-defined]
    return compiled  # type: ignore[return-value]


def find_backend(compiled: object) -> KareusBackend | None:
    """Return the kareus backend that compiled ``compiled``, or None."""
    backend = getattr(compiled, "_kareus_backend", None)
    if isinstance(backend, KareusBackend):
        return backend
    if isinstance(backend, _DefaultBackend):
        return backend.backend
    # torch.compile(model, backend=...) wraps the backend in a chain of callables.
    obj = getattr(dynamo_context(compiled), "callback", None)
    kwargs: dict[str, Any] = {}
    for _ in range(16):
        if isinstance(obj, _DefaultBackend):
            return obj.backend_for(**kwargs)
        if obj is None or isinstance(obj, KareusBackend):
            return obj
        given = getattr(obj, "kwargs", None)  # torch.compile's mode and options
        kwargs = given if isinstance(given, dict) and given else kwargs
        nxt = getattr(obj, "_torchdynamo_orig_backend", None)
        obj = nxt if nxt is not None else getattr(obj, "compiler_fn", None)
    return None

"""The private PyTorch internals kareus reads, in one place, each with a safe fallback.

kareus reads a few things PyTorch does not promise to keep. Each is read here, behind a
function that returns None (or the conservative answer) where the installed PyTorch keeps
it elsewhere, so that a PyTorch upgrade costs kareus an optimisation, never a wrong result:
:func:`self_test` says which of them this PyTorch still provides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class TracedFrame:
    """What Dynamo is compiling: the frame's code and whether a graph break ended it.

    Attributes:
        qualname: the qualified name of the frame's code (``Layer.forward``), or None.
        graph_break: True when the graph ends at a graph break (the frame goes on in a
            resume function), False when it ends at the frame's return, None when unknown.
    """

    qualname: str | None
    graph_break: bool | None
    piece: bool = False
    break_reason: str = ""
    """Where and why Dynamo broke the graph ("moe.py:177: Dynamic shape operator"), if it did."""

    @property
    def whole_call(self) -> bool:
        """Whether the graph is known to hold a whole call of the frame's code."""
        return self.qualname is not None and self.graph_break is False and not self.piece


def traced_frame() -> TracedFrame:
    """Return the frame Dynamo is compiling now (call it from a ``torch.compile`` backend).

    Read from Dynamo's tracing context (its first traced code is the frame's own) and the
    current instruction translator's compile reason.
    """
    context = torch._guards.TracingContext.try_get()
    codes = getattr(context, "traced_code", None) or ()
    qualname = getattr(codes[0], "co_qualname", None) if codes else None
    graph_break, why = None, ""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        reason = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None)
        graph_break = getattr(reason, "graph_break", None)
        if graph_break is True:
            why = _break_reason(reason)
    except (ImportError, AttributeError, AssertionError, IndexError):
        graph_break = None
    return TracedFrame(
        qualname, graph_break if isinstance(graph_break, bool) else None, ddp_piece(), why
    )


def _break_reason(reason: Any) -> str:
    """Say where and why a graph break happened: ``file.py:line: first line of the reason``."""
    text = str(getattr(reason, "reason", "") or "").strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = next((ln for ln in lines if not ln.lower().startswith("graph break")), "")
    stack = getattr(reason, "user_stack", None) or []
    at = ""
    if stack:
        frame = stack[-1]
        name = str(getattr(frame, "filename", "")).rsplit("/", 1)[-1]
        at = f"{name}:{getattr(frame, 'lineno', '')}"
    return ": ".join(p for p in (at, first) if p)


def ddp_piece() -> bool:
    """Whether the graph being compiled is one piece of a graph Dynamo's DDPOptimizer split.

    Under DDP (with ``torch._dynamo.config.optimize_ddp``) Dynamo cuts a frame's graph at the
    gradient buckets and compiles each piece on its own, from ``SubmodCompiler.compile_submod``
    (a graph of one bucket is compiled whole). Where this PyTorch has no such method, any
    graph compiled under DDP counts as a piece: a piece is never taken for a whole call.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not torch._dynamo.config.optimize_ddp:
        return False
    if DistributedDataParallel._get_active_ddp_module() is None:
        return False
    code = _submod_compiler_code()
    if code is None:
        return True
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def dynamo_function_name(name: str) -> str:
    """Return the name of the function a Dynamo graph calls, without Dynamo's wrapper prefix.

    torch 2.11's Dynamo calls ``DTensor.from_local``, ``to_local`` and ``redistribute``
    through wrappers named ``"prim from_local"``, ``"prim_to_local"`` and
    ``"prim_redistribute"`` that bind the non-tensor arguments (placements among them);
    later ones call them by their own names.
    """
    for prefix in ("prim ", "prim_"):
        if name.startswith(prefix) and name[len(prefix) :] in _DTENSOR_CALLS:
            return name[len(prefix) :]
    return name


_DTENSOR_CALLS = frozenset({"from_local", "to_local", "redistribute"})


def invoke_subgraph() -> Any:
    """Return PyTorch's ``invoke_subgraph`` higher-order op (None in this PyTorch)."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def call_id(node: fx.Node) -> Any:
    """Return the number AOTAutograd gives an ``invoke_subgraph`` call (None: not given).

    The forward call of a body and the backward call that differentiates it carry the same
    number in ``meta["custom"]["call_id"]``; the backward node's other metadata does not
    say which forward call it belongs to.
    """
    custom = node.meta.get("custom")
    return custom.get("call_id") if isinstance(custom, dict) else None


SEQ_NR = "seq_nr"
"""The node metadata key of autograd's sequence number: a forward op and the backward ops
that differentiate it share one."""


@contextlib.contextmanager
def input_mutation_check_off() -> Iterator[None]:
    """Skip ``invoke_subgraph``'s per-call re-trace looking for input mutation, meanwhile.

    Before it differentiates a higher-order op, PyTorch re-traces its body on every call
    to find whether it writes its inputs. The caller guarantees that no body does.

    Raises:
        InternalsChanged: this PyTorch has no such switch (the caller lowers op by op).
    """
    hop = invoke_subgraph()
    flag = "_supports_training_input_mutation"
    if hop is None or not hasattr(hop, flag):
        raise InternalsChanged(f"invoke_subgraph has no {flag} switch in this PyTorch")
    before = getattr(hop, flag)
    setattr(hop, flag, True)
    try:
        yield
    finally:
        setattr(hop, flag, before)


class InternalsChanged(RuntimeError):
    """The installed PyTorch does not keep an internal as kareus reads it."""


@functools.cache
def outlining_problem() -> str | None:
    """Say why this PyTorch cannot lower outlined blocks soundly (None: it can).

    Lowering a block once and reusing it (``invoke_subgraph``) needs the forward and the
    backward call of each body paired by :func:`call_id`, and the switch of
    :func:`input_mutation_check_off`. Both are checked by differentiating two calls of
    one tiny body, outside any caller's tracing context, once per process: ``sin(x * w)``
    twice, whose gradients must equal eager's exactly.
    """
    hop = invoke_subgraph()
    if hop is None:
        return "this PyTorch has no invoke_subgraph"
    try:
        with input_mutation_check_off():
            pass
        graphs, grads, expected = _differentiate_two_calls(hop)
    except Exception as err:  # any failure: lower op by op
        return f"differentiating invoke_subgraph calls failed ({type(err).__name__}: {err})"
    forward, backward = (
        sorted(
            (
                call_id(n)
                for n in graphs.get(kind, fx.GraphModule({}, fx.Graph())).graph.nodes
                if n.op == "call_function" and n.target is hop
            ),
            key=repr,
        )
        for kind in ("forward", "backward")
    )
    if len(forward) != 2 or None in forward or forward != backward:
        return (
            "invoke_subgraph's forward and backward calls are not paired by call number "
            f"(forward {forward}, backward {backward})"
        )
    # compared in a thread of its own too: a caller's fake tensor mode would take the
    # real gradients for tensors it does not know
    pairs = list(zip(grads, expected, strict=True))
    if not _in_own_thread(lambda: all(torch.equal(a, b) for a, b in pairs)):
        return "gradients through invoke_subgraph differ from eager's"
    return None


def _differentiate_two_calls(hop: Any) -> tuple[dict[str, fx.GraphModule], list[Any], list[Any]]:
    """Differentiate ``sin(sin(x * w1) * w2).sum()`` with each ``sin(a * b)`` a body call."""

    class _Body(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.sin(a * b),)

    body = fx.symbolic_trace(_Body())

    def twice(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        inner = hop(body, "kareus_self_test", x, w1)[0]
        return hop(body, "kareus_self_test", inner, w2)[0].sum()

    def eager(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.sin(x * w1) * w2).sum()

    return _through_aot(twice, eager, 3)


@functools.cache
def seq_nr_pairs() -> bool:
    """Whether AOTAutograd gives a backward op its forward op's :data:`SEQ_NR`.

    Checked once per process on ``sin(x * w)``: the backward's ``cos`` must carry the
    forward ``sin``'s number. Where it does not, blocks are told by data flow alone.
    """

    def once(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * w).sum()

    try:
        graphs, _grads, _expected = _through_aot(once, once, 2)
    except Exception:  # any failure: do not rely on the numbers
        return False
    numbers = {
        kind: {str(n.target): n.meta.get(SEQ_NR) for n in gm.graph.nodes if n.op == "call_function"}
        for kind, gm in graphs.items()
    }
    sin = numbers.get("forward", {}).get("aten.sin.default")
    cos = numbers.get("backward", {}).get("aten.cos.default")
    return isinstance(sin, int) and sin == cos


def _through_aot(
    fn: Any, eager: Any, leaves: int
) -> tuple[dict[str, fx.GraphModule], list[Any], list[Any]]:
    """Differentiate ``fn`` through AOTAutograd and ``eager`` eagerly, on the same leaves.

    Runs in a thread of its own (:func:`_in_own_thread`): outside any caller's fake tensor
    mode and tracing context. Returns AOTAutograd's forward and backward
    graphs, ``fn``'s gradients and ``eager``'s.
    """
    return _in_own_thread(lambda: _through_aot_here(fn, eager, leaves))


def _in_own_thread(work: Any) -> Any:
    """Run ``work()`` in a thread of its own and return what it returns (or raise its error).

    The checks compile and differentiate while a caller may be inside a compilation (a
    region lowered within Dynamo's call to the backend): Dynamo's compile metrics, the
    tracing context and the dispatch modes are per thread, so a thread of its own leaves
    the caller's untouched (run in place, the check's backward compile set a compile metric
    the caller's compile had set: "Metric(s) {'is_forward'} have already been set").
    """
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as err:  # handed to the caller
            out["error"] = err

    thread = threading.Thread(target=run, name="kareus-torch-internals-check")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _through_aot_here(
    fn: Any, eager: Any, leaves: int
) -> tuple[dict[str, fx.GraphModule], list[Any], list[Any]]:
    from functorch.compile import aot_function, make_boxed_func
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs: dict[str, fx.GraphModule] = {}

    def keep(kind: str) -> Any:
        def compiler(gm: fx.GraphModule, _inputs: object) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generator = torch.Generator().manual_seed(0)
        values = [torch.randn(3, generator=generator) for _ in range(leaves)]
        inputs = [v.clone().requires_grad_() for v in values]
        compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
        with tracing(TracingContext(FakeTensorMode())):
            compiled(*inputs).backward()
        plain = [v.clone().requires_grad_() for v in values]
        expected = torch.autograd.grad(eager(*plain), plain)
    return graphs, [i.grad for i in inputs], list(expected)


def custom_partitioner_base() -> type | None:
    """Return Inductor's base class for a custom partitioner (None: this PyTorch has none).

    ``torch._inductor.config.custom_partitioner_fn`` takes an instance; kareus runs its
    passes there, on the forward and backward together, before Inductor compiles them.
    """
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
    except ImportError:
        return None
    if not hasattr(inductor_config, "custom_partitioner_fn"):
        return None
    return CustomPartitionerFn  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class InductorLowering:
    """What Inductor does to a graph before it generates code, for the python codegen.

    Attributes:
        decompositions: Inductor's decomposition table (what AOTAutograd traces into).
        partition_fn: Inductor's partition step: its joint-graph passes, then the
            partitioner given as ``partitioner_fn_override``.
    """

    decompositions: dict[Any, Any]
    partition_fn: Any


@functools.cache
def inductor_lowering() -> InductorLowering | None:
    """Return Inductor's stages before code generation (None: this PyTorch's differ).

    ``torch._inductor.compile_fx.partition_fn`` runs the joint-graph passes and takes the
    partitioner to run after them (``partitioner_fn_override``: torch 2.13 has it).
    """
    import inspect

    try:
        from torch._inductor import compile_fx
        from torch._inductor.decomposition import select_decomp_table
    except ImportError:
        return None
    partition = getattr(compile_fx, "partition_fn", None)
    if partition is None:
        return None
    if "partitioner_fn_override" not in inspect.signature(partition).parameters:
        return None
    return InductorLowering(dict(select_decomp_table()), partition)


def resolve_group(name: str | None) -> Any:
    """Return the process group registered as ``name`` (c10d's private lookup).

    Raises what c10d raises for a name it does not know, or without a default group.
    """
    import torch.distributed as dist

    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def register_process_group(name: str, group: Any) -> None:
    """Register a group of one rank under ``name`` (c10d's private registries).

    A process group written in Python (:class:`kareus.testing.EmulatedGroup`) is not made by
    ``init_process_group``, so nothing registers it otherwise: funcol finds a group by name,
    ``torch.distributed``'s queries by the world's maps.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    c10d._register_process_group(name, group)  # type: ignore[arg-type]
    # c10d's world maps, where dist.get_rank(group), dist.get_backend(group) and Inductor's
    # overlap scheduler look a group up (a group of one: this process is its rank 0)
    world = c10d._world
    world.pg_map[group] = (group.getBackendName(), None)  # type: ignore[assignment]
    world.pg_names[group] = name  # type: ignore[assignment]
    world.pg_group_ranks[group] = {dist.get_rank() if dist.is_initialized() else 0: 0}


def dynamo_context(compiled: Any) -> Any:
    """Return the Dynamo context of what ``torch.compile`` returned, or None.

    The context's ``callback`` calls the backend. An ``OptimizedModule`` holds it as
    ``dynamo_ctx``; a compiled function (and the call of a module compiled in place,
    ``module.compile()``, kept as ``_compiled_call_impl``) holds it in its closure, as
    ``self``.
    """
    inner = getattr(compiled, "_compiled_call_impl", None)
    if isinstance(compiled, torch.nn.Module) and inner is not None:
        compiled = inner
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is not None:
        return ctx
    code = getattr(compiled, "__code__", None)
    cells = getattr(compiled, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells, strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            if name == "self" and hasattr(cell.cell_contents, "callback"):
                return cell.cell_contents
    return None


# Private names the compiler, the passes and the runtime use, read here (lazily where the
# module is heavy to import) so that a PyTorch that moves one breaks this file only.

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


def current_compile_id() -> Any:
    """Return Dynamo's id of the frame compiling now (None outside a compile)."""
    return torch._guards.CompileContext.current_compile_id()


def inductor_config() -> Any:
    """Return Inductor's config module (``torch._inductor.config``)."""
    import torch._inductor.config as config

    return config


def functorch_config() -> Any:
    """Return AOTAutograd's config module (``torch._functorch.config``)."""
    import torch._functorch.config as config

    return config


def inductor_mode_options(mode: str | None) -> dict[str, Any]:
    """Return the Inductor options ``torch.compile``'s ``mode`` stands for."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(mode))


def inductor_compilers() -> tuple[Any, Any]:
    """Return Inductor's ``compile_fx`` and ``compile_fx_inner``."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def inductor_choices_handler(handler: Any) -> Any:
    """Return a context in which ``handler`` makes Inductor's scheduling choices."""
    from torch._inductor.virtualized import V

    return V.set_choices_handler(handler)


def inductor_choices_type() -> Any:
    """Return Inductor's ``InductorChoices`` (None where this PyTorch has none)."""
    try:
        from torch._inductor.choices import InductorChoices
    except ImportError:
        return None
    return InductorChoices


def aot_autograd_backend(**kwargs: Any) -> Any:
    """Return Dynamo's AOTAutograd backend built with ``kwargs``."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def aot_partitions() -> tuple[Any, Any]:
    """Return AOTAutograd's default and min-cut (Inductor's) partition functions."""
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    return default_partition, min_cut_rematerialization_partition


def grouped_mm() -> Any:
    """Return ``torch._grouped_mm`` (GEMMs of row groups cut by offsets); None without it."""
    return getattr(torch, "_grouped_mm", None)


def fake_tensor_mode_type() -> type:
    """Return ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def dynamo_tracing() -> tuple[Any, Any, Any, Any]:
    """Return Dynamo's ``LocalSource``, ``AttrSource``, ``TracingContext`` and ``tracing``."""
    from torch._dynamo.source import AttrSource, LocalSource
    from torch._guards import TracingContext, tracing

    return LocalSource, AttrSource, TracingContext, tracing


@contextlib.contextmanager
def real_dispatch() -> Iterator[None]:
    """Run real kernels here, outside fake tensors and Python dispatch (a compile's trace)."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def self_test() -> dict[str, bool]:
    """Compile tiny modules and say which internals this PyTorch still provides."""
    import torch._dynamo

    seen: list[TracedFrame] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        seen.append(traced_frame())
        return gm.forward

    class _Whole(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class _Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    x = torch.ones(2)
    for module in (_Whole(), _Broken()):
        torch.compile(module, backend=backend)(x)
    in_place = _Whole()
    in_place.compile(backend=backend)
    whole = seen[0] if seen else TracedFrame(None, None)
    broken = seen[1] if len(seen) > 1 else TracedFrame(None, None)
    return {
        "traced frame name": whole.qualname is not None
        and whole.qualname.endswith("_Whole.forward"),
        "graph break told": whole.graph_break is False and broken.graph_break is True,
        "DDP's graph pieces told": _submod_compiler_code() is not None,
        "invoke_subgraph calls paired and differentiated": outlining_problem() is None,
        "backward ops numbered as their forward op": seq_nr_pairs(),
        "Inductor takes a custom partitioner": custom_partitioner_base() is not None,
        "Inductor's partition step takes a partitioner": inductor_lowering() is not None,
        "the backend of a module compiled in place found": getattr(
            dynamo_context(in_place), "callback", None
        )
        is not None,
    }


def _submod_compiler_code() -> types.CodeType | None:
    """Return the code DDPOptimizer compiles each graph piece from (None in this PyTorch)."""
    from torch._dynamo.backends import distributed

    method = getattr(getattr(distributed, "SubmodCompiler", None), "compile_submod", None)
    return getattr(method, "__code__", None)

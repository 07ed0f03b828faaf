"""Annotate every node of the AOT graphs with what it costs on a GPU.

Each call node gets an :class:`~kareus.ir.costs.OpCost` under ``node.meta["kareus"]``: its op
class (GEMM-like, attention, memory-bound, view/metadata, collective issue or wait), FLOPs
(from PyTorch's FLOP formulas), bytes read and written, and dtype. Symbolic sizes are
resolved to the values of the example inputs (their hints), so a plan is made for the
shapes the model was first called with. A collective's issue node also gets the number of
nodes its group's ranks span under ``node.meta["kareus_nodes"]`` (``Config.gpus_per_node``
GPUs a node): a group across nodes is carried by the network.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from kareus._torch_internals import OpOverload, resolve_group
from kareus.ir.costs import OpClass, OpCost
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.census import is_functional_collective, is_wait

META_KEY = "kareus"
NODES_KEY = "kareus_nodes"
DEFAULT_GPUS_PER_NODE = 8

_aten = torch.ops.aten
_GEMM = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten.convolution,
    _aten.convolution_backward,
    _aten._scaled_mm,
    _aten._grouped_mm,
}
_ATTENTION_PREFIXES = (
    "_scaled_dot_product",
    "_flash_attention",
    "_efficient_attention",
    "_cudnn_attention",
    "scaled_dot_product",
)
_VIEWS = {
    _aten.view,
    _aten._unsafe_view,
    _aten.reshape,
    _aten.t,
    _aten.transpose,
    _aten.permute,
    _aten.expand,
    _aten.squeeze,
    _aten.unsqueeze,
    _aten.slice,
    _aten.select,
    _aten.as_strided,
    _aten.alias,
    _aten.detach,
    _aten.split,
    _aten.split_with_sizes,
    _aten.unbind,
    _aten.narrow,
    _aten.view_as_real,
    _aten.view_as_complex,
    _aten.unflatten,
    _aten.lift_fresh_copy,
    _aten.sym_size,
    _aten.sym_numel,
    _aten.sym_stride,
}
_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def op_class(node: fx.Node) -> OpClass:
    """Return the class of a call node's op."""
    target = node.target
    name = str(target)
    if is_functional_collective(node):
        return "collective_wait" if is_wait(node) else "collective_issue"
    packet = getattr(target, "overloadpacket", None)
    if packet in _GEMM:
        return "gemm"
    op_name = getattr(packet, "__name__", name)
    if op_name.startswith(_ATTENTION_PREFIXES):
        return "attention"
    if packet in _VIEWS or not isinstance(target, OpOverload):
        return "view"  # views, getitem and Python arithmetic on sizes move no data
    if _returns_alias(target):
        return "view"
    return "memory"


def _returns_alias(target: OpOverload) -> bool:
    returns = target._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def concrete(value: Any) -> Any:
    """Replace symbolic sizes by their hints (the example inputs' values), recursively."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    if isinstance(value, (tuple, list)):
        return type(value)(concrete(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def nbytes(t: torch.Tensor) -> int:
    """Return the bytes of ``t`` at the example inputs' sizes (a symbolic size's hint)."""
    numel = 1
    for s in concrete(tuple(t.shape)):
        numel *= s
    return numel * t.element_size()


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    if packet is _aten._grouped_mm:
        dims = _grouped_dims(node)
        return 2.0 * math.prod(dims) if dims else 0.0
    formula = flop_registry.get(packet)
    attention = op_class(node) == "attention"
    if formula is None:
        return _attention_flops(node) * _causal_fraction(node) if attention else 0.0

    def meta(v: Any) -> Any:
        if isinstance(v, fx.Node):
            v = v.meta.get("val")
        if isinstance(v, torch.Tensor):
            return torch.empty(concrete(tuple(v.shape)), dtype=v.dtype, device="meta")
        if isinstance(v, (tuple, list)):
            return type(v)(meta(x) for x in v)
        return concrete(v)

    args = [meta(a) for a in node.args]
    kwargs = {k: meta(v) for k, v in node.kwargs.items()}
    out = meta(node.meta.get("val"))
    try:
        flops = float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that cannot read these arguments: count no FLOPs
        return 0.0
    return flops * _causal_fraction(node) if attention else flops


def _argument(node: fx.Node, name: str) -> Any:
    """Return the argument ``name`` of an op call, by its schema (None when absent)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if i < len(node.args) and not arg.kwarg_only:
                return node.args[i]
            return node.kwargs.get(name, arg.default_value)
    return None


def _causal_fraction(node: fx.Node) -> float:
    """Return the share of the score matrix a causal attention computes (1 when not causal).

    PyTorch's FLOP formulas count the whole s_q x s_kv square; with ``is_causal`` (query i
    sees keys 0..i, PyTorch's top-left alignment) kernels skip the masked part, which for
    s_q = s_kv is (s + 1) / 2s of it: about half.
    """
    if _argument(node, "is_causal") is not True:
        return 1.0
    q, k = (_argument(node, n) for n in ("query", "key"))
    q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (q, k))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2:
        return 1.0
    sq, skv = concrete(q.shape[-2]), concrete(k.shape[-2])
    if sq <= 0 or skv <= 0:
        return 1.0
    seen = sq * (sq + 1) // 2 if skv >= sq else skv * (skv + 1) // 2 + (sq - skv) * skv
    return seen / (sq * skv)


def _attention_flops(node: fx.Node) -> float:
    """FLOPs of an attention op PyTorch has no formula for (e.g. the CPU kernels).

    As PyTorch's own formulas: 4·b·h·s_q·s_kv·d forward (two matmuls), 2.5 times that
    backward, for the whole square (the caller discounts causal masking).
    """
    q, k = (_argument(node, n) for n in ("query", "key"))
    q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (q, k))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return 0.0
    b, h, sq, d = concrete(tuple(q.shape))
    skv = concrete(k.shape[-2])
    flops = 4.0 * b * h * sq * skv * d
    return flops * 2.5 if "backward" in str(node.target) else flops


def annotate_node(node: fx.Node) -> OpCost:
    """Return the cost of one call node (views and collectives cost no compute)."""
    cls = op_class(node)
    out = node.meta.get("val")
    dtype = next((t.dtype for t in _tensors(out)), torch.float32)
    name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if cls == "view":
        return OpCost(cls, 0.0, 0.0, name, node.name)
    read = sum(nbytes(t) for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
    written = sum(nbytes(t) for t in _tensors(out))
    if cls in ("collective_issue", "collective_wait"):
        # the full tensor: an all-gather's output, a reduce-scatter's input, the larger side
        # of an all-to-all whose splits differ (a rank that receives more than it sends)
        return OpCost(cls, 0.0, float(max(read, written)), name, node.name)
    dims = _matmul_dims(node) if cls == "gemm" else ()
    return OpCost(cls, _flops(node), float(read + written), name, node.name, dims)


_MATMUL_OPERANDS: dict[Any, tuple[int, int]] = {  # the (a, b) operands of a @ b
    _aten.mm: (0, 1),
    _aten.addmm: (1, 2),
    _aten.bmm: (0, 1),
    _aten.baddbmm: (1, 2),
    _aten._scaled_mm: (0, 1),
}


def _grouped_dims(node: fx.Node) -> tuple[int, ...]:
    """Return (groups, M, N, K) of a grouped matmul, per group on average; () if unread.

    ``torch._grouped_mm`` multiplies G groups: a 2-D operand is cut into the groups by
    offsets along its M (or, 2-D by 2-D, the weight gradient's, along K), a 3-D one holds
    a matrix per group. Its FLOPs are 2·G·M·N·K.
    """
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2]]
    shapes = [v.shape for v in (*vals, node.meta.get("val")) if isinstance(v, torch.Tensor)]
    if len(shapes) != 3:
        return ()
    a, b, o = (concrete(tuple(s)) for s in shapes)
    if len(a) == 2 and len(b) == 3:  # [M_total, K] x [G, K, N]
        return (b[0], a[0] / b[0], b[2], a[1])
    if len(a) == 3 and len(b) == 3:  # a batch of G
        return (a[0], a[1], b[2], a[2])
    if len(a) == 2 and len(b) == 2 and len(o) == 3:  # [M, K_total] x [K_total, N] -> [G, M, N]
        return (o[0], o[1], o[2], a[1] / o[0])
    if len(a) == 3 and len(b) == 2:  # [G, M, K] x [K, N_total] -> [M, N_total]
        return (a[0], a[1], o[-1] / a[0], a[2])
    return ()


def _matmul_dims(node: fx.Node) -> tuple[int, ...]:
    """Return (batch, M, N, K) of a matmul node, or () for other GEMM-class ops."""
    if getattr(node.target, "overloadpacket", None) is _aten._grouped_mm:
        dims = _grouped_dims(node)  # the tiles of every group fill the SMs together
        return tuple(math.ceil(d) for d in dims)
    where = _MATMUL_OPERANDS.get(getattr(node.target, "overloadpacket", None))
    if where is None or len(node.args) <= max(where):
        return ()
    a, b = (node.args[i] for i in where)
    a, b = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2:
        return ()
    shape_a, shape_b = concrete(tuple(a.shape)), concrete(tuple(b.shape))
    batch = shape_a[0] if len(shape_a) == 3 else 1
    return (int(batch), int(shape_a[-2]), int(shape_b[-1]), int(shape_a[-1]))


class AnnotateCosts(GraphPass):
    """Attach an ``OpCost`` to every call node of the AOT graphs."""

    name = "annotate_costs"
    graphs = frozenset({"forward", "backward", "inference"})
    after = frozenset({"split_nanobatches"})  # prices the graphs as split

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Check that the AOT graph carries ``val`` metadata to read costs from."""
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        if calls and not any("val" in n.meta for n in calls):
            raise ValueError("the graph's nodes carry no 'val' metadata to derive costs from")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Annotate; the graph's code does not change."""
        per_node = gpus_per_node(ctx.config.gpus_per_node)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.meta[META_KEY] = annotate_node(node)
                if node.meta[META_KEY].op_class == "collective_issue":
                    node.meta[NODES_KEY] = group_nodes(node, per_node)
        return PassResult(gm, modified=False)


def gpus_per_node(configured: int | None) -> int:
    """GPUs a node holds: ``configured``, else torchrun's ``LOCAL_WORLD_SIZE``, else 8."""
    if configured is not None:
        return configured
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else DEFAULT_GPUS_PER_NODE


def group_nodes(issue: fx.Node, per_node: int) -> int:
    """Return how many nodes of ``per_node`` GPUs the ranks of ``issue``'s group span.

    The group is the collective's last string argument (its registered name), its ranks
    global ranks; 1 where no process group resolves it (a graph traced without one).
    """
    name = next((a for a in reversed(issue.args) if isinstance(a, str)), None)
    if name is None or not dist.is_available() or not dist.is_initialized():
        return 1
    try:
        group = resolve_group(name)
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a name no group of this process has
        return 1
    return len({r // per_node for r in ranks}) or 1


def moves_freely(node: fx.Node) -> bool:
    """Whether ``node`` can run anywhere before its users: a view, or an op on inputs alone.

    The overlap scheduler moves such ops up to their first user (``schedule_overlap``), so
    the partition cutter may count on it (``cut_partitions``).
    """
    if cost_of(node).op_class == "view":
        return True
    return all(i.op in ("placeholder", "get_attr") for i in node.all_input_nodes)


def cost_of(node: fx.Node) -> OpCost:
    """Return the annotated cost of ``node`` (a zero-cost view when it has none)."""
    cost = node.meta.get(META_KEY)
    return cost if isinstance(cost, OpCost) else OpCost("view", 0.0, 0.0, "fp32", node.name)

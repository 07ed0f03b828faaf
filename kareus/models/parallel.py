"""Tensor-parallel building blocks over functional collectives (Megatron-style).

The collectives are ``torch.ops._c10d_functional`` ops followed by ``wait_tensor``, so that
in kareus's graphs the issue and the wait of each collective are separate nodes that the
overlap scheduler can move apart. The autograd functions follow Megatron-LM:

- :func:`copy_to_tp` ("f"): identity forward, all-reduce of the gradient backward;
- :func:`reduce_from_tp` ("g"): all-reduce forward, identity backward;
- :func:`gather_from_sp` / :func:`scatter_to_sp`: all-gather forward with reduce-scatter
  backward, and the reverse (sequence parallelism);
- :func:`all_to_all`: rows exchanged by split sizes, the gradient sent back the same way
  with the sizes swapped (expert parallelism's dispatch and combine).

:class:`ColumnParallelLinear` and :class:`RowParallelLinear` shard a linear layer's weight by
output or input features across the group. :func:`gather_in_graph` shards parameters over a
data-parallel group and all-gathers them in the graph, as SimpleFSDP does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kareus._torch_internals import resolve_group

_fc = torch.ops._c10d_functional


Group = dist.ProcessGroup | str | None
"""A process group, its registered name, or None for the default group. Modules keep names,
which (unlike groups) survive ``copy.deepcopy``."""


_KNOWN: dict[str, tuple[int, int]] = {}
"""(size, rank) of groups seen by name: inside a compiled forward, resolving a group name
would break the graph, a dictionary lookup does not."""


def group_name(group: Group) -> str:
    """Return the registered name of ``group`` (the default group when None)."""
    if isinstance(group, str):
        return group
    pg = group if group is not None else dist.group.WORLD
    name: str = pg.group_name  # type: ignore[union-attr]
    _KNOWN[name] = (pg.size(), pg.rank())  # type: ignore[union-attr]
    return name


def _size_rank(group: Group) -> tuple[int, int]:
    name = group_name(group)
    if name not in _KNOWN:
        pg = resolve_group(name)
        _KNOWN[name] = (pg.size(), pg.rank())  # a group's own rank, as c10d's get_rank gives
    return _KNOWN[name]


def group_size(group: Group) -> int:
    """Return the number of ranks in ``group``."""
    return _size_rank(group)[0]


def _all_reduce(x: torch.Tensor, name: str) -> torch.Tensor:
    return _fc.wait_tensor(_fc.all_reduce(x, "sum", name))


def _all_gather(x: torch.Tensor, size: int, name: str, dim: int) -> torch.Tensor:
    if dim == 0:
        return _fc.wait_tensor(_fc.all_gather_into_tensor(x.contiguous(), size, name))
    moved = x.movedim(dim, 0).contiguous()
    out = _fc.wait_tensor(_fc.all_gather_into_tensor(moved, size, name))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, size: int, name: str, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = _fc.wait_tensor(_fc.reduce_scatter_tensor(moved, "sum", size, name))
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.name), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        return _all_reduce(x, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, name: str, dim: int) -> torch.Tensor:
        ctx.size, ctx.name, ctx.dim = size, name, dim
        return _all_gather(x, size, name, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(grad, ctx.size, ctx.name, ctx.dim), None, None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, name: str, dim: int) -> torch.Tensor:
        ctx.size, ctx.name, ctx.dim = size, name, dim
        return _reduce_scatter(x, size, name, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_gather(grad, ctx.size, ctx.name, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str
    ) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.name = out_splits, in_splits, name
        return _fc.wait_tensor(_fc.all_to_all_single(x.contiguous(), out_splits, in_splits, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = _fc.all_to_all_single(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.name)
        return _fc.wait_tensor(back), None, None, None


def copy_to_tp(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's "f": identity forward, all-reduce of the gradient in the backward."""
    return _CopyToTP.apply(x, group_name(group))


def reduce_from_tp(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's "g": all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group_name(group))


def gather_from_sp(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward."""
    return _GatherFromSP.apply(x, group_size(group), group_name(group), dim)


def scatter_to_sp(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward."""
    return _ScatterToSP.apply(x, group_size(group), group_name(group), dim)


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group = None
) -> torch.Tensor:
    """Send ``x``'s rows to the ranks in ``in_splits`` counts; receive ``out_splits`` rows.

    Row block i of ``x`` (``in_splits[i]`` rows) goes to rank i; the result holds rank j's
    block (``out_splits[j]`` rows) in rank order. The backward sends the gradient back.
    """
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group_name(group))


def _shard(full: int, world: int, what: str) -> int:
    if full % world:
        raise ValueError(f"{what}={full} is not divisible by the tensor-parallel size {world}")
    return full // world


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across the group.

    The input is replicated ("f" before the matmul); the output stays sharded. Several
    column-parallel layers reading one input (Q, K and V; gate and up) should share one "f":
    apply :func:`copy_to_tp` once and build them with ``copy_input=False``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group = None,
        bias: bool = False,
        copy_input: bool = True,
    ) -> None:
        super().__init__()
        self.group = group_name(group)
        self.copy_input = copy_input
        world = group_size(group)
        self.linear = nn.Linear(in_features, _shard(out_features, world, "out_features"), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this rank's shard of ``x @ W.T``."""
        return self.linear(copy_to_tp(x, self.group) if self.copy_input else x)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across the group.

    The input arrives sharded; partial outputs are summed with an all-reduce ("g").
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.group = group_name(group)
        world = group_size(group)
        self.linear = nn.Linear(_shard(in_features, world, "in_features"), out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the full ``x @ W.T`` from this rank's input shard."""
        return reduce_from_tp(self.linear(x), self.group)


def group_rank(group: Group) -> int:
    """Return this process's rank within ``group``."""
    return _size_rank(group)[1]


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split across the group.

    Each rank looks up the ids in its own range, zeroes the others, and the partial
    embeddings are summed with an all-reduce ("g").
    """

    def __init__(self, vocab_size: int, dim: int, group: Group = None) -> None:
        super().__init__()
        self.group = group_name(group)
        rows = _shard(vocab_size, group_size(group), "vocab_size")
        self.start = group_rank(group) * rows
        self.weight = nn.Parameter(torch.empty(rows, dim))
        nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the embeddings of ``ids`` (replicated on every rank)."""
        rows = self.weight.shape[0]
        outside = (ids < self.start) | (ids >= self.start + rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int, name: str
    ) -> torch.Tensor:
        logits = logits.float()
        top = _fc.wait_tensor(_fc.all_reduce(logits.amax(-1), "max", name))
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = _fc.wait_tensor(_fc.all_reduce(exp.sum(-1), "sum", name))
        outside = (labels < start) | (labels >= start + logits.shape[-1])
        local = (labels - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target = _fc.wait_tensor(_fc.all_reduce(picked, "sum", name))
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - target

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        onehot = nn.functional.one_hot(local, softmax.shape[-1]).to(softmax.dtype)
        onehot = onehot.masked_fill(outside.unsqueeze(-1), 0.0)
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: Group = None
) -> torch.Tensor:
    """Per-token cross-entropy of logits split by vocabulary across ``group`` (Megatron-style).

    ``logits`` holds this rank's vocabulary columns, starting at ``vocab_start``; the full
    logits are never gathered: the max, the softmax denominator and the target logit are
    all-reduced. Computed in fp32.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, group_name(group))


class GatheredInGraph(nn.Module):
    """A parametrization: the parameter's shard, all-gathered where the model reads it.

    Gathered along the first dimension, as SimpleFSDP's ``ReplicateComputation`` does
    without DTensor: ``all_gather_tensor_autograd`` forward, the gradient reduce-scattered
    back.
    """

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group_name(group)
        self.size = group_size(group)

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        """Return the whole parameter, gathered from every rank's shard."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(shard, 0, self.group)  # type: ignore[arg-type]

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        """Return this rank's shard of ``full`` (the parameter as stored)."""
        rank = group_rank(self.group)
        return full.chunk(self.size, 0)[rank].clone()


def gather_in_graph(model: nn.Module, group: Group) -> int:
    """Shard ``model``'s parameters over ``group`` and gather each where it is read.

    Every parameter whose first dimension the group's size divides is stored as this rank's
    shard and all-gathered in the forward (its gradient reduce-scattered in the backward),
    as SimpleFSDP writes data parallelism into the graph; the others stay replicated.
    Returns how many parameters are gathered.
    """
    from torch.nn.utils import parametrize

    size = group_size(group)
    count = 0
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] % size == 0:
                gathered = GatheredInGraph(group)
                parametrize.register_parametrization(module, name, gathered, unsafe=True)
                count += 1
    return count

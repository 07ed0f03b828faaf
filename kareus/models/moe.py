"""Mixture-of-experts feed-forward: token-choice top-k routing over grouped experts.

The dropless form Mixtral, Qwen3-MoE and torchtitan train: a linear router scores the
experts; each token takes its top ``k`` (softmax weights, renormalised over the k with
``norm_topk``). The token copies are sorted by expert, sent to the ranks holding their
experts by an all-to-all over the expert-parallel group (split sizes: the copies per rank),
run through the local experts as one grouped GEMM per projection (``torch._grouped_mm``,
SwiGLU), sent back the same way, and summed per token with their weights. An optional
shared expert (a dense SwiGLU MLP) runs on every token beside them.

Under tensor parallelism every expert's intermediate dimension is split over the TP group
(expert tensor parallelism = TP, as Megatron-LM's default): routing is computed alike on
the TP ranks, and the layer's output is all-reduced once, as a dense MLP's is.

How many tokens each expert receives is data. In a run with real tensors the counts are
read from the routing (a bincount, and under EP an all-to-all of the counts, so that each
rank knows what it receives). Tracing at scale has no data (fake tensors), so
:func:`set_planned_load` fixes the counts there at an expected load — uniform, or the
busiest expert at ``skew`` times the mean — with the traced rank holding the busiest expert:
the graphs priced are those of the rank that sets the step's pace.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kareus._torch_internals import grouped_mm
from kareus.models.config import LlamaConfig
from kareus.models.parallel import (
    Group,
    all_to_all,
    copy_to_tp,
    group_name,
    group_size,
    reduce_from_tp,
)


def planned_load(tokens: int, experts: int, top_k: int, skew: float = 1.0) -> tuple[int, ...]:
    """Return the token copies a rank sends to each expert at an expected load.

    ``tokens`` tokens each pick ``top_k`` experts: ``tokens * top_k`` copies in all. Expert 0
    takes ``skew`` times the mean (1: uniform), the others share the rest evenly (the first
    ones a copy more where it does not divide); counts add up to the copies.

    Raises:
        ValueError: a skew below 1, or above what routing allows (a token picks an expert
            at most once: no expert gets more than ``tokens`` copies).
    """
    copies = tokens * top_k
    mean = copies / experts
    most = experts / top_k
    if not 1.0 <= skew <= most:
        raise ValueError(
            f"expert skew {skew} must be between 1 (uniform load) and {most:g} (the busiest "
            f"expert takes every token: experts / experts per token)"
        )
    if experts == 1:
        return (copies,)
    busiest = min(tokens, round(skew * mean))
    each, extra = divmod(copies - busiest, experts - 1)
    return (busiest, *(each + (i < extra) for i in range(experts - 1)))


class MoE(nn.Module):
    """Top-k routed experts (and an optional shared expert) in place of the dense MLP.

    Args:
        cfg: the shape: ``num_experts``, ``experts_per_token``, ``moe_intermediate_size``,
            ``shared_expert_size``, ``norm_topk``.
        tp_group: splits every expert's intermediate dimension (and the shared expert's).
        ep_group: splits the experts: rank r of E ranks holds experts r·n/E .. (r+1)·n/E - 1.
    """

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None, ep_group: Group = None) -> None:
        super().__init__()
        tp = group_size(tp_group) if tp_group is not None else 1
        self.ep = group_size(ep_group) if ep_group is not None else 1
        self.experts, self.top_k, self.norm_topk = (
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.norm_topk,
        )
        local, h, inter = cfg.num_experts // self.ep, cfg.hidden_size, cfg.expert_size // tp
        self.router = nn.Linear(h, cfg.num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(local, h, inter) / math.sqrt(h))
        self.w_up = nn.Parameter(torch.randn(local, h, inter) / math.sqrt(h))
        self.w_down = nn.Parameter(torch.randn(local, inter, h) / math.sqrt(inter))
        self.shared: nn.ModuleList | None = None
        if cfg.shared_expert_size:
            s = cfg.shared_expert_size // tp
            self.shared = nn.ModuleList(
                [nn.Linear(h, s, bias=False), nn.Linear(h, s, bias=False), nn.Linear(s, h, False)]
            )
        self.tp_group = group_name(tp_group) if tp_group is not None else None
        self.ep_group = group_name(ep_group) if ep_group is not None else None
        self.planned: tuple[int, ...] | None = None
        """Token copies sent to each expert, fixed for tracing (:func:`set_planned_load`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the experts to ``x`` of shape [batch, seq, hidden]."""
        shape = x.shape
        if self.tp_group is not None:
            x = copy_to_tp(x, self.tp_group)
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.flatten()
        keys, order = flat.sort(stable=True)  # the token copies, grouped by expert
        routed = tokens.index_select(0, order // self.top_k)
        if self.ep_group is None and self.planned is None:
            out = self._local(routed, keys)
        else:
            out = self._experts(routed, self._counts(flat))
        out = out * weights.flatten().index_select(0, order).to(out.dtype).unsqueeze(-1)
        y = torch.zeros_like(tokens).index_add(0, order // self.top_k, out)
        if self.shared is not None:
            gate, up, down = self.shared
            y = y + down(F.silu(gate(tokens)) * up(tokens))
        if self.tp_group is not None:
            y = reduce_from_tp(y, self.tp_group)
        return y.view(shape)

    def _counts(self, chosen: torch.Tensor) -> list[int]:
        """Token copies this rank sends to each expert: planned, or read from the routing."""
        if self.planned is not None:
            return list(self.planned)
        return torch.bincount(chosen, minlength=self.experts).tolist()

    def _received(self, counts: list[int]) -> list[list[int]]:
        """Return the copies for each local expert from each rank: [source][local expert]."""
        local = self.experts // self.ep
        if self.planned is not None:  # every rank routes alike at the planned load
            mine = counts[:local]
            return [list(mine) for _ in range(self.ep)]
        sent = torch.tensor(counts, device=self.router.weight.device)
        even = [local] * self.ep
        return all_to_all(sent, even, even, self.ep_group).view(self.ep, local).tolist()

    def _experts(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run the copies (grouped by expert, ``counts`` per expert) through the experts."""
        if self.ep_group is None:
            return self._grouped(routed, counts)
        local = self.experts // self.ep
        send = [sum(counts[r * local : (r + 1) * local]) for r in range(self.ep)]
        received = self._received(counts)
        recv = [sum(row) for row in received]
        got = all_to_all(routed, recv, send, self.ep_group)
        # Received by source rank, then expert; the GEMMs want them by expert, then source.
        blocks = got.split([n for row in received for n in row])
        by_expert = [(src, e) for e in range(local) for src in range(self.ep)]
        out = self._grouped(
            torch.cat([blocks[src * local + e] for src, e in by_expert]),
            [sum(row[e] for row in received) for e in range(local)],
        )
        done = dict(zip(by_expert, out.split([received[s][e] for s, e in by_expert]), strict=True))
        back = torch.cat([done[(src, e)] for src in range(self.ep) for e in range(local)])
        return all_to_all(back, send, recv, self.ep_group)

    def _local(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Run the copies ``x`` (sorted by expert: ``keys``) through experts all on this rank.

        Nothing is read back to Python, so one graph holds the whole layer (and kareus can
        split it: :mod:`kareus.passes.routing`). In bf16: one grouped GEMM per projection,
        segmented by the counts per expert. In another dtype (the grouped GEMMs take bf16
        only): every expert on every row, each row keeping its own expert's result, which
        costs ``experts`` times the FLOPs (for tests and small runs).
        """
        mm = grouped_mm() if x.dtype == torch.bfloat16 else None
        if mm is not None:
            # histc, not bincount: its size is the experts', never the data's (one graph)
            counts = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = mm(x, self.w_gate, offs=offsets), mm(x, self.w_up, offs=offsets)
            return mm(F.silu(gate) * up, self.w_down, offs=offsets)
        out = x.new_zeros(x.shape[0], self.w_down.shape[-1])
        for e in range(self.experts):
            y = (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]
            out = torch.where((keys == e).unsqueeze(-1), y, out)
        return out

    def _grouped(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """SwiGLU of the local experts over ``x``'s rows, ``per_expert`` rows each in turn."""
        mm = grouped_mm() if x.dtype == torch.bfloat16 else None  # (its kernels take bf16)
        if mm is None:  # another dtype, or a PyTorch without grouped GEMMs: one per expert
            pieces = x.split(per_expert)
            return torch.cat(
                [
                    (F.silu(p @ self.w_gate[e]) * (p @ self.w_up[e])) @ self.w_down[e]
                    for e, p in enumerate(pieces)
                ]
            )
        offsets = torch.tensor(
            [sum(per_expert[: e + 1]) for e in range(len(per_expert))],
            dtype=torch.int32,
            device=x.device,
        )
        gate = mm(x, self.w_gate, offs=offsets)
        up = mm(x, self.w_up, offs=offsets)
        return mm(F.silu(gate) * up, self.w_down, offs=offsets)


def set_planned_load(model: nn.Module, tokens: int, skew: float = 1.0) -> int:
    """Fix every MoE layer's expert counts at the expected load of ``tokens`` tokens per rank.

    See :func:`planned_load`. Returns the number of MoE layers set.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.planned = planned_load(tokens, layer.experts, layer.top_k, skew)
    return len(layers)

"""A model and parallel plans built the way torchtitan builds its llama3 jobs.

The module names, the rotary embedding (complex ``freqs_cis``), the attention (grouped KV
heads, ``scaled_dot_product_attention``) and the tensor-parallel plan with sequence
parallelism follow torchtitan's ``llama3`` model and ``parallelize_llama`` (``apply_tp``):
norms run sequence-sharded (``SequenceParallel``), each block's input is gathered along the
sequence by ``PrepareModuleInput`` (Shard(1) -> Replicate) and each row-parallel output is
reduce-scattered back to Shard(1). Written here, not imported: torchtitan is not a
dependency of kareus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Args:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    hidden: int = 48
    max_seq_len: int = 16
    eps: float = 1e-5


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (
        torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq),
        torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk),
    )


class Attention(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.n_rep = a.n_heads // a.n_kv_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1: under TP each rank holds its own heads
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xk = torch.repeat_interleave(xk, self.n_rep, dim=2)
        xv = torch.repeat_interleave(xv, self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.hidden, bias=False)
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.eps)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's llama3 ``Transformer``: layers in a ModuleDict keyed "0", "1", ...;
    returns the logits, or the loss when labels are given (a training loop's
    ``cross_entropy(logits, labels)``)."""

    def __init__(self, a: Args) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len), persistent=False
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build(args: Args | None = None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args or Args())


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool = True) -> Transformer:
    """torchtitan's ``apply_tp`` (without float8 or async TP); ``sequence_parallel=False``
    is its plan with replicated norms (all-reduces instead of gathers and scatters)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    return model


def compile_blocks(model: Transformer, compile_fn) -> Transformer:
    """torchtitan's per-block compile: each block replaced by its compiled self."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, compile_fn(block))
    return model


class _LossAfterBreak(nn.Module):
    """The model, then a graph break, then the loss: a training step in two graphs, as
    Hugging Face's GPT-2 compiles."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def factory(tp_mesh=None, microbatch_size: int = 4, seq_len: int = 16):
    """A ``kareus plan --factory titan_style:factory`` model: torchtitan's llama3 (4 layers),
    tensor-parallel with sequence parallelism on ``tp_mesh``, its loss after a graph break;
    one step's (tokens, labels)."""
    model = build(Args(n_layers=4))
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    ids = torch.zeros(microbatch_size, seq_len, dtype=torch.long)
    return _LossAfterBreak(model), (ids, ids)

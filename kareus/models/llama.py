"""A Llama/Qwen3-style decoder: RMSNorm, RoPE, GQA attention through SDPA, SwiGLU MLP.

With ``num_experts`` the MLP is a mixture of experts (Mixtral, Qwen3-MoE;
:mod:`kareus.models.moe`), its experts split over an expert-parallel group.

Written plainly so that its graphs look like those of production models (HF transformers,
Megatron-LM, torchtitan). Options cover the variants kareus must handle: optional QK-norm
(Qwen3), tied embeddings, a plain GELU MLP, and post-norm blocks.

Parallelism, from kareus's building blocks (:mod:`kareus.models.parallel`):

- **tensor** (``tp_group``): attention heads and MLP columns are split Megatron-style, so
  each layer all-reduces twice in the forward and twice in the backward; the embedding,
  the output head and the cross-entropy are split by vocabulary.
- **context** (``cp_group``): the sequence is cut into 2 x CP chunks and rank r holds chunks
  r and 2·CP - 1 - r (Megatron-LM's load-balanced layout: every rank gets the same causal
  work; :func:`cp_shard` cuts a batch so); K and V are all-gathered along the sequence
  before attention (their gradients reduce-scattered in the backward), and each chunk's
  queries attend to the keys up to their own (the prefix, causally masked on the diagonal
  chunk), with rotary positions at the chunks' places.
- **pipeline** (``stage=(index, count)``): the model holds one stage's layers; the first
  stage embeds token ids, the last applies the head and the loss, the others map hidden
  states to hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kareus.models.config import LlamaConfig
from kareus.models.moe import MoE
from kareus.models.parallel import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    group_name,
    group_rank,
    group_size,
    vocab_parallel_cross_entropy,
)


def _size(group: Group) -> int:
    return group_size(group) if group is not None else 1


def _linear(fan_in: int, fan_out: int, group: Group, kind: str) -> nn.Module:
    if group is None:
        return nn.Linear(fan_in, fan_out, bias=False)
    if kind == "column":  # the layer's input is copied once for all its column shards
        return ColumnParallelLinear(fan_in, fan_out, group, copy_input=False)
    return RowParallelLinear(fan_in, fan_out, group)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    *,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the cosine and sine tables of rotary position embedding, [seq, head_dim].

    Positions start at ``offset`` (a context-parallel rank's chunk); the angles are
    computed in fp32 and the tables returned in ``dtype``.
    """
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    )
    pos = torch.arange(offset, offset + seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(pos, inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cp_chunks(rank: int, size: int) -> tuple[int, int]:
    """Return the two of the sequence's 2 x ``size`` chunks context-parallel ``rank`` holds."""
    return rank, 2 * size - 1 - rank


def cp_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Return context-parallel rank ``rank``'s part of ``x``: chunks rank and 2·size-1-rank.

    ``x`` is cut into 2 x ``size`` chunks along ``dim`` (the sequence); a rank's two chunks,
    one early and one late in the sequence, carry equal causal-attention work.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of the {size} context-parallel ranks")
    if size == 1:
        return x
    if x.shape[dim] % (2 * size):
        raise ValueError(
            f"a sequence of {x.shape[dim]} does not cut into 2 x {size} equal chunks: make "
            f"its length a multiple of {2 * size}"
        )
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[i] for i in cp_chunks(rank, size)], dim=dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [batch, heads, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat grouped K and V heads to ``heads`` (grouped-query attention)."""
    groups = heads // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None, cp_group: Group = None) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.dim_per_head
        cfg.check_parallel(tp=_size(tp_group))
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * hd, tp_group, "column")
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, tp_group, "column")
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, tp_group, "column")
        self.o_proj = _linear(cfg.num_heads * hd, cfg.hidden_size, tp_group, "row")
        self.tp_group = group_name(tp_group) if tp_group is not None else None
        self.cp_group = group_name(cp_group) if cp_group is not None else None
        self.cp_rank = group_rank(cp_group) if cp_group is not None else 0
        self.cp_size = _size(cp_group)
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape [batch, seq, hidden] (this rank's chunk under CP)."""
        b, s, _ = x.shape
        hd = self.cfg.dim_per_head
        if self.tp_group is not None:
            x = copy_to_tp(x, self.tp_group)
        q = self.q_proj(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout = self.cfg.dropout if self.training else 0.0
        if self.cp_group is None:
            k, v = _repeat_kv(k, v, q.shape[1])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        # One all-gather of K and V together along the sequence; the ranks' chunks are put
        # back in sequence order: every rank's first chunk, then the second ones in reverse.
        cp, c = self.cp_size, s // 2
        kv = gather_from_sp(torch.cat([k, v], dim=1), self.cp_group, dim=2)
        kv = kv.reshape(*kv.shape[:2], cp, 2, c, kv.shape[-1])
        kv = torch.cat([kv[:, :, :, 0], kv[:, :, :, 1].flip(2)], dim=2).flatten(2, 3)
        k, v = kv.chunk(2, dim=1)
        k, v = _repeat_kv(k, v, q.shape[1])
        outs = []
        for half, chunk in enumerate(cp_chunks(self.cp_rank, cp)):
            # Query i of chunk g sits at position g·c + i and sees the keys up to there.
            # (Every chunk through a mask, the first too: each rank then computes the same
            # (2·CP + 1)·c² scores, and the rank traced costs as much as any.)
            seen = (chunk + 1) * c
            mask = torch.ones(c, seen, dtype=torch.bool, device=x.device).tril(chunk * c)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, half * c : (half + 1) * c],
                    k[:, :, :seen],
                    v[:, :, :seen],
                    attn_mask=mask,
                    dropout_p=dropout,
                )
            )
        out = torch.cat(outs, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU (gated) or GELU (plain) feed-forward network."""

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.up_proj = _linear(h, i, tp_group, "column")
        self.gate_proj = _linear(h, i, tp_group, "column") if self.gated else None
        self.down_proj = _linear(i, h, tp_group, "row")
        self.tp_group = group_name(tp_group) if tp_group is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to the last dimension."""
        if self.tp_group is not None:
            x = copy_to_tp(x, self.tp_group)
        if self.gate_proj is not None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """One transformer block: attention and MLP (or experts), each with a residual connection."""

    def __init__(
        self,
        cfg: LlamaConfig,
        tp_group: Group = None,
        cp_group: Group = None,
        ep_group: Group = None,
    ) -> None:
        super().__init__()
        self.pre = cfg.norm_position == "pre"
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, tp_group, cp_group)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MoE(cfg, tp_group, ep_group) if cfg.num_experts else MLP(cfg, tp_group)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Transform ``x`` of shape [batch, seq, hidden]."""
        if self.pre:
            x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + self.dropout(self.attn(x, cos, sin)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class Llama(nn.Module):
    """Decoder-only language model; ``forward(ids, labels)`` returns the mean token loss.

    Args:
        cfg: the shape.
        tp_group: a process group to split each layer, the embedding and the head across
            (tensor parallelism), or None.
        cp_group: a process group over which the sequence is split (context parallelism),
            or None. Each rank holds two of its 2 x CP chunks, ``cp_shard``'s (the
            load-balanced layout); its loss is the mean over them: average the loss and
            sum-then-average the gradients over the group as with data parallelism.
        stage: ``(index, count)`` to hold only one pipeline stage's layers.
        ep_group: a process group over which a mixture-of-experts model's experts are split
            (expert parallelism; its ranks hold different tokens, as data-parallel ranks do).

    The first stage's ``forward`` takes token ids, the others hidden states [batch, seq,
    hidden]; the last returns logits (or the loss when ``labels`` are given), the others
    hidden states.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        tp_group: Group = None,
        cp_group: Group = None,
        *,
        stage: tuple[int, int] = (0, 1),
        ep_group: Group = None,
    ) -> None:
        super().__init__()
        index, count = stage
        if not 0 <= index < count:
            raise ValueError(f"stage={stage} must be (index, count) with 0 <= index < count")
        cfg.check_parallel(tp=_size(tp_group), cp=_size(cp_group), pp=count, ep=_size(ep_group))
        self.cfg = cfg
        self.first, self.last = index == 0, index == count - 1
        self.tp_group = group_name(tp_group) if tp_group is not None else None
        self.cp_rank = group_rank(cp_group) if cp_group is not None else 0
        self.cp_size = _size(cp_group)
        per_stage = cfg.num_layers // count
        self.layer_offset = index * per_stage
        self.embed: nn.Module | None = None
        if self.first:
            self.embed = (
                nn.Embedding(cfg.vocab_size, cfg.hidden_size)
                if tp_group is None
                else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group)
            )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp_group, cp_group, ep_group) for _ in range(per_stage)
        )
        self.norm: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = (
                nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                if tp_group is None
                else ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp_group)
            )
        if cfg.tie_embeddings and self.embed is not None and self.lm_head is not None:
            head = self.lm_head if tp_group is None else self.lm_head.linear
            head.weight = self.embed.weight  # type: ignore[union-attr]
        self.vocab_start = (
            group_rank(tp_group) * (cfg.vocab_size // _size(tp_group)) if tp_group else 0
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Return the logits, the mean cross-entropy, or hidden states.

        Logits [batch, seq, vocab] (this rank's vocabulary shard under TP) from the last
        stage, the mean cross-entropy when ``labels`` are given, hidden states otherwise.
        """
        seq = x.shape[1]
        if self.cp_size > 1 and seq % 2:
            raise ValueError(
                f"a context-parallel rank holds two equal chunks of the sequence (cp_shard), "
                f"but got {seq} tokens"
            )
        dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        if self.embed is not None:
            x = self.embed(x)
            dtype = x.dtype
        if self.cp_size == 1:
            cos, sin = rope_tables(
                seq, self.cfg.dim_per_head, self.cfg.rope_theta, dtype=dtype, device=x.device
            )
        else:  # this rank's two chunks, at their places in the sequence
            c = seq // 2
            tables = [
                rope_tables(
                    c,
                    self.cfg.dim_per_head,
                    self.cfg.rope_theta,
                    offset=chunk * c,
                    dtype=dtype,
                    device=x.device,
                )
                for chunk in cp_chunks(self.cp_rank, self.cp_size)
            ]
            cos, sin = (torch.cat(parts) for parts in zip(*tables, strict=True))
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.norm is None or self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        if self.tp_group is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        losses = vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.tp_group)
        return losses.mean()

    def load_unsharded(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy an unsharded model's weights into this (tensor-parallel) model.

        Each parameter takes its rank's contiguous chunk along the one dimension where its
        shape differs from the full one. Only keys this model has are read (a stage's).
        """
        rank = group_rank(self.tp_group) if self.tp_group is not None else 0
        with torch.no_grad():
            for key, param in self.state_dict().items():
                src = state_dict[self._unsharded_key(key)]
                dims = [d for d in range(src.dim()) if src.shape[d] != param.shape[d]]
                if dims:
                    src = src.chunk(src.shape[dims[0]] // param.shape[dims[0]], dims[0])[rank]
                param.copy_(src)

    def _unsharded_key(self, key: str) -> str:
        parts = [p for p in key.split(".") if p != "linear"]
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + self.layer_offset)
        return ".".join(parts)

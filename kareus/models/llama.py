"""A Llama/Qwen3-style decoder: RMSNorm, RoPE, GQA attention through SDPA, SwiGLU MLP.

Written plainly so that its graphs look like those of production models (HF transformers,
Megatron-LM, torchtitan). Options cover the variants kareus must handle: optional QK-norm
(Qwen3), tied embeddings, a plain GELU MLP, and post-norm blocks. With a tensor-parallel
group, attention heads and MLP columns are split across it Megatron-style
(:mod:`kareus.parallel`): each layer then all-reduces twice in the forward and twice in the
backward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kareus.parallel import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    copy_to_tp,
    group_name,
    group_size,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a decoder. Defaults give a tiny model for tests."""

    vocab_size: int = 128
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    tie_embeddings: bool = False
    mlp: str = "swiglu"  # or "gelu"
    norm_position: str = "pre"  # or "post"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r} must be 'swiglu' or 'gelu'")
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position={self.norm_position!r} must be 'pre' or 'post'")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "tiny-4l": LlamaConfig(num_layers=4, hidden_size=64, intermediate_size=128),
    "tiny-16l": LlamaConfig(num_layers=16, hidden_size=64, intermediate_size=128),
    "tiny-qwen3": LlamaConfig(qk_norm=True, tie_embeddings=True),
}
"""Named shapes; tiny ones for tests and examples."""


def _tp_size(group: Group) -> int:
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


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the cosine and sine tables of rotary position embedding, [seq, head_dim]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [batch, heads, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        tp = _tp_size(tp_group)
        if cfg.num_kv_heads % tp:
            raise ValueError(
                f"num_kv_heads={cfg.num_kv_heads} is not divisible by the tensor-parallel size {tp}"
            )
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * hd, tp_group, "column")
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, tp_group, "column")
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, tp_group, "column")
        self.o_proj = _linear(cfg.num_heads * hd, cfg.hidden_size, tp_group, "row")
        self.tp_group = group_name(tp_group) if tp_group is not None else None
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape [batch, seq, hidden]."""
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        if self.tp_group is not None:
            x = copy_to_tp(x, self.tp_group)
        q = self.q_proj(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.cfg.dropout if self.training else 0.0
        )
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
    """One transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None) -> None:
        super().__init__()
        self.pre = cfg.norm_position == "pre"
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, tp_group)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg, tp_group)
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
        tp_group: a process group to split each layer across (tensor parallelism), or None.
            Embedding, final norm and head are replicated.
    """

    def __init__(self, cfg: LlamaConfig, tp_group: Group = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp_group) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits [batch, seq, vocab], or the mean cross-entropy when ``labels`` given."""
        cos, sin = rope_tables(ids.shape[1], self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

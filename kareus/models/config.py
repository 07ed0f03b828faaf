"""The decoder family's shape: :class:`LlamaConfig`, and the named presets.

Read by the model (:mod:`kareus.models.llama`), its mixture-of-experts layer
(:mod:`kareus.models.moe`) and the planner's tracing; it imports neither.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a decoder. Defaults give a tiny model for tests.

    ``head_dim`` defaults to ``hidden_size // num_heads`` (Qwen3 sets it explicitly).
    """

    vocab_size: int = 128
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    tie_embeddings: bool = False
    mlp: str = "swiglu"  # or "gelu"
    norm_position: str = "pre"  # or "post"
    dropout: float = 0.0
    num_experts: int = 0  # 0: a dense MLP; else routed experts (kareus.models.moe)
    experts_per_token: int = 2
    moe_intermediate_size: int = 0  # an expert's intermediate size (0: intermediate_size)
    shared_expert_size: int = 0  # a shared expert's intermediate size (0: none)
    norm_topk: bool = True  # renormalise the chosen experts' weights to sum to 1

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden_size % self.num_heads:
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
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be between 1 and "
                f"num_experts={self.num_experts}"
            )

    @property
    def expert_size(self) -> int:
        """An expert's intermediate size."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def dim_per_head(self) -> int:
        """Size of one attention head."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def check_parallel(
        self, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, seq_len: int = 0
    ) -> None:
        """Raise ValueError, naming the dimension, when a parallel size does not divide it."""
        if ep > 1 and not self.num_experts:
            raise ValueError(
                f"expert-parallel size {ep} needs a mixture-of-experts model (num_experts > 0)"
            )
        checks = [
            (tp, "tensor-parallel size", "num_kv_heads", self.num_kv_heads),
            (tp, "tensor-parallel size", "num_heads", self.num_heads),
            (tp, "tensor-parallel size", "intermediate_size", self.intermediate_size),
            (tp, "tensor-parallel size", "vocab_size", self.vocab_size),
            (pp, "pipeline-parallel size", "num_layers", self.num_layers),
            (ep, "expert-parallel size", "num_experts", self.num_experts),
        ]
        if self.num_experts:
            checks.append((tp, "tensor-parallel size", "expert size", self.expert_size))
            if self.shared_expert_size:
                shared = self.shared_expert_size
                checks.append((tp, "tensor-parallel size", "shared expert", shared))
        if seq_len and cp > 1:  # two chunks per rank: the load-balanced layout
            checks.append(
                (2 * cp, "doubled context-parallel size (two chunks per rank)", "seq_len", seq_len)
            )
        for size, what, dim, value in checks:
            if size < 1:
                raise ValueError(f"the {what} must be at least 1, got {size}")
            if value % size:
                raise ValueError(f"{dim}={value} is not divisible by the {what} {size}")


def _llama3(layers: int, hidden: int, heads: int, ffn: int, *, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        intermediate_size=ffn,
        rope_theta=500000.0,
        tie_embeddings=tied,
    )


def _qwen3(layers: int, hidden: int, heads: int, ffn: int, *, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=151936,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=ffn,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=tied,
    )


PRESETS: dict[str, LlamaConfig] = {
    # Published shapes (the models' config.json on the Hugging Face Hub).
    "llama3.2-1b": _llama3(16, 2048, 32, 8192, tied=True),
    "llama3.2-3b": _llama3(28, 3072, 24, 8192, tied=True),
    "llama3.1-8b": _llama3(32, 4096, 32, 14336, tied=False),
    "llama3.3-70b": _llama3(80, 8192, 64, 28672, tied=False),
    "qwen3-1.7b": _qwen3(28, 2048, 16, 6144, tied=True),
    "qwen3-8b": _qwen3(36, 4096, 32, 12288, tied=False),
    "mixtral-8x7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        rope_theta=1000000.0,
        num_experts=8,
        experts_per_token=2,
    ),
    "qwen3-30b-a3b": dataclasses.replace(
        _qwen3(48, 2048, 32, 6144, tied=False),
        num_kv_heads=4,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
    ),
    # Tiny shapes for tests and examples.
    "tiny": LlamaConfig(),
    "tiny-4l": LlamaConfig(num_layers=4, hidden_size=64, intermediate_size=128),
    "tiny-8l": LlamaConfig(num_layers=8, hidden_size=64, intermediate_size=128),
    "tiny-16l": LlamaConfig(num_layers=16, hidden_size=64, intermediate_size=128),
    "tiny-qwen3": LlamaConfig(qk_norm=True, tie_embeddings=True),
    "tiny-moe": LlamaConfig(num_experts=4, experts_per_token=2, shared_expert_size=32),
}
"""Named shapes: real models' published shapes, and tiny ones for tests and examples."""


def preset(name: str) -> LlamaConfig:
    """Return the preset ``name``, or the config a ``module:attribute`` path names.

    The attribute is a :class:`LlamaConfig` or a function without arguments returning one.

    Raises:
        ValueError: an unknown preset (the known ones are listed), a module that cannot be
            imported, a missing attribute, or one that is not a config.
    """
    if ":" not in name:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown model {name!r}; known models: {', '.join(PRESETS)}, or "
                "MODULE:ATTRIBUTE naming a LlamaConfig"
            ) from None
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model {name!r}: cannot import module {module_name!r} ({err}); check the name "
            "and that its directory is on PYTHONPATH"
        ) from None
    if not hasattr(module, attr):
        raise ValueError(f"model {name!r}: module {module_name!r} has no attribute {attr!r}")
    value = getattr(module, attr)
    if callable(value) and not isinstance(value, LlamaConfig):
        value = value()
    if not isinstance(value, LlamaConfig):
        raise ValueError(
            f"model {name!r} is of type {type(value).__name__}, not a kareus.models.LlamaConfig "
            "(or a function returning one)"
        )
    return value

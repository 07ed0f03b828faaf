"""Tiny models to test with: Hugging Face causal LMs, sleepy layers, in-place TP layers."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kareus.testing.training import History, gradients, token_batches

_GPT2: dict[str, Any] = dict(
    n_positions=64, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)

HF_KINDS = ("llama", "qwen3", "mistral", "gemma", "gpt2", "gpt_neox", "mixtral", "qwen3_moe")
"""The tiny Hugging Face causal LMs :func:`hf_tiny` builds (transformers' own model code)."""


def hf_tiny(kind: str) -> nn.Module:
    """Build a tiny random Hugging Face causal LM offline, one of :data:`HF_KINDS`.

    Raises:
        ImportError: transformers is not installed (``pip install kareus[hf]``).
        ValueError: an unknown kind.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    gqa = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    builders: dict[str, Callable[[], nn.Module]] = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
        "qwen3": lambda: transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(head_dim=8, **common)
        ),
        "mistral": lambda: transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=16, **common)
        ),
        "gemma": lambda: transformers.GemmaForCausalLM(
            transformers.GemmaConfig(head_dim=8, **common)
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, **_GPT2)
        ),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**gqa)),
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common
            )
        ),
    }
    if kind not in builders:
        raise ValueError(f"unknown HF model kind {kind!r}: use one of {', '.join(HF_KINDS)}")
    return builders[kind]()


HF_CONFIG_KINDS = ("phi3", "olmo", "stablelm", "gpt2", "bert")
"""Hugging Face architectures :func:`hf_config_file` writes, none of them a kareus preset."""


HF_TP_PLANS: dict[str, dict[str, str]] = {
    # BERT: transformers has no plan; its attention reshapes by the local width, so the
    # usual Megatron split (attention and MLP in column then row) runs sharded
    "bert": {
        **{f"encoder.layer.*.attention.self.{p}": "colwise" for p in ("query", "key", "value")},
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    # StableLM: the same split does not run: its attention reshapes by the config's head
    # count (a TP 2 trace fails, and kareus says so in one line)
    "stablelm": {
        **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        "layers.*.self_attn.o_proj": "rowwise",
        **{f"layers.*.mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")},
        "layers.*.mlp.down_proj": "rowwise",
    },
}
"""Tensor-parallel plans a user adds to a config (``base_model_tp_plan``) where transformers
has none, as ``kareus plan --tp 2`` advises."""


def hf_config_file(
    kind: str, directory: str | pathlib.Path, *, tp_plan: bool = False
) -> pathlib.Path:
    """Write a tiny ``config.json`` of a Hugging Face architecture (4 layers); return its path.

    ``tp_plan``: add the kind's :data:`HF_TP_PLANS` entry as its ``base_model_tp_plan``.

    Raises:
        ValueError: a kind not in :data:`HF_CONFIG_KINDS`.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    made: dict[str, tuple[Any, str]] = {
        "phi3": (transformers.Phi3Config(num_key_value_heads=4, **common), "Phi3ForCausalLM"),
        "olmo": (transformers.OlmoConfig(num_key_value_heads=2, **common), "OlmoForCausalLM"),
        "stablelm": (
            transformers.StableLmConfig(num_key_value_heads=4, **common),
            "StableLmForCausalLM",
        ),
        "gpt2": (
            transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, **_GPT2),
            "GPT2LMHeadModel",
        ),
        "bert": (
            transformers.BertConfig(
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common
            ),
            "BertForMaskedLM",
        ),
    }
    if kind not in made:
        raise ValueError(f"unknown config kind {kind!r}: use one of {', '.join(made)}")
    config, architecture = made[kind]
    config.architectures = [architecture]
    path = pathlib.Path(directory) / f"{kind}.json"
    config.to_json_file(str(path))
    if tp_plan:  # a key of the file, which transformers reads but does not write
        raw = json.loads(path.read_text())
        path.write_text(json.dumps({**raw, "base_model_tp_plan": HF_TP_PLANS[kind]}, indent=2))
    return path


def source_training(
    source: Any,
    tp: int,
    plan: str | None,
    steps: int = 3,
    *,
    microbatch_size: int = 4,
    seq_len: int = 16,
) -> tuple[History, Any]:
    """Train ``source``'s model (seed 0) on random tokens in this process's TP group.

    Built as ``kareus plan`` traced it (:meth:`~kareus.models.sources.HFModel.build` on a
    ``(tp,)`` CPU mesh); with ``plan``, compiled by ``kareus.compile(model, plan=plan)`` on
    the emulated GPU's clocks. Returns the history and the compiled model (or the eager one).
    """
    import kareus
    from kareus.models.sources import step_loss
    from kareus.runtime.clocks import EmulatedClocks

    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    model, inputs = source.build(
        layers=None,
        tp_mesh=mesh,
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        dtype=torch.float32,
    )
    if plan is not None:
        model = kareus.compile(model, plan=plan, clocks=EmulatedClocks())
    vocab = 64  # token ids every model of these tests embeds (the smallest vocabulary)
    batches = []
    for ids, labels in token_batches(steps, microbatch_size, seq_len, vocab, seed=1):
        swap = iter((ids, labels))
        kwargs = {
            k: next(swap) if isinstance(v, torch.Tensor) else v for k, v in inputs.kwargs.items()
        }
        args = tuple(next(swap) if isinstance(v, torch.Tensor) else v for v in inputs.args)
        batches.append((args, kwargs))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hist = History([], [])
    for args, kwargs in batches:
        loss = step_loss(model(*args, **kwargs))
        loss.backward()
        hist.losses.append(loss.detach().clone())
        hist.grads.append(gradients(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return hist, model


@torch.library.custom_op("kareus_testing::sleepy", mutates_args=(), tags=(torch.Tag.pointwise,))
def sleepy(x: torch.Tensor, ms: float) -> torch.Tensor:
    """Return ``x * 2`` after sleeping ``ms``: a stand-in for GPU compute on CPU.

    Sleeping leaves the cores free, so a collective running in the communication library's
    thread really overlaps it (real matmuls would take both cores of a small machine).
    """
    import time

    time.sleep(ms / 1000)
    return x * 2


@sleepy.register_fake
def _(x: torch.Tensor, ms: float) -> torch.Tensor:
    return torch.empty_like(x)


def _sleepy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return sleepy(grad, ctx.ms), None


def _sleepy_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.ms = inputs[1]


sleepy.register_autograd(_sleepy_backward, setup_context=_sleepy_setup)


class SleepyLayer(nn.Module):
    """Compute that sleeps, then an all-reduce of the activation across the TP group.

    Megatron-shaped: "f" before (all-reduce of the gradient in the backward), "g" after
    (all-reduce forward), so both directions have one collective per nanobatch and layer.
    """

    def __init__(self, width: int, ms: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` plus the all-reduced, slowly computed update."""
        from kareus.models.parallel import copy_to_tp, reduce_from_tp

        return x + reduce_from_tp(sleepy(copy_to_tp(x) * self.scale, self.ms))


class SleepyStack(nn.Module):
    """Layers of :class:`SleepyLayer`; the loss is the mean square of the output."""

    def __init__(self, layers: int = 4, width: int = 1 << 18, ms: float = 20.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepyLayer(width, ms) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the loss."""
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class _InplaceReduce(torch.autograd.Function):
    """Megatron's "g" as TP libraries write it: an in-place ``dist.all_reduce``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _InplaceCopy(torch.autograd.Function):
    """Megatron's "f": identity forward, in-place ``dist.all_reduce`` of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    moved = x.transpose(0, 1).contiguous()
    out = moved.new_empty((moved.shape[0] * dist.get_world_size(), *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved)
    return out.transpose(0, 1)


def _scatter_seq(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    moved = x.transpose(0, 1).contiguous()
    out = moved.new_empty((moved.shape[0] // dist.get_world_size(), *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved)
    return out.transpose(0, 1)


class _InplaceGather(torch.autograd.Function):
    """Sequence parallelism: all-gather the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _gather_seq(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _scatter_seq(grad)


class _InplaceScatter(torch.autograd.Function):
    """Sequence parallelism: reduce-scatter the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _scatter_seq(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather_seq(grad)


class InplaceTPLayer(nn.Module):
    """A tensor-parallel MLP layer with in-place ``dist`` collectives in autograd.Functions.

    This is how Megatron-style TP libraries write their collectives.

    With ``sequence_parallel``, activations are split along dimension 1 between layers:
    all-gathered before the column-parallel matmul, reduce-scattered after the row-parallel
    one (the gradients the other way round); without it, "f" and "g" all-reduces.
    """

    def __init__(self, width: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` plus the layer's update."""
        h = self.norm(x)
        h = _InplaceGather.apply(h) if self.sequence_parallel else _InplaceCopy.apply(h)
        h = self.down(torch.relu(self.up(h)))
        h = _InplaceScatter.apply(h) if self.sequence_parallel else _InplaceReduce.apply(h)
        return x + h


class InplaceTPNet(nn.Module):
    """Layers of :class:`InplaceTPLayer`; called as ``net(x, target)``, returns the MSE."""

    def __init__(self, layers: int = 3, width: int = 16, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InplaceTPLayer(width, sequence_parallel) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Return the mean squared error of the output against ``target``."""
        for layer in self.layers:
            x = layer(x)
        return ((x - target) ** 2).mean()

"""What is planned: a training configuration (:class:`Workload`), read by every job.

Model, parallel sizes, batch shape, dtype, pipeline schedule, recompute and data-parallel
layout; tracing (:mod:`kareus.jobs.trace`), planning, evaluation and profiling all take one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kareus.compiler.config import GRAPHS
from kareus.errors import KareusError
from kareus.models.config import LlamaConfig, preset
from kareus.models.sources import FactoryModel, HFModel, ModelSource

if TYPE_CHECKING:
    from kareus.planner.data_parallel import DataParallel, StageWeights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Training dtypes by name."""

RECOMPUTE = ("none", "full", "selective")
"""Activation recompute modes (:attr:`Workload.recompute`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A training configuration: model, parallel sizes, batch shape and dtype.

    Attributes:
        model: a preset name of :data:`kareus.models.PRESETS`, a config, or a model of your
            own (:class:`~kareus.models.sources.HFModel`, a Hugging Face ``config.json``;
            :class:`~kareus.models.sources.FactoryModel`, your function).
        tp, cp, pp: tensor, context and pipeline-parallel sizes.
        microbatch_size: sequences per micro-batch (split into two nanobatches along the
            batch where it holds 4 or more, along the sequence below).
        seq_len: tokens per sequence (split across the context-parallel ranks).
        microbatches: micro-batches per iteration (per pipeline).
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        schedule: the pipeline schedule, ``1F1B``, ``GPipe`` or ``Interleaved1F1B``.
        virtual_stages: stages per pipeline rank (2 or more with ``Interleaved1F1B``, whose
            model is split into ``pp * virtual_stages`` stages, stage ``v * pp + r`` on rank
            ``r``; else 1).
        recompute: activation recompute: ``none``; ``full`` (each backward re-runs its
            layers' forward, collectives included); ``selective`` (the attention core only).
        graphs: which graphs are traced and priced, recorded in the plan, whose application
            runs the same: ``aot``, AOTAutograd's plain graphs with its default partition
            (the backward recomputes nothing); ``inductor``, the graphs Inductor compiles
            (its decompositions, joint-graph passes and min-cut partition), as the default
            codegen runs them (:data:`GRAPHS`).
        layers_per_stage: decoder layers of each pipeline stage (say ``(15, 13)``; the first
            stage also holds the embedding, the last the head and loss); None splits evenly.
        dp, dp_mode, gpus_per_node, reshard_after_forward: the data-parallel layout
            (:class:`~kareus.planner.data_parallel.DataParallel`); ``dp`` None: none.
        ep: expert-parallel size of a mixture-of-experts model: its experts split over
            ``ep`` ranks that hold different tokens (borrowed from data parallelism, as
            torchtitan and Megatron-LM do: ``dp``, when given, is a multiple of it); the
            tokens reach their experts by an all-to-all.
        expert_skew: the load of the busiest expert as a multiple of the mean (1: uniform
            routing); the traced rank holds it, so the plan is priced on the busiest rank.
    """

    model: str | LlamaConfig | ModelSource
    tp: int = 1
    cp: int = 1
    pp: int = 1
    microbatch_size: int = 8
    seq_len: int = 4096
    microbatches: int = 8
    dtype: str = "bf16"
    schedule: str = "1F1B"
    recompute: str = "none"
    graphs: str = "aot"
    layers_per_stage: tuple[int, ...] | None = None
    virtual_stages: int = 1
    dp: int | None = None
    dp_mode: str = "ddp"
    gpus_per_node: int = 8
    reshard_after_forward: bool = True
    ep: int = 1
    expert_skew: float = 1.0

    def __post_init__(self) -> None:
        from kareus.planner.dag import SCHEDULES

        if isinstance(self.model, (HFModel, FactoryModel)):
            self.model.check(
                tp=self.tp, cp=self.cp, pp=self.stages, graph_dp=self.graph_dp, dp=self.dp
            )
        cfg = self.shape  # raises on an unknown preset
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if (self.schedule == "Interleaved1F1B") != (self.virtual_stages > 1):
            raise ValueError(
                f"schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: "
                "Interleaved1F1B needs 2 or more stages per rank, the other schedules 1"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        for name in ("microbatch_size", "seq_len", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.graphs not in GRAPHS:
            raise ValueError(f"graphs={self.graphs!r} must be one of {', '.join(GRAPHS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        split = self.layers_per_stage
        if split is not None and self.shape is None:
            raise ValueError(f"layers per stage: {self.name} declares no layer count")
        if split is not None and cfg is not None:
            if len(split) != self.stages or min(split) < 1 or sum(split) != cfg.num_layers:
                raise ValueError(
                    f"layers per stage {','.join(map(str, split))} must be {self.stages} positive "
                    f"counts (one per pipeline stage) adding up to the model's "
                    f"{cfg.num_layers} layers"
                )
            # the layer count is checked against the stages above, not divided by them
            cfg = dataclasses.replace(cfg, num_layers=self.stages)
        if cfg is not None:
            cfg.check_parallel(
                tp=self.tp, cp=self.cp, pp=self.stages, ep=self.ep, seq_len=self.seq_len
            )
        self._check_experts(cfg)
        if self.dp is not None:
            self.data_parallel()  # raises on a layout kareus cannot plan

    def _check_experts(self, cfg: LlamaConfig | None) -> None:
        """Raise ValueError on an expert-parallel layout kareus cannot trace."""
        if self.ep < 1:
            raise ValueError(f"ep must be at least 1, got {self.ep}")
        if self.ep > 1 and not isinstance(self.model, (str, LlamaConfig)):
            raise ValueError(
                f"--ep {self.ep}: expert parallelism is traced on kareus's presets "
                f"(mixtral-8x7b, qwen3-30b-a3b) or a LlamaConfig with num_experts; "
                f"{self.name} is traced with its experts whole on each rank (leave --ep out)"
            )
        if self.dp is not None and self.dp % self.ep:
            raise ValueError(
                f"dp={self.dp} is not a multiple of ep={self.ep}: the expert-parallel ranks "
                "are data-parallel ranks (each holds its own tokens)"
            )
        if self.graph_dp > 1 and self.ep > 1:
            raise ValueError(
                "expert parallelism under SimpleFSDP (dp_mode='simplefsdp') is not traced: "
                "use dp_mode 'fsdp' or 'ddp'"
            )
        if self.expert_skew != 1.0 and (cfg is None or not cfg.num_experts):
            raise ValueError(f"expert_skew={self.expert_skew} needs a mixture-of-experts model")
        if cfg is not None and cfg.num_experts:
            from kareus.models.moe import planned_load

            tokens = self.microbatch_size * (self.seq_len // self.cp)
            planned_load(tokens, cfg.num_experts, cfg.experts_per_token, self.expert_skew)

    @property
    def graph_dp(self) -> int:
        """Data-parallel ranks whose collectives are in the traced graphs.

        ``dp`` under SimpleFSDP (parameters gathered in the graph), else 1 (hooks issue them).
        """
        return (self.dp or 1) if self.dp_mode == "simplefsdp" else 1

    @property
    def stages(self) -> int:
        """Pipeline stages: ranks times stages per rank."""
        return self.pp * self.virtual_stages

    def stage_layers(self) -> tuple[int, ...]:
        """Return the decoder layers of each pipeline stage."""
        if self.layers_per_stage is not None:
            return tuple(self.layers_per_stage)
        if self.shape is None:
            return (0,) * self.stages  # traced whole: as many as the model has
        return (self.shape.num_layers // self.stages,) * self.stages

    def data_parallel(self) -> DataParallel | None:
        """Return the data-parallel layout (None: ``dp`` not given, none modelled).

        Raises:
            ValueError: a mode kareus does not plan, or one the layout cannot use.
        """
        from kareus.planner.data_parallel import DataParallel

        if self.dp is None:
            return None
        if self.tp * self.cp > self.gpus_per_node:
            raise ValueError(
                f"TP {self.tp} x CP {self.cp} = {self.tp * self.cp} GPUs per stage do not fit "
                f"in a node of {self.gpus_per_node} GPUs (gpus_per_node): kareus prices tensor "
                "and context-parallel collectives on NVLink"
            )
        try:
            return DataParallel(
                self.dp,
                self.dp_mode,
                self.gpus_per_node,
                self.tp * self.cp,
                reshard_after_forward=self.reshard_after_forward,
            )
        except KareusError as err:
            raise ValueError(str(err)) from None

    def stage_weights(self) -> list[StageWeights]:
        """Return each pipeline stage's parameters on one GPU (its tensor-parallel shard).

        Layers: attention (query, key, value, output projections) and MLP split over the
        tensor-parallel ranks, norms replicated. The embedding on the first stage and the
        head on the last are split over the vocabulary (a tied head is a second copy on the
        last stage when they differ).
        """
        from kareus.planner.data_parallel import StageWeights

        c, tp = self.config, self.tp
        head_dim = c.head_dim or c.hidden_size // c.num_heads
        attention = c.hidden_size * head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
        mlp: float = (3 if c.mlp == "swiglu" else 2) * c.hidden_size * c.intermediate_size
        norms = 2 * c.hidden_size + (2 * head_dim if c.qk_norm else 0)
        if c.num_experts:  # this rank's experts (and the router, replicated)
            experts = 3 * c.hidden_size * c.expert_size * c.num_experts / self.ep
            mlp = experts + 3 * c.hidden_size * c.shared_expert_size
            norms += c.hidden_size * c.num_experts
        per_layer = (attention + mlp) / tp + norms
        table = c.vocab_size * c.hidden_size / tp
        layers = self.stage_layers()
        last = len(layers) - 1
        out = []
        for i, n in enumerate(layers):
            other = (table if i == 0 else 0.0) + (table + c.hidden_size if i == last else 0.0)
            if i == last == 0 and c.tie_embeddings:
                other -= table
            out.append(StageWeights(n, per_layer, other))
        return out

    @property
    def config(self) -> LlamaConfig:
        """The model's shape.

        Raises:
            ValueError: a model that declares none (a factory's).
        """
        if self.shape is None:
            raise ValueError(f"{self.name} declares no shape (layers, widths) to read")
        return self.shape

    @property
    def shape(self) -> LlamaConfig | None:
        """The model's shape; None for a factory's model, known only from its graphs."""
        if isinstance(self.model, str):
            return preset(self.model)
        if isinstance(self.model, (HFModel, FactoryModel)):
            return self.model.config()
        return self.model

    @property
    def name(self) -> str:
        """The model's name (``custom`` for a config)."""
        if isinstance(self.model, (HFModel, FactoryModel)):
            return self.model.name
        return self.model if isinstance(self.model, str) else "custom"

    def describe(self) -> str:
        """One line, e.g. ``llama3.2-3b bf16, TP 8 x CP 1 x PP 2, 8 x 8 x 4096 tokens``."""
        return (
            f"{self.name} {self.dtype}, TP {self.tp} x CP {self.cp} x PP {self.pp}, "
            f"{self.microbatches} micro-batches x {self.microbatch_size} x {self.seq_len} tokens"
            + (f", {self.schedule}" if self.pp > 1 else "")
            + (f" ({self.virtual_stages} stages per rank)" if self.virtual_stages > 1 else "")
            + (
                f", layers {'/'.join(map(str, self.layers_per_stage))}"
                if self.layers_per_stage
                else ""
            )
            + (f", {self.recompute} recompute" if self.recompute != "none" else "")
            + (f", EP {self.ep}" if self.ep > 1 else "")
            + (f", expert skew {self.expert_skew:g}" if self.expert_skew != 1.0 else "")
        )

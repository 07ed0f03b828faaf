"""Models kareus plans besides its presets: a Hugging Face ``config.json``, or your own factory.

A source builds the model a pipeline stage runs, at its real size, under the fake tensors
and the fake process group that :mod:`kareus.jobs.trace` sets up, and says what one training
step feeds it. Tensor parallelism is the model's own: a Hugging Face model's
``base_model_tp_plan`` applied as ``from_pretrained(..., distributed_config=...)`` applies it
(:func:`hf_tensor_parallel`, which a training script calls too, so that the plan fits the
graphs it runs); a factory parallelises its model on the mesh it is given.

Both run one pipeline stage without context parallelism: kareus's presets cover those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import pathlib
from typing import Any

import torch
from torch import nn

from kareus.errors import SourceError
from kareus.models.config import LlamaConfig

_UNSUPPORTED = (
    "pipeline and context parallelism and data parallelism in the graphs are planned for "
    "kareus's presets only (--model); plan {what} with --pp 1 --cp 1"
)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What one training step feeds the model: positional and keyword arguments."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def step_loss(out: Any) -> torch.Tensor:
    """Return the tensor a training step differentiates from the model's output.

    A Hugging Face output's ``loss``, a tuple's first element, or the tensor itself.
    """
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise SourceError(
            f"the model returned {type(out).__name__}: a traced training step needs a tensor "
            "(the loss), a tuple starting with one, or an output with a .loss"
        )
    return out


@dataclasses.dataclass(frozen=True)
class HFModel:
    """A Hugging Face model of its ``config.json``, built at its real size.

    Attributes:
        path: the ``config.json``, or a directory holding one; read once, when the model is
            made (what is traced and what the plan records are the same config).

    Raises:
        SourceError: no such file, or not a JSON object with a ``model_type``.
    """

    path: str
    _raw: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)
    _shape: LlamaConfig | None = dataclasses.field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_raw", _read_config(self.path))

    @property
    def name(self) -> str:
        """The config's model type and file (``phi3 (configs/phi3.json)``)."""
        return f"{self.raw().get('model_type', 'hf')} ({self.path})"

    @property
    def flag(self) -> str:
        """The ``kareus plan`` option that names this model (``--hf-config PATH``)."""
        return f"--hf-config {self.path}"

    def raw(self) -> dict[str, Any]:
        """Return the config file's contents (as read when the model was made)."""
        return self._raw

    def hf_config(self, layers: int | None = None) -> Any:
        """Return the ``transformers`` config (``layers`` decoder layers, else its own)."""
        transformers = _transformers()
        raw = dict(self.raw())
        model_type = raw.pop("model_type")
        if layers is not None:
            raw[_layers_key(raw)] = layers
        return transformers.AutoConfig.for_model(model_type, **raw)

    def config(self) -> LlamaConfig:
        """Return the model's shape (layers, widths, heads) as kareus's reports show it."""
        if self._shape is None:  # built once: every report and check reads it
            object.__setattr__(self, "_shape", self._config())
        assert self._shape is not None
        return self._shape

    def _config(self) -> LlamaConfig:
        c = self.hf_config()
        hidden = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        act = str(getattr(c, "hidden_act", getattr(c, "activation_function", "")))
        return LlamaConfig(
            vocab_size=int(c.vocab_size),
            hidden_size=hidden,
            num_layers=int(c.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            intermediate_size=int(
                getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
            ),
            head_dim=getattr(c, "head_dim", None),
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            mlp="swiglu" if act in ("silu", "swish") else "gelu",
        )

    def record(self) -> dict[str, Any]:
        """Return what the plan file keeps: the path and the whole config."""
        return {"hf_config": self.path, "config": self.raw()}

    def check(self, *, tp: int, cp: int, pp: int, graph_dp: int, dp: int | None = None) -> None:
        """Raise ValueError for a layout kareus cannot trace this model in."""
        del dp  # hooks' traffic: priced from the shape
        if cp > 1 or pp > 1 or graph_dp > 1:
            raise SourceError(_UNSUPPORTED.format(what=f"--hf-config {self.path}"))
        if tp > 1 and not (self.raw().get("base_model_tp_plan") or self._class_tp_plan()):
            raise SourceError(
                f"--hf-config {self.path}: a {self.raw()['model_type']} model has no "
                "tensor-parallel plan (base_model_tp_plan) in transformers or its config; plan "
                "it with --tp 1, add a base_model_tp_plan to the config, or parallelise it in "
                "your own --factory"
            )
        self.config().check_parallel(tp=tp)

    def _class_tp_plan(self) -> dict[str, str] | None:
        return getattr(self.hf_config(), "base_model_tp_plan", None)

    def build(
        self,
        *,
        layers: int | None,
        tp_mesh: Any,
        microbatch_size: int,
        seq_len: int,
        dtype: torch.dtype,
    ) -> tuple[nn.Module, StepInputs]:
        """Build the model and one step's inputs (token ids, the same as labels).

        ``layers`` decoder layers (None: the config's), sharded on ``tp_mesh`` (None: TP 1).
        Weights are initialised as ``from_config`` does, not loaded: kareus traces under
        fake tensors; a test trains the real thing.
        """
        transformers = _transformers()
        config = self.hf_config(layers)
        architectures = self.raw().get("architectures") or []
        cls = getattr(transformers, architectures[0], None) if architectures else None
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # parameters made in the training dtype, not cast
        try:
            auto = transformers.AutoModelForCausalLM
            model = cls(config) if cls is not None else auto.from_config(config)
        finally:
            torch.set_default_dtype(default)
        if tp_mesh is not None:
            hf_tensor_parallel(model, tp_mesh)
        ids = torch.zeros((microbatch_size, seq_len), dtype=torch.long)
        return model, StepInputs(kwargs={"input_ids": ids, "labels": ids})


def hf_tensor_parallel(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shard a Hugging Face model over ``tp_mesh`` by its own tensor-parallel plan.

    What ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))`` does
    after building the model (transformers 5): the config's ``base_model_tp_plan``, expanded
    to the model's layers, applied with DTensor. Call it on a model made ``from_config`` so
    that it runs the graphs a plan of ``kareus plan --hf-config`` was made for.

    Raises:
        ValueError: the model has no tensor-parallel plan (transformers says so).
    """
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    resolve: Any = model._resolve_parallel_plans
    tp_plan, _ep, _fsdp = resolve(DistributedConfig(tp_size=tp_mesh.size()))
    return apply_tensor_parallelism(model, tp_mesh, tp_plan)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class FactoryModel:
    """Your model: ``MODULE:FUNCTION`` returning ``(model, inputs)``.

    The function is called under fake tensors with those of these keywords it takes:
    ``tp_mesh`` (the tensor-parallel DeviceMesh, None at TP 1), ``microbatch_size``,
    ``seq_len`` and ``dtype`` (a ``torch.dtype``). ``inputs`` is a dict of keyword arguments,
    or a tuple of positional ones, for one training step; the model returns the loss (a
    tensor, a tuple starting with it, or an output with ``.loss``). The model is traced
    whole: its layers are not counted from a few, so tracing time grows with its depth.

    Attributes:
        target: ``MODULE:FUNCTION``; the module on ``PYTHONPATH``.
    """

    target: str

    KEYWORDS = ("tp_mesh", "microbatch_size", "seq_len", "dtype")

    @property
    def name(self) -> str:
        """The factory's path."""
        return self.target

    @property
    def flag(self) -> str:
        """The ``kareus plan`` option that names this model (``--factory MODULE:FUNCTION``)."""
        return f"--factory {self.target}"

    def function(self) -> Any:
        """Return the factory function.

        Raises:
            SourceError: not ``MODULE:FUNCTION``, not importable, or not callable.
        """
        module_name, sep, attr = self.target.partition(":")
        if not sep or not module_name or not attr:
            raise SourceError(f"--factory {self.target!r} must be MODULE:FUNCTION")
        try:
            module = _import_from_cwd(module_name)
        except ImportError as err:
            raise SourceError(
                f"--factory {self.target}: cannot import {module_name!r} ({err}); check the "
                "name and that its directory is on PYTHONPATH"
            ) from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise SourceError(f"--factory {self.target}: {module_name} has no function {attr!r}")
        return fn

    def config(self) -> None:
        """Return None: a factory's shape is known only from its graphs."""
        return None

    def record(self) -> dict[str, Any]:
        """Return what the plan file keeps: the target and a digest of its module's source."""
        module = inspect.getmodule(self.function())
        source = inspect.getsource(module) if module is not None else ""
        return {
            "factory": self.target,
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        }

    def check(self, *, tp: int, cp: int, pp: int, graph_dp: int, dp: int | None = None) -> None:
        """Raise ValueError for a layout kareus cannot trace a factory's model in."""
        if cp > 1 or pp > 1 or graph_dp > 1:
            raise SourceError(_UNSUPPORTED.format(what=f"--factory {self.target}"))
        if dp is not None:
            raise SourceError(
                f"--factory {self.target}: pricing data parallelism needs the model's shape, "
                "which a factory does not declare; plan without --dp (or use --hf-config)"
            )
        self.function()

    def build(
        self,
        *,
        layers: int | None,
        tp_mesh: Any,
        microbatch_size: int,
        seq_len: int,
        dtype: torch.dtype,
    ) -> tuple[nn.Module, StepInputs]:
        """Call the factory (``layers`` is ignored: the model is traced whole).

        Raises:
            SourceError: the factory did not return ``(nn.Module, inputs)``.
        """
        del layers
        fn = self.function()
        offered = {
            "tp_mesh": tp_mesh,
            "microbatch_size": microbatch_size,
            "seq_len": seq_len,
            "dtype": dtype,
        }
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        result = fn(**{k: v for k, v in offered.items() if takes_all or k in params})
        if not (
            isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
        ):
            raise SourceError(
                f"--factory {self.target} returned {type(result).__name__}; it must return "
                "(model, inputs): an nn.Module and a dict of keyword or a tuple of positional "
                "arguments"
            )
        model, inputs = result
        if isinstance(inputs, dict):
            return model, StepInputs(kwargs=dict(inputs))
        return model, StepInputs(
            args=tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        )


ModelSource = HFModel | FactoryModel
"""A model that is not a preset."""


def run_failure(source: HFModel | FactoryModel, tp: int, err: BaseException) -> str:
    """Say in one line that ``source``'s own code failed while kareus traced it at TP ``tp``.

    The innermost cause is named (Dynamo wraps the model's own error in its explanation):
    for example a model that reshapes by its global head count under a TP plan that shards
    the heads.
    """
    cause = err
    # Dynamo re-raises its own error "from None": the suppressed context holds the model's.
    # An error merely raised while handling another keeps its own message.
    while (
        inner := cause.__cause__ or (cause.__context__ if cause.__suppress_context__ else None)
    ) is not None:
        cause = inner
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    what = f"{type(cause).__name__}: {lines[0] if lines else 'no message'}"
    layout = f" at TP {tp}" if tp > 1 else ""
    advice = "; run it once at this layout without kareus to see where" + (
        ", or plan it with --tp 1" if tp > 1 else ""
    )
    return f"{source.flag}: the model failed{layout} while kareus traced it ({what}){advice}"


def _import_from_cwd(name: str) -> Any:
    """Import ``name`` as ``python -c`` would: the working directory first on the path."""
    import os
    import sys

    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise SourceError("--hf-config needs transformers: pip install 'kareus[hf]'") from None


def _read_config(path: str) -> dict[str, Any]:
    file = pathlib.Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except OSError as err:
        raise SourceError(f"--hf-config {path}: cannot read {file} ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise SourceError(f"--hf-config {path}: {file} is not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise SourceError(
            f"--hf-config {path}: {file} has no model_type; pass a Hugging Face config.json"
        )
    return data


def _layers_key(raw: dict[str, Any]) -> str:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in raw:
            return key
    return "num_hidden_layers"


__all__ = [
    "FactoryModel",
    "HFModel",
    "ModelSource",
    "StepInputs",
    "hf_tensor_parallel",
    "step_loss",
]

"""The hooks ``kareus.compile`` puts on a compiled module.

Its batch (or sequence) dimension marked dynamic for each call and only for it, inputs
still in flight waited for, and ``state_dict`` keys as the uncompiled model's
(torch.compile's wrapper adds ``_orig_mod.``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kareus.passes.batch_dims import MIN_NANOBATCH

_ORIG = "_orig_mod."

SPLIT_BATCH_AT_LEAST = 2 * MIN_NANOBATCH
"""The smallest batch split along the batch; a smaller one is split along the sequence."""


class BatchMarks:
    """Mark the inputs' batch (or sequence) dimension dynamic for the call, and only for it.

    The nanobatch split needs a symbolic size to cut (sizes like ``view(b, ...)`` must
    follow it): the batch where it holds at least :data:`SPLIT_BATCH_AT_LEAST` sequences,
    else the sequence (``along="auto"``; ``"batch"`` or ``"sequence"`` pick one). The
    sequence is the dimension beside the batch of the first tensor input (1 after a batch
    at 0, else 0); an input without it there is marked where its dimensions have the
    sequence's length (a rotary table of ``[seq, dim]`` passed to a layer). A mark only
    lets the size vary: the split proves from the graph's ops which dimension is the
    sequence (:mod:`kareus.passes.per_sample`), and a wrong mark leaves the block whole.

    Two marks, because the tensors Dynamo traces are not always the ones passed:

    - on each tensor input (``maybe_mark_dynamic``), read when Dynamo traces the call;
    - by name, through ``torch.compiler.config.dynamic_sources`` (``L['x']:0`` for each
      tensor argument of the module's ``forward``), read when Dynamo starts a frame at
      ``forward`` after hooks it does not trace. FSDP2's pre-forward hook is one: it returns
      new tensors (its post-backward hook's outputs), which carry no mark.

    Dynamo reads the tensor mark from the tensor object, which the program owns: left there,
    it made the same batch recompile with a dynamic batch under another ``torch.compile``
    (a guard on the mark). So both marks are removed once the call returns or raises,
    unless the program had marked the tensor itself.

    Inputs that are still in flight (an ``AsyncCollectiveTensor``, as a TP layer's
    ``to_local()`` after a reduce-scatter returns) are waited for first, by a copy that
    autograd records (``wait()`` would cut the gradient to the layer that made it): a
    compiled block given one computes right but its backward fails inside DTensor (torch
    2.13, with ``torch.compile`` alone too).
    """

    def __init__(self, dim: int, module: Any, *, mark: bool = True, along: str = "auto") -> None:
        self.dim = dim
        self.do_mark = mark
        self.along = along
        self.signature = _signature(getattr(module, "forward", None))  # read once
        self.marked: list[tuple[list[torch.Tensor], Any]] = []

    def mark(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Mark the batch dimension of each tensor input (a forward pre-hook)."""
        args, kwargs, waited = _wait_in_flight(args, kwargs)
        marked: list[torch.Tensor] = []
        patch = None
        if self.do_mark:
            dims_of = self._chooser((*args, *kwargs.values()))
            for value in (*args, *kwargs.values()):
                dims = dims_of(value)
                if dims and not getattr(value, "_has_dynamo_dim_marking", False):
                    marked.append(value)
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(value, d)
            # by name only where hooks run before the forward Dynamo traces (FSDP2's):
            # without them Dynamo sees the tensors marked above (a config patch per call
            # cost about 0.1 ms)
            patch = self._by_name(args, kwargs, dims_of) if _hooked(module) else None
            if patch is not None:
                patch.__enter__()
        self.marked.append((marked, patch))
        return (args, kwargs) if waited else None

    def unmark(self, module: nn.Module, args: Any, output: Any) -> None:
        """Remove the marks this call made (a forward hook that runs even on errors)."""
        marked, patch = self.marked.pop() if self.marked else ([], None)
        if patch is not None:
            patch.__exit__(None, None, None)
        for value in marked:
            for attr in ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking"):
                if hasattr(value, attr):
                    delattr(value, attr)

    def _chooser(self, values: tuple[Any, ...]) -> Any:
        """Return the function giving each input the dimensions to mark in this call."""
        first = next(
            (v for v in values if isinstance(v, torch.Tensor) and v.dim() > self.dim), None
        )
        seq_dim = 1 if self.dim == 0 else 0
        batch = first.shape[self.dim] if first is not None else 0
        by_sequence = self.along == "sequence" or (
            self.along == "auto" and batch < SPLIT_BATCH_AT_LEAST
        )
        if not by_sequence or first is None or first.dim() <= seq_dim:
            return lambda v: [self.dim] if self._batched(v) else []
        length = first.shape[seq_dim]
        if length < SPLIT_BATCH_AT_LEAST:
            return lambda v: []

        def sequence_dims(value: Any) -> list[int]:
            if not isinstance(value, torch.Tensor):
                return []
            if value.dim() > seq_dim and value.shape[seq_dim] == length:
                return [seq_dim]
            return [d for d, size in enumerate(value.shape) if size == length]

        return sequence_dims

    def _batched(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > self.dim
            and value.shape[self.dim] >= 2
        )

    def _by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any], dims_of: Any) -> Any:
        """Return a config patch naming the forward's tensor arguments dynamic, or None."""
        import re

        if self.signature is None:
            return None
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        entries = []
        for name, value in bound.arguments.items():
            values = value if isinstance(value, tuple) else (value,)  # *args
            for i, v in enumerate(values):
                source = f"L[{name!r}]" + (f"[{i}]" if isinstance(value, tuple) else "")
                entries += [f"{re.escape(source)}$:{d}" for d in dims_of(v)]
        config: Any = torch.compiler.config  # a config module: its fields are attributes
        if not entries or not hasattr(config, "dynamic_sources"):
            return None
        given = config.dynamic_sources
        return config.patch(dynamic_sources=",".join([given, *entries]).strip(","))


def _hooked(module: nn.Module) -> bool:
    """Whether forward pre-hooks besides kareus's run before the compiled module's forward.

    The original module's (a compiled module calls it) and the global ones: FSDP2's
    pre-forward hook replaces the inputs by tensors that carry no mark.
    """
    from torch.nn.modules import module as module_globals

    inner = getattr(module, "_orig_mod", module)
    return bool(
        inner._forward_pre_hooks
        or len(module._forward_pre_hooks) > 1
        or module_globals._global_forward_pre_hooks
    )


def _signature(fn: Any) -> Any:
    import inspect

    try:
        return inspect.signature(fn) if fn is not None else None
    except (TypeError, ValueError):  # a builtin without one
        return None


def _wait_in_flight(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Replace inputs that are ``AsyncCollectiveTensor``s by waited copies.

    A clone waits for the collective and returns a plain tensor; a view would stay in flight.
    """
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:  # pragma: no cover - a build without torch.distributed
        return args, kwargs, False
    if not any(isinstance(v, AsyncCollectiveTensor) for v in (*args, *kwargs.values())):
        return args, kwargs, False

    def waited(v: Any) -> Any:
        return v.clone() if isinstance(v, AsyncCollectiveTensor) else v

    return tuple(map(waited, args)), {k: waited(v) for k, v in kwargs.items()}, True


def strip_orig_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Give back the model's keys (torch.compile's wrapper names each "_orig_mod.<key>")."""
    for key in [k for k in state_dict if k.startswith(prefix + _ORIG)]:
        state_dict[prefix + key[len(prefix) + len(_ORIG) :]] = state_dict.pop(key)


def add_orig_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Accept both the model's keys and torch.compile's "_orig_mod." keys."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if not rest.startswith(_ORIG):
            state_dict[prefix + _ORIG + rest] = state_dict.pop(key)

"""Training a model and its compiled copy side by side, and comparing their histories."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn

Batch = Union[tuple[Any, ...], Mapping[str, Any]]  # noqa: UP007 (runtime alias on 3.10)


@dataclasses.dataclass
class History:
    """Losses per optimizer step and the gradients seen before each step, by parameter name."""

    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]


def token_batches(
    count: int, batch: int, seq: int, vocab: int, *, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return ``count`` random (ids, labels) pairs of shape [batch, seq]."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=gen),
            torch.randint(0, vocab, (batch, seq), generator=gen),
        )
        for _ in range(count)
    ]


def train(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    accumulate: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    lr: float = 1e-2,
) -> History:
    """Train with AdamW, one optimizer step per ``accumulate`` batches.

    Args:
        model: called as ``model(*batch)`` (``model(**batch)`` for a dict); returns the
            loss unless ``loss_fn`` is given.
        batches: the inputs, one tuple or dict per micro-batch.
        accumulate: micro-batches per optimizer step (gradient accumulation).
        loss_fn: maps the model's output and the batch to a scalar loss.
        lr: learning rate.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    hist = History([], [])
    for i, batch in enumerate(batches):
        out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
        loss = loss_fn(out, batch) if loss_fn is not None else out
        (loss / accumulate).backward()
        hist.losses.append(loss.detach().clone())
        if (i + 1) % accumulate == 0:
            hist.grads.append(gradients(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return hist


def compare_training(
    make_model: Callable[[], nn.Module],
    compile_fn: Callable[[nn.Module], nn.Module],
    batches: Sequence[Batch],
    *,
    resync: bool = False,
    accumulate: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    lr: float = 1e-2,
) -> tuple[History, History]:
    """Train an eager model and a compiled copy side by side on the same batches.

    Both start from the same weights and each has its own AdamW optimizer.

    Args:
        make_model: builds the eager model; the compiled one is a deep copy of it.
        compile_fn: compiles the copy, e.g. ``kareus.compile``.
        batches: the micro-batches (tuples, or dicts of keyword arguments).
        resync: after each optimizer step, copy the eager weights into the compiled model, so
            that every step compares both models on identical weights. Use it when the
            compiled model sums gradients in another order (nanobatches): otherwise rounding
            differences of one step grow through the optimizer into the next step's loss.
        accumulate: micro-batches per optimizer step.
        loss_fn: maps the model's output and the batch to a scalar loss.
        lr: learning rate.

    Returns:
        The eager history and the compiled history.
    """
    eager = make_model()
    compiled = compile_fn(copy.deepcopy(eager))
    models = (eager, compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    hists = (History([], []), History([], []))
    for i, batch in enumerate(batches):
        for model, hist in zip(models, hists, strict=True):
            out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
            loss = loss_fn(out, batch) if loss_fn is not None else out
            (loss / accumulate).backward()
            hist.losses.append(loss.detach().clone())
        if (i + 1) % accumulate:
            continue
        for model, hist, opt in zip(models, hists, opts, strict=True):
            hist.grads.append(gradients(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        if resync:
            with torch.no_grad():
                for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
                    q.copy_(p)
    return hists


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return a copy of each parameter's gradient, by the uncompiled model's names."""
    return {
        _plain(n): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def assert_same_history(
    ref: History, got: History, *, bitwise_loss: bool = True, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Assert equal losses (bitwise by default) and gradients within fp32 rounding."""
    assert len(ref.losses) == len(got.losses) and len(ref.grads) == len(got.grads)
    for step, (a, b) in enumerate(zip(ref.losses, got.losses, strict=True)):
        if bitwise_loss:
            assert torch.equal(a, b), f"loss differs at step {step}: {a.item()} vs {b.item()}"
        else:
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    for step, (ga, gb) in enumerate(zip(ref.grads, got.grads, strict=True)):
        assert ga.keys() == gb.keys(), f"parameters with gradients differ at step {step}"
        for name in ga:
            torch.testing.assert_close(
                gb[name],
                ga[name],
                rtol=rtol,
                atol=atol,
                msg=functools.partial(_where, name, step),
            )


def _where(name: str, step: int, message: str) -> str:
    return f"gradient of {name} at step {step}: {message}"


def _plain(name: str) -> str:
    # torch.compile's and checkpoint_wrapper's wrappers, at any depth
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")

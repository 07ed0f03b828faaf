"""Hand-built partition sets and options: Megatron-LM layers priced without tracing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def _megatron_layer_ops(
    *, hidden: int, ffn: int, heads: int, seq: int, rows: int, tp: int, dtype: str
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Return one layer's attention and MLP ops for ``rows`` sequences, forward."""
    from kareus.ir.costs import OpCost

    tokens = rows * seq
    b = 2 if dtype in ("bf16", "fp16") else 4
    act = tokens * hidden * b
    hd = hidden // heads
    h_tp = heads // tp

    def mem(name: str, nbytes: float) -> OpCost:
        return OpCost("memory", nbytes / b, nbytes, dtype, name)

    def gemm(name: str, m: int, k: int, n: int) -> OpCost:
        return OpCost("gemm", 2.0 * m * k * n, float((m * k + k * n + m * n) * b), dtype, name)

    attn_ops = (
        mem("norm", 2 * act),
        gemm("qkv", tokens, hidden, 3 * hidden // tp),
        mem("rope", 4 * tokens * 2 * hidden // tp * b),
        OpCost(
            "attention",
            4.0 * rows * h_tp * seq * seq * hd / 2,
            4.0 * tokens * hidden // tp * b,
            dtype,
            "attention",
        ),
        gemm("out_proj", tokens, hidden // tp, hidden),
    )
    mlp_ops = (
        mem("residual_norm", 3 * act),
        gemm("gate_up", tokens, hidden, 2 * ffn // tp),
        mem("swiglu", 3 * tokens * ffn // tp * b),
        gemm("down", tokens, ffn // tp, hidden),
    )
    return attn_ops, mlp_ops


def _add_split_type(
    pset: Any, kind: str, label: str, ops: tuple[Any, ...], coll: Any, layers: int
) -> None:
    """Add one partition type (a slot per op) and its partitions, two per layer, to ``pset``."""
    from kareus.ir.partitions import Partition, PartitionType, Slot

    key = f"{kind}.{label}"
    slots = tuple(Slot(f"{key}.{i}", (o,)) for i, o in enumerate(ops))
    pset.types[key] = PartitionType(key, kind, ops, tuple(s.label for s in slots), coll)
    for layer in range(layers):
        for nb in (0, 1):
            pset.partitions.append(
                Partition(
                    kind,
                    f"layers.{layer}",
                    nb,
                    0,
                    key,
                    tuple(s.first for s in slots),
                    slots,
                    (f"issue{layer}{nb}{label}", f"wait{layer}{nb}{label}"),
                )
            )


def tradeoff_options(
    group: tuple[int, str], freqs: Sequence[float], stage_step: float = 0.1
) -> list[Any]:
    """Return made-up options of one group: two profiles whose hulls cross.

    Profile "b" is 10 % faster at 10 % more energy; dynamic energy is worth saving against
    static power; a backward is 1.5 times its forward, each stage ``stage_step`` larger
    than the one before.
    """
    from kareus.planner.dag import Option

    size = 1.0 + 0.5 * (group[1] == "backward") + stage_step * group[0]
    return [
        Option(
            f,
            p,
            size * (1000 / f) * (0.9 if p == "b" else 1.0),
            size * 300 * (f / 1000) ** 2 * (1.1 if p == "b" else 1.0),
        )
        for f in freqs
        for p in ("a", "b")
    ]


def random_options(rng: Any, freqs: Sequence[float] = (1410, 1200, 1005)) -> list[Any]:
    """Return random options of one key: two profiles, each slower and cheaper at lower clocks.

    ``rng``: a ``random.Random``. Each profile draws its size, how its time grows as the
    clock falls (by 1 to 1.41 times at 1005 MHz) and how its energy falls (by 0.71 to 0.51
    times), with a 10 % jitter per option, so hulls and clock choices differ per instance.
    """
    from kareus.planner.dag import Option

    out = []
    for p in ("a", "b"):
        base = rng.uniform(0.8, 1.2)
        for f in freqs:
            t = base * (freqs[0] / f) ** rng.uniform(0.5, 1.0)
            e = base * 100 * (f / freqs[0]) ** rng.uniform(0.5, 2.0) * rng.uniform(0.9, 1.1)
            out.append(Option(f, p, t, e))
    return out


def megatron_partition_set(
    *,
    hidden: int,
    ffn: int,
    heads: int,
    seq: int,
    microbatch: int,
    layers: int,
    tp: int,
    dtype: str = "bf16",
    vocab: int = 32000,
    nanobatches: int = 2,
) -> Any:
    """Return a partition set for Megatron-style layers, from shapes alone (no tracing).

    For planner tests and benchmarks: per layer and direction, an attention and an MLP
    partition per nanobatch, each overlapping a tensor-parallel all-reduce of the other
    nanobatch's activation. Backward ops cost twice the forward (input and weight grads).
    ``nanobatches=1``: the original graphs' set instead, each layer whole (its ops at the
    whole micro-batch, outside partitions) with its two all-reduces alone.
    """
    from kareus.ir.costs import CollectiveCost, OpCost
    from kareus.ir.partitions import PartitionSet

    tokens = microbatch // nanobatches * seq  # one nanobatch (or the whole micro-batch)
    b = 2 if dtype in ("bf16", "fp16") else 4
    act = tokens * hidden * b
    attn_ops, mlp_ops = _megatron_layer_ops(
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        seq=seq,
        rows=microbatch // nanobatches,
        tp=tp,
        dtype=dtype,
    )

    def mem(name: str, nbytes: float) -> OpCost:
        return OpCost("memory", nbytes / b, nbytes, dtype, name)

    def gemm(name: str, m: int, k: int, n: int) -> OpCost:
        return OpCost("gemm", 2.0 * m * k * n, float((m * k + k * n + m * n) * b), dtype, name)

    coll = CollectiveCost("all_reduce", float(act), tp)

    def backward(ops: tuple[OpCost, ...]) -> tuple[OpCost, ...]:
        return tuple(
            dataclasses.replace(o, flops=2 * o.flops, bytes=2 * o.bytes) for o in reversed(ops)
        )

    pset = PartitionSet()
    whole = microbatch * seq
    head = (
        gemm("lm_head", whole, hidden, vocab // tp),
        mem("loss", whole * vocab // tp * 4),
    )
    for kind, attn, mlp in (
        ("forward", attn_ops, mlp_ops),
        ("backward", backward(mlp_ops), backward(attn_ops)),
    ):
        pset.other[kind] = head if kind == "forward" else backward(head)
        if nanobatches == 1:
            blocks = [f"layers.{layer}" for layer in range(layers)]
            pset.block_other[kind] = {b: attn + mlp for b in blocks}
            pset.block_exposed[kind] = {b: (coll, coll) for b in blocks}
            pset.exposed[kind] = (coll,) * (2 * layers)
            continue
        for label, ops in (("a", attn), ("b", mlp)):
            _add_split_type(pset, kind, label, ops, coll, layers)
        pset.exposed[kind] = (coll,)
    return pset

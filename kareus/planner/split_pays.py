"""Whether splitting a block into two nanobatches makes the step faster, block by block.

A split costs kernels (each op of the block runs twice at half the size; a smaller matmul
fills fewer SMs; every kernel pays its launch) and gains only the collective time the other
nanobatch's compute hides. From the partition set of the split graphs, each block is priced
both ways with one evaluator (the GPU's hardware model, or a CPU host's), at one clock:

- **split**: each partition with its collective launched at its start (nanobatching's
  default), the block's work outside partitions, and its collectives that overlap nothing;
- **whole**: the same ops and collectives at the whole batch, run one after another. Each
  nanobatch's op stands for half of the whole op: the whole block is priced as half of each
  op at twice its size (its FLOPs and bytes doubled, and its matmul's batch or rows, the
  dimension the batch runs along), and each collective as half of one of twice the bytes,
  alone.

The whole price keeps the split's own copies (the cat of the nanobatches' outputs, the sum
of their weight gradients) at half their doubled cost: it leans, by those small kernels, to
the split. A block whose split is not predicted faster by more than :data:`MIN_GAIN` of its
whole time stays whole. Every figure is modelled.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

from kareus.ir.costs import (
    CollectiveCost,
    Estimate,
    Evaluator,
    Knobs,
    OpCost,
    PartitionWork,
)
from kareus.ir.partitions import PartitionSet

MIN_GAIN = 0.01
"""The share of a block's whole time its split must be predicted to save to be made."""


@dataclasses.dataclass(frozen=True)
class SplitVerdict:
    """One block's modelled forward-and-backward time, split and whole, on one device."""

    block: str
    whole_s: float
    split_s: float
    device: str

    @property
    def gain(self) -> float:
        """The share of the whole time the split saves (negative: it costs)."""
        return (self.whole_s - self.split_s) / self.whole_s if self.whole_s > 0 else 0.0

    @property
    def pays(self) -> bool:
        """Whether the split is predicted to save more than :data:`MIN_GAIN`."""
        return self.gain > MIN_GAIN

    def describe(self) -> str:
        """Say what was predicted and chosen, e.g. for ``kareus.explain``."""
        change = "faster" if self.gain > 0 else "slower"
        verdict = "split" if self.pays else "kept whole"
        return (
            f"{verdict}: modelled on {self.device}, its forward and backward take "
            f"{_ms(self.whole_s)} whole and {_ms(self.split_s)} split "
            f"({abs(self.gain) * 100:.1f} % {change}; a split is made above "
            f"{MIN_GAIN * 100:g} %)"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def doubled(op: OpCost) -> OpCost:
    """Return ``op`` at twice its batch: FLOPs and bytes doubled, and the batch's dimension."""
    dims = op.dims
    if len(dims) == 4:
        b, m, n, k = dims
        dims = (2 * b, m, n, k) if b > 1 else (b, 2 * m, n, k)
    return dataclasses.replace(op, flops=2 * op.flops, bytes=2 * op.bytes, dims=dims)


CollectiveTime = Callable[[CollectiveCost], float | None]
"""The seconds a collective takes where its process group says so (None: the model's)."""


class DeclaredCollectives:
    """An evaluator whose collectives on groups that declare their durations take them.

    Such a collective (an emulated link) takes no compute: a partition runs its ops as the
    inner evaluator prices them, and the collective from its launch slot for its declared
    time; the partition ends when both have. Everything else is the inner evaluator's.
    """

    source = "modelled"

    def __init__(self, inner: Evaluator, declared: CollectiveTime) -> None:
        self.inner = inner
        self.declared = declared

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Estimate ops run back to back (the inner evaluator's)."""
        return self.inner.ops(ops, freq_mhz)

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Estimate a partition, its collective at its declared duration where it has one."""
        coll = work.collective
        seconds = self.declared(coll) if coll is not None else None
        if seconds is None:
            return self.inner.partition(work, knobs)
        compute = self.inner.ops(work.ops, knobs.freq_mhz)
        slot = knobs.launch_slot
        if slot is None or slot >= len(work.ops):
            time_s = compute.time_s + seconds
        else:
            start = self.inner.ops(work.ops[:slot], knobs.freq_mhz).time_s if slot else 0.0
            time_s = max(compute.time_s, start + seconds)
        return dataclasses.replace(compute, time_s=time_s)


def price_split(
    pset: PartitionSet,
    evaluator: Evaluator,
    *,
    freq_mhz: float,
    sm_share: int,
    device: str,
) -> dict[str, SplitVerdict]:
    """Price each split block of ``pset`` whole and split (module docstring).

    Args:
        pset: the partition set of a region's split forward and backward graphs.
        evaluator: prices ops and partitions (its collectives' groups already resolved).
        freq_mhz: the clock both are priced at (a GPU's top clock; ignored by a CPU's).
        sm_share: SMs of each collective, overlapped or alone (NCCL's default).
        device: what ``evaluator`` models, for the verdicts' text.

    Returns:
        A verdict per block that has partitions (a block left whole has none).
    """
    split: dict[str, float] = defaultdict(float)
    whole: dict[str, float] = defaultdict(float)
    alone = Knobs(freq_mhz, sm_share, launch_slot=None)

    def alone_s(coll: CollectiveCost) -> float:
        return evaluator.partition(PartitionWork((), coll), alone).time_s

    for p in pset.partitions:
        if p.whole:
            continue
        ptype = pset.types[p.type_key]
        work = PartitionWork(ptype.compute, ptype.collective)
        split[p.block] += evaluator.partition(work, Knobs(freq_mhz, sm_share)).time_s
        twice = tuple(doubled(op) for op in ptype.compute)
        whole[p.block] += evaluator.ops(twice, freq_mhz).time_s / 2
        if ptype.collective is not None:
            big = dataclasses.replace(ptype.collective, bytes=2 * ptype.collective.bytes)
            whole[p.block] += alone_s(big) / 2
    for kind in ("forward", "backward"):
        for block, ops in pset.block_other.get(kind, {}).items():
            if block in split:
                split[block] += evaluator.ops(ops, freq_mhz).time_s
                whole[block] += evaluator.ops(tuple(map(doubled, ops)), freq_mhz).time_s / 2
        for block, colls in pset.block_exposed.get(kind, {}).items():
            if block in split:
                for coll in colls:
                    split[block] += alone_s(coll)
                    whole[block] += alone_s(dataclasses.replace(coll, bytes=2 * coll.bytes)) / 2
    return {b: SplitVerdict(b, whole[b], split[b], device) for b in split}

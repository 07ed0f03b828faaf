"""What each kind of collective costs one micro-batch of a pipeline stage (modelled).

The step's communication, by kind, beside its compute: each collective priced alone at the
GPU's highest clock with the default SM share, the compute run back to back at that clock
(one micro-batch's forward and backward, repeated layers counted). Overlap hides part of
the communication; this is what there is to hide.
"""

from __future__ import annotations

import collections
import dataclasses

from kareus.hardware.emulator import Emulator
from kareus.hardware.specs import GPUSpec
from kareus.ir.costs import CollectiveCost, Knobs, OpCost
from kareus.ir.partitions import PartitionSet

_NAMES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One micro-batch's forward and backward on a stage, at the highest clock (modelled).

    Attributes:
        compute_s: the compute, back to back.
        by_kind: per collective kind, (count, seconds), each collective alone.
    """

    compute_s: float
    by_kind: dict[str, tuple[int, float]]

    @property
    def total_s(self) -> float:
        """Compute and every collective, one after another."""
        return self.compute_s + sum(t for _n, t in self.by_kind.values())

    def describe(self) -> str:
        """One line: each kind's count, time and share of the total."""
        parts = [
            f"{_NAMES.get(kind, kind)} x{n} {t * 1e3:.2f} ms ({t / self.total_s:.1%})"
            for kind, (n, t) in sorted(self.by_kind.items())
        ]
        compute = f"compute {self.compute_s * 1e3:.2f} ms ({self.compute_s / self.total_s:.1%})"
        return ", ".join([*parts, compute])


def stage_work(pset: PartitionSet) -> tuple[list[OpCost], list[CollectiveCost]]:
    """Return every compute op and every collective of one micro-batch on the stage."""
    ops: list[OpCost] = []
    colls: list[CollectiveCost] = []
    for p in pset.partitions:
        ops += [o for slot in p.slots for o in slot.ops]
        coll = pset.types[p.type_key].collective
        colls += [coll] if coll is not None else []
    for instr in ("forward", "backward"):
        ops += pset.outside(instr) + pset.recompute.get(instr, ())
        colls += pset.exposed.get(instr, ()) + pset.recompute_collectives.get(instr, ())
    return ops, colls


def stage_traffic(pset: PartitionSet, spec: GPUSpec, sm_share: int) -> Traffic:
    """Return the compute and each collective kind of one micro-batch on the stage."""
    ops, colls = stage_work(pset)
    emulator = Emulator(spec)
    fmax = spec.clock_max_mhz
    knobs = Knobs(fmax, sm_share, launch_slot=None)
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for c in colls:
        if c.world_size > 1:
            by_kind[c.kind].append(emulator.collective_time(c, knobs))
    return Traffic(
        emulator.ops(tuple(ops), fmax).time_s,
        {k: (len(ts), sum(ts)) for k, ts in by_kind.items()},
    )

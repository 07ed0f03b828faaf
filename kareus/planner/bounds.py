"""A lower bound on any plan's iteration time and energy, to show how much is left.

Every compute op runs at its own best clock (the fastest for time, the most frugal for
energy, chosen per op), communication is fully hidden and free, and clock switches cost
nothing. Pipeline bubbles are kept in the time bound (the critical path of the iteration)
but add no energy to the energy bound. No real plan can beat either number: a plan runs
whole instructions at one clock, pays for its collectives, and idles in bubbles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kareus.ir.costs import Evaluator, OpCost
from kareus.ir.partitions import PartitionSet
from kareus.planner.dag import chain, makespan, one_f_one_b


@dataclasses.dataclass(frozen=True)
class LowerBound:
    """The least iteration time and the least iteration energy (all GPUs) any plan reaches."""

    time_s: float
    energy_j: float
    source: str


def lower_bound(
    stages: Sequence[PartitionSet],
    evaluator: Evaluator,
    clocks_mhz: Sequence[float],
    *,
    gpus_per_stage: int,
    microbatches: int,
) -> LowerBound:
    """Return the lower bound of one iteration over ``stages`` (one set per stage)."""
    pp = len(stages)
    cache: dict[OpCost, tuple[float, float]] = {}

    def best(op: OpCost) -> tuple[float, float]:
        if op not in cache:
            ests = [evaluator.ops((op,), f) for f in clocks_mhz]
            cache[op] = (min(e.time_s for e in ests), min(e.energy_j for e in ests))
        return cache[op]

    per_instr: dict[tuple[int, str], tuple[float, float]] = {}
    for si, pset in enumerate(stages):
        for kind in ("forward", "backward"):
            parts = [p for p in pset.partitions if p.instruction == kind]
            ops = [o for p in parts for s in p.slots for o in s.ops] + list(pset.outside(kind))
            ops += pset.recompute.get(kind, ())
            bests = [best(o) for o in ops]
            per_instr[(si, kind)] = (sum(t for t, _ in bests), sum(e for _, e in bests))
    iteration = one_f_one_b(pp, microbatches) if pp > 1 else chain(microbatches)
    durations = [per_instr[i.group][0] for i in iteration.instructions]
    energy = sum(per_instr[i.group][1] for i in iteration.instructions) * gpus_per_stage
    return LowerBound(
        makespan(iteration, durations), energy, getattr(evaluator, "source", "modelled")
    )

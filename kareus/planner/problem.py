"""The composition problem every solver of the planner reads, and what a solve returns.

:class:`Problem` is the one bundle the composer, both relaxations, CP-SAT's model and the
clock-change pass read (the iteration, its options, and the power and GPUs a plan is priced
on); :class:`SolveKnobs` how hard the composer solves it; :class:`Solution` one composed
plan; :class:`Solves` what the frontier's sweep asks of a composer. A leaf of the planner:
every solver imports it, it imports none of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Protocol

from kareus.planner.dag import Iteration, Option, SwitchCost, plan_cost


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """One iteration to compose, and what a plan of it is priced on.

    Attributes:
        iteration: the DAG.
        options: per group (stage, kind), the options of its instructions.
        static_power_w: static power of one GPU.
        gpus: GPUs of the iteration (static power is paid on all of them).
        gpus_per_stage: GPUs that run each instruction (TP x CP x DP of a stage).
        change_j: per instruction, the energy of a clock change before it, on all GPUs of
            its stage (empty: changes are free).
    """

    iteration: Iteration
    options: Mapping[tuple[int, str], Sequence[Option]]
    static_power_w: float
    gpus: int
    gpus_per_stage: int = 1
    change_j: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        options = {g: tuple(o) for g, o in self.options.items()}
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "change_j", tuple(self.change_j))

    def cost(self, choices: Sequence[Option]) -> tuple[float, float]:
        """Return (iteration time, energy of all GPUs) of one choice per instruction."""
        return plan_cost(
            self.iteration,
            choices,
            static_power_w=self.static_power_w,
            gpus=self.gpus,
            gpus_per_stage=self.gpus_per_stage,
            change_j=self.change_j,
        )

    def option(self, key: tuple[int, str], profile: str, freq_mhz: float) -> Option | None:
        """Return ``key``'s option of ``profile`` at ``freq_mhz`` (None: it has none)."""
        return self._by_clock[key].get((profile, freq_mhz))

    @functools.cached_property
    def _by_clock(self) -> dict[tuple[int, str], dict[tuple[str, float], Option]]:
        return {g: {(o.profile, o.freq_mhz): o for o in opts} for g, opts in self.options.items()}


@dataclasses.dataclass(frozen=True)
class SolveKnobs:
    """How the composer solves (:class:`~kareus.planner.compose.Composer`).

    Attributes:
        time_limit_s: a search's work limit per solve and 64 instructions of the iteration:
            CP-SAT's deterministic time units, or 500 of SCIP's nodes a unit (the result
            never depends on machine load).
        workers: CP-SAT search workers, interleaved in one thread when more than one.
        seed: CP-SAT's random seed.
        gap_limit: a solve stops once its plan is proven within this fraction of the least
            energy (deterministic: the proof, not the clock, decides).
        search_max_instructions: CP-SAT searches only iterations of at most this many
            instructions (None: any); a larger one keeps the relaxation's plan and reports
            its gap, proven or not.
        branch_max_instructions: iterations of at most this many instructions are
            searched by SCIP's branch and bound (:mod:`kareus.planner.mip`), larger ones by
            CP-SAT (None: CP-SAT always).
        dive_max_instructions: the relaxation's dive improves the rounded plan only in
            iterations of at most this many instructions (None: any); a larger one keeps
            the rounded plan and its proven gap.
        flow_min_instructions: iterations of at least this many instructions solve the
            relaxation as a min-cost flow (:mod:`kareus.planner.flow`: the same bound, a
            rounding about as good, no dive) instead of by the simplex (None: never); the
            simplex still dives where the flow's plan is not proven within the gap limit
            and the iteration has at most ``dive_max_instructions``.
        switch: what a clock change costs (:class:`~kareus.planner.dag.SwitchCost`); every
            plan is priced with it, CP-SAT weighs it, and a change whose saving does not
            pay for it is undone. The simplex's relaxation prices it too (each pair that may
            change, by the total variation of the two instructions' clock weights); the
            flow's leaves it out. Either bound stays a bound.
    """

    time_limit_s: float = 10.0
    workers: int = 1
    seed: int = 0
    gap_limit: float = 0.0
    search_max_instructions: int | None = None
    branch_max_instructions: int | None = None
    dive_max_instructions: int | None = None
    flow_min_instructions: int | None = None
    switch: SwitchCost | None = None


@dataclasses.dataclass(frozen=True)
class Solution:
    """One composed plan: an option per instruction, the iteration time and energy.

    ``bound_j`` is CP-SAT's proof that no plan on the same options within ``within_s``
    (any time when None) uses less energy; it is None for plans that no solve produced.
    """

    choices: tuple[Option, ...]
    time_s: float
    energy_j: float
    status: str
    within_s: float | None = None
    bound_j: float | None = None

    @property
    def gap(self) -> float | None:
        """The proven gap: how much of the energy a better plan could at most save."""
        return None if self.bound_j is None else (self.energy_j - self.bound_j) / self.energy_j

    def proven(self, gap_limit: float) -> bool:
        """Whether CP-SAT proved the plan optimal or its gap is within ``gap_limit``."""
        return self.status == "OPTIMAL" or (self.gap is not None and self.gap <= gap_limit)


class Solves(Protocol):
    """What the frontier's sweep (:mod:`kareus.planner.sweep`) asks of a composer."""

    @property
    def gap_limit(self) -> float:
        """The fraction of its energy a solve's plan is proven within before it stops."""

    @property
    def solves(self) -> list[Solution]:
        """Every solve since the last :meth:`restart`."""

    def restart(self) -> None:
        """Forget the solves so far (a new frontier begins)."""

    def solve(
        self,
        *,
        bound_s: float | None = None,
        minimise: str = "energy",
        hint: Solution | None = None,
    ) -> Solution:
        """Solve for least energy under ``bound_s`` (least time first with ``"time"``)."""

    def fastest_choice(self) -> Solution:
        """Every instruction's fastest option: a feasible start."""

    def uniform_plans(self) -> list[Solution]:
        """Every plan at one clock with one profile name."""

"""One CP-SAT search of an iteration: least energy within a time bound, from a hint.

The composer (:mod:`kareus.planner.compose`) calls it where the linear relaxation has not
proven its plan within the gap limit. Times are whole microseconds, energies microjoules,
static power whole watts; the search is deterministic (CP-SAT's work count, one thread).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from kareus.planner.dag import Option, group_profiles
from kareus.planner.problem import Problem, Solution, SolveKnobs

_log = logging.getLogger(__name__)

WALL_CLOCK_GUARD_S = 600.0
"""A wall-clock stop for one solve, far beyond its deterministic limit: it only guards
against a hung machine (a solve it stops reports it in its status)."""


@dataclasses.dataclass(frozen=True)
class CpSatSearch:
    """CP-SAT's model of one iteration and its search.

    Attributes:
        problem: the iteration, the options CP-SAT chooses from per group, and what a plan
            is priced on (``change_j`` empty: changes are free, and not in the model).
        knobs: the composer's (its work limit, workers, seed and gap limit).
    """

    problem: Problem
    knobs: SolveKnobs

    @property
    def switches(self) -> bool:
        """Whether clock changes cost anything (they are in the model)."""
        return bool(self.problem.change_j)

    def run(
        self,
        opts: Sequence[Sequence[Option]],
        us: list[list[int]],
        bound_us: int | None,
        hint: Solution | None,
    ) -> tuple[str, tuple[Option, ...] | None, float | None]:
        """Run CP-SAT once: return its status, plan and objective bound.

        The plan is None where it found none; the bound (microjoules) is None where the
        model is infeasible.
        """
        from ortools.sat.python import cp_model

        m, x = self.model(opts, us, bound_us)
        if hint is not None:
            for i in range(len(opts)):
                for k, o in enumerate(opts[i]):
                    m.add_hint(x[i][k], o == hint.choices[i])
        solver = cp_model.CpSolver()
        # Deterministic: the search is interleaved in one thread and stopped by CP-SAT's
        # deterministic work count, not by the wall clock, so the same inputs give the same
        # plan on any machine under any load. Larger iterations get proportionally more
        # work: the limit is per 64 instructions.
        solver.parameters.num_workers = self.knobs.workers
        solver.parameters.interleave_search = self.knobs.workers > 1
        solver.parameters.random_seed = self.knobs.seed
        solver.parameters.relative_gap_limit = self.knobs.gap_limit
        limit = self.knobs.time_limit_s * max(1.0, len(self.problem.iteration.instructions) / 64)
        solver.parameters.max_deterministic_time = limit
        solver.parameters.max_time_in_seconds = WALL_CLOCK_GUARD_S
        status = solver.solve(m)
        name = solver.status_name(status)
        _log.debug(
            "CP-SAT least energy within %s us: %s after %.2f deterministic units",
            bound_us,
            name,
            solver.deterministic_time,
        )
        bound = None if status == cp_model.INFEASIBLE else solver.best_objective_bound
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return name, None, bound
        choices = tuple(
            opts[i][next(k for k, v in enumerate(x[i]) if solver.value(v))]
            for i in range(len(opts))
        )
        return name, choices, bound

    def model(
        self, opts: Sequence[Sequence[Option]], us: list[list[int]], bound_us: int | None
    ) -> tuple[Any, list[list[Any]]]:
        """Return CP-SAT's model of the iteration (least energy within ``bound_us``) and x.

        ``x[i][k]``: instruction ``i`` runs option ``k``; one decision profile per group;
        times in whole microseconds, energies in microjoules, static power in whole watts.
        """
        from ortools.sat.python import cp_model

        m = cp_model.CpModel()
        horizon = sum(max(d) for d in us) + 1
        x = [[m.new_bool_var(f"x{i}_{k}") for k in range(len(us[i]))] for i in range(len(us))]
        profiles = group_profiles(self.problem.iteration, self.problem.options)
        groups = sorted(profiles)
        y = {g: {p: m.new_bool_var(f"y{g}_{p}") for p in profiles[g]} for g in groups}
        for g in groups:
            m.add_exactly_one(y[g].values())
        start, end = [], []
        switch_uj = self.switch_terms(m, x, opts)
        for i, instr in enumerate(self.problem.iteration.instructions):
            m.add_exactly_one(x[i])
            for k, opt in enumerate(opts[i]):
                m.add_implication(x[i][k], y[instr.group][opt.profile])
            s = m.new_int_var(0, horizon, f"s{i}")
            e = m.new_int_var(0, horizon, f"e{i}")
            m.add(e == s + sum(d * v for d, v in zip(us[i], x[i], strict=True)))
            start.append(s)
            end.append(e)
        for a, b in self.problem.iteration.edges:
            m.add(end[a] <= start[b])
        t = m.new_int_var(0, horizon, "T")
        for e in end:
            m.add(t >= e)
        if bound_us is not None:
            m.add(t <= bound_us)
        dyn = sum(
            round(o.dynamic_energy_j * 1e6 * self.problem.gpus_per_stage) * x[i][k]
            for i in range(len(opts))
            for k, o in enumerate(opts[i])
        )
        # W x us = uJ (down: a bound stays one)
        static_w = math.floor(self.problem.static_power_w * self.problem.gpus)
        m.minimize(dyn + switch_uj + static_w * t)
        return m, x

    def switch_terms(self, m: Any, x: list[list[Any]], opts: Sequence[Sequence[Option]]) -> Any:
        """Add the clock changes to CP-SAT's model; return their energy (uJ).

        A change before instruction b (its predecessor on the GPU runs another clock) costs
        b's :func:`~kareus.planner.dag.change_energy` on all its GPUs.
        """
        if not self.switches:
            return 0
        clocks = [
            sum(round(o.freq_mhz) * v for o, v in zip(opts[i], x[i], strict=True))
            for i in range(len(opts))
        ]
        top = max(round(o.freq_mhz) for row in opts for o in row)
        energy: Any = 0
        for a, b in self.problem.iteration.switch_pairs():
            w = m.new_bool_var(f"w{a}_{b}")
            m.add(clocks[a] - clocks[b] <= top * w)
            m.add(clocks[b] - clocks[a] <= top * w)
            energy += round(self.problem.change_j[b] * 1e6) * w
        return energy

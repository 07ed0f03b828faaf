"""One branch-and-bound search of an iteration with SCIP: least energy within a time bound.

The composer (:mod:`kareus.planner.compose`) calls it where the linear relaxation has not
proven its plan within the gap limit. The model is the relaxation's program
(:mod:`kareus.planner.relax`) with every option a binary: an option per instruction, a
profile per group, starts and ends in milliseconds, and a clock change wherever two
neighbours on a GPU run different clocks (priced as the relaxation prices it, by the total
variation of their clock literals). Its root relaxation is therefore the simplex's bound,
and SCIP's branching and cutting planes raise it from there.

Why SCIP and not CP-SAT's search: CP-SAT's bound on the same model stays below the
simplex's, so where clock changes decide the gap nothing was ever proven. At micro-batches
of one sequence (Llama 3.2 3B, TP 8 x PP 2 x 8, 32 instructions, A100, modelled), within
0.538 s CP-SAT given 20 times its default work ended at a plan of 1862.3 J and a bound of
1829.4 J (the simplex's: 1842.0 J); SCIP, from the relaxation's plan as its hint, proved a
plan of 1852.4 J within 0.5 % in 3 nodes (modelled energies; 8 s on one core, 2026-12-08).

Deterministic: one thread, stopped by its node count and the gap limit; the wall-clock
limit is only a guard against a hung machine (a search it stops says so in its status).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.planner.dag import Option, group_profiles
from kareus.planner.problem import Problem, Solution, SolveKnobs

_log = logging.getLogger(__name__)

_MS = 1e3
NODES_PER_UNIT = 500
"""Branch-and-bound nodes per unit of the composer's work limit and 64 instructions."""
WALL_CLOCK_GUARD_S = 600.0
"""A wall-clock stop for one search, far beyond its node limit (a guard, not a limit)."""
BOUND_TOLERANCE = 1e-6
"""SCIP's bound is exact up to its tolerances; the bound reported is lowered by this
fraction so that it stays a bound."""


@dataclasses.dataclass(frozen=True)
class MipSearch:
    """SCIP's model of one iteration and its search.

    Attributes:
        problem: the iteration, the options per group, and what a plan is priced on
            (clock changes, ``change_j``, included).
        knobs: the composer's (its work limit and gap limit).
    """

    problem: Problem
    knobs: SolveKnobs

    def run(
        self, bound_s: float | None, hint: Solution | None
    ) -> tuple[str, tuple[Option, ...] | None, float | None]:
        """Search once: return SCIP's status, its plan (None: none found) and its bound (J).

        The bound is None where the model is infeasible or SCIP proved nothing.
        """
        from ortools.linear_solver import pywraplp

        solver = pywraplp.Solver.CreateSolver("SCIP")
        if solver is None:  # pragma: no cover - SCIP ships with every OR-Tools wheel
            raise KareusError("OR-Tools' SCIP solver is not available")
        x = self._model(solver, bound_s)
        if hint is not None:
            pairs = [(v, float(o == hint.choices[i])) for i, row in enumerate(x) for o, v in row]
            solver.SetHint([v for v, _ in pairs], [h for _, h in pairs])
        n = len(self.problem.iteration.instructions)
        nodes = max(1, round(NODES_PER_UNIT * self.knobs.time_limit_s * max(1.0, n / 64)))
        solver.SetNumThreads(1)
        solver.SetTimeLimit(round(WALL_CLOCK_GUARD_S * 1e3))
        solver.SetSolverSpecificParametersAsString(
            f"limits/gap = {self.knobs.gap_limit}\nlimits/totalnodes = {nodes}\n"
            "randomization/randomseedshift = " + str(self.knobs.seed)
        )
        status = solver.Solve()
        name = {
            pywraplp.Solver.OPTIMAL: "OPTIMAL",
            pywraplp.Solver.FEASIBLE: "FEASIBLE",
            pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
        }.get(status, "UNKNOWN")
        _log.debug(
            "SCIP least energy within %s s: %s after %d nodes", bound_s, name, solver.nodes()
        )
        if status == pywraplp.Solver.INFEASIBLE:
            return name, None, None
        bound = solver.Objective().BestBound()
        bound_j = bound * (1 - BOUND_TOLERANCE) if math.isfinite(bound) else None
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return name, None, bound_j
        choices = tuple(max(row, key=lambda ov: ov[1].solution_value())[0] for row in x)
        return name, choices, bound_j

    def _model(self, solver: Any, bound_s: float | None) -> list[list[tuple[Option, Any]]]:
        """Build the model in ``solver``; return each instruction's options and literals."""
        p = self.problem
        it = p.iteration
        horizon_ms = (
            bound_s * _MS
            if bound_s is not None
            else sum(max(o.time_s for o in p.options[i.key]) for i in it.instructions) * _MS
        )
        profiles = group_profiles(it, p.options)
        y = {g: {name: solver.BoolVar(f"y{g}{name}") for name in ps} for g, ps in profiles.items()}
        for ys in y.values():
            solver.Add(sum(ys.values()) == 1)
        x: list[list[tuple[Option, Any]]] = []
        start, end = [], []
        energy: Any = 0
        for i, ins in enumerate(it.instructions):
            row = [
                (o, solver.BoolVar(f"x{i}_{k}"))
                for k, o in enumerate(p.options[ins.key])
                if o.profile in y[ins.group]
            ]
            x.append(row)
            for name, yv in y[ins.group].items():  # one option, of the group's profile
                solver.Add(sum(v for o, v in row if o.profile == name) == yv)
            s = solver.NumVar(0.0, horizon_ms, f"s{i}")
            e = solver.NumVar(0.0, horizon_ms, f"e{i}")
            solver.Add(e == s + sum(o.time_s * _MS * v for o, v in row))
            start.append(s)
            end.append(e)
            energy += sum(o.dynamic_energy_j * p.gpus_per_stage * v for o, v in row)
        for a, b in it.edges:
            solver.Add(start[b] >= end[a])
        t = solver.NumVar(0.0, horizon_ms, "T")
        for e in end:
            solver.Add(t >= e)
        energy += p.static_power_w * p.gpus / _MS * t
        energy += self._changes(solver, x)
        solver.Minimize(energy)
        return x

    def _changes(self, solver: Any, x: Sequence[Sequence[tuple[Option, Any]]]) -> Any:
        """Add each pair's clock change (1 where the two run different clocks); return its cost."""
        p = self.problem
        if not p.change_j:
            return 0
        clocks: list[dict[float, list[Any]]] = []
        for row in x:
            by: dict[float, list[Any]] = {}
            for o, v in row:
                by.setdefault(o.freq_mhz, []).append(v)
            clocks.append(by)
        cost: Any = 0
        for a, b in p.iteration.switch_pairs():
            if p.change_j[b] <= 0:
                continue
            w = solver.NumVar(0.0, 1.0, f"w{a}_{b}")
            for f, here in clocks[a].items():
                solver.Add(w >= sum(here) - sum(clocks[b].get(f, ())))
            cost += p.change_j[b] * w
        return cost

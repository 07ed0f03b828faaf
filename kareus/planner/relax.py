"""The linear relaxation of the composition: a proven lower bound and a rounded plan.

The composer's model (:mod:`kareus.planner.compose`) picks one option per instruction and
one profile per group. Its linear relaxation lets an instruction run a convex mix of its
options: every group mixes its profiles with one set of weights (each instruction of a
group gives profile ``p`` the group's weight ``y_p``, as any whole plan does), and within
a profile only the lower convex hull of its (time, energy) options matters, since a mix
of hull options is never slower nor more costly than an option above the hull. Solved
with GLOP (OR-Tools' simplex: exact and deterministic), it gives

- a **lower bound** on the energy of every plan within a time bound, in milliseconds for
  any instance size (CP-SAT proves bounds by search, which stops at its work limit);
- a **plan**: each group runs the profile the relaxation weighs most, the relaxation is
  solved again with those profiles fixed, and each instruction runs the fastest option it
  mixes. Each duration is then at most the mix's, so the plan meets the bound; then
  instructions are slowed, one option at a time, into the slack that leaves. Its energy
  exceeds the relaxation's only where an instruction mixed options, and the gap between
  the two is proven.

Where clock changes cost energy (``change_j``: per instruction, a change before it), the
relaxation prices them as well: an instruction's weight at a clock is the sum of its
options' there, and each pair of instructions that may change clock pays the change times
the total variation of their clock weights (1 for two whole options at different clocks,
0 at the same). A mix of hull options can then stand for an option only at its own clock,
so the options are each clock's hull, not the profile's. On the Qwen3 1.7B TP 4 x CP 2
x PP 2 workload of ``benchmarks/clock_change_gaps.py`` (H100) this proved 10 of 20
frontier points within 0.5 % where the bound without changes proved 1 of 31 (gaps
modelled), and planning took 50 s instead of 139 s (measured, 2 cores, 2026-12-04: CP-SAT
had searched to its work limit for what the bound could not prove).

When that plan is further from the bound than the caller accepts, a **dive** looks for a
better one: half of the instructions that still mix options (the most nearly whole first)
are fixed to the option they weigh most, the relaxation is solved again (the others adjust
to them), and so on until no instruction mixes (an instruction fixed to a slower option
the bound cannot afford is fixed to the fastest it mixed instead, which the last solution
shows is feasible). On the traced Llama 3.3 70B PP 8 x 16 with full recompute (256
instructions) rounding left plans 0.35-0.88 % above the bound and the dive 0.18-0.53 %,
in about a second per point (near the fastest plan, where few options fit, both stay
about 0.7 % above); CP-SAT, given 10 times its default work (290 s), reached 0.71 % at a
point where the dive reaches 0.4 %.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.planner.dag import (
    Iteration,
    Option,
    Timing,
    group_profiles,
    makespan,
    topology,
)
from kareus.planner.problem import Problem

_log = logging.getLogger(__name__)

_MS = 1e3  # the program's time unit is the millisecond (keeps coefficients near 1)
_WHOLE = 1e-9  # a weight within this of 0 or 1 is whole
DIVE_ROUNDS = 64
"""A dive's rounds at most (halving what mixes, it ends in about 20-35 at 256 instructions)."""
BOUND_TOLERANCE = 1e-6
"""The relaxation's optimum is exact up to the simplex's tolerances (about 1e-9 relative);
the bound reported is lowered by this fraction so that it stays a bound."""


@dataclasses.dataclass(frozen=True)
class Relaxed:
    """The relaxation at one time bound: its lower bound and the plan rounded from it.

    ``choices`` is None where no plan of the fixed profiles meets the bound.
    """

    bound_j: float
    choices: tuple[Option, ...] | None


def lower_hull(options: Sequence[Option]) -> list[Option]:
    """Return the options on the lower convex hull of (time, dynamic energy), fastest first.

    Only the decreasing part: an option slower than the least-energy one is never needed.
    """
    pts = sorted(options, key=lambda o: (o.time_s, o.dynamic_energy_j))
    hull: list[Option] = []
    for o in pts:
        if hull and o.dynamic_energy_j >= hull[-1].dynamic_energy_j:
            continue  # slower and no cheaper than a point kept: dominated
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the segment a-o (or on it): not a vertex of the lower hull
            cross = (b.time_s - a.time_s) * (o.dynamic_energy_j - a.dynamic_energy_j) - (
                b.dynamic_energy_j - a.dynamic_energy_j
            ) * (o.time_s - a.time_s)
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


class Priced:
    """What both relaxations are built from and price a plan with: the :class:`Problem`."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.it = problem.iteration
        self.options = problem.options

    def _energy(self, choices: Sequence[Option]) -> float:
        """Return a plan's energy, its clock changes priced as the relaxation prices them."""
        return self.problem.cost(choices)[1]


class Relaxation(Priced):
    """The relaxation of one composition, built once and solved at any time bound.

    Args:
        problem: the iteration, its options (one or more profiles per group), and what a
            plan is priced on, clock changes (``change_j``) included.

    Successive solves change only bounds (the time bound, the profiles fixed for rounding),
    so the simplex starts from the previous basis.
    """

    def __init__(self, problem: Problem) -> None:
        from ortools.linear_solver import pywraplp

        super().__init__(problem)
        iteration, options = problem.iteration, problem.options
        priced = any(j > 0 for j in problem.change_j)
        lp = pywraplp.Solver.CreateSolver("GLOP")
        if lp is None:  # pragma: no cover - GLOP ships with every OR-Tools wheel
            raise KareusError("OR-Tools' GLOP linear solver is not available")
        self._lp = lp
        self._solved = False  # a basis to resume from
        self._optimal = pywraplp.Solver.OPTIMAL
        self._infeasible = pywraplp.Solver.INFEASIBLE
        infinity = lp.infinity()
        self._y: dict[tuple[int, str], dict[str, Any]] = {}
        for g, names in sorted(group_profiles(iteration, options).items()):
            self._y[g] = {p: lp.NumVar(0.0, 1.0, f"y{g}{p}") for p in names}
            one = lp.Constraint(1.0, 1.0)
            for v in self._y[g].values():
                one.SetCoefficient(v, 1.0)
        # each key's hull of each of its group's profiles (per clock, where changes cost)
        hulls: dict[tuple[int, str], dict[str, list[Option]]] = {}
        for ins in iteration.instructions:
            if ins.key not in hulls:
                opts = options[ins.key]
                hulls[ins.key] = {
                    p: _hull([o for o in opts if o.profile == p], per_clock=priced)
                    for p in self._y[ins.group]
                }
        objective = lp.Objective()
        self._t = lp.NumVar(0.0, infinity, "T")
        objective.SetCoefficient(self._t, problem.static_power_w * problem.gpus / _MS)
        n = len(iteration.instructions)
        start = [lp.NumVar(0.0, infinity, f"s{i}") for i in range(n)]
        end = [lp.NumVar(0.0, infinity, f"e{i}") for i in range(n)]
        self._x: list[list[tuple[Option, Any]]] = [
            self._mix(i, hulls[instr.key], objective, start[i], end[i])
            for i, instr in enumerate(iteration.instructions)
        ]
        if priced:
            self._price_changes(objective)
        last = set(range(n))
        for a, b in iteration.edges:
            last.discard(a)
            c = lp.Constraint(0.0, infinity)  # s_b >= e_a
            c.SetCoefficient(start[b], 1.0)
            c.SetCoefficient(end[a], -1.0)
        for a in sorted(last):
            c = lp.Constraint(0.0, infinity)  # T >= e_a
            c.SetCoefficient(self._t, 1.0)
            c.SetCoefficient(end[a], -1.0)
        objective.SetMinimization()
        # "Any time" is solved under a bound no plan exceeds (every instruction at its slowest
        # option), not an infinite one: the optimum is the same, and a later finite bound
        # then only tightens a bound the simplex already has. From an infinite bound GLOP
        # restarted (at 2,048 instructions: 67,875 iterations, 23 s, against 10,686, 4 s).
        self._loose_ms = (
            makespan(
                iteration, [max(o.time_s for o in options[i.key]) for i in iteration.instructions]
            )
            * _MS
            * (1 + 1e-6)
        )

    def _mix(
        self, i: int, hulls: Mapping[str, Sequence[Option]], objective: Any, start: Any, end: Any
    ) -> list[tuple[Option, Any]]:
        """Add instruction ``i``'s weights on ``hulls`` (per profile); return them."""
        lp = self._lp
        duration = lp.Constraint(0.0, 0.0)  # e_i = s_i + the mix's duration
        duration.SetCoefficient(end, 1.0)
        duration.SetCoefficient(start, -1.0)
        group = self.it.instructions[i].group
        row = []
        for p, hull in hulls.items():
            share = lp.Constraint(0.0, 0.0)  # the profile's weight is the group's
            share.SetCoefficient(self._y[group][p], -1.0)
            for k, o in enumerate(hull):
                v = lp.NumVar(0.0, 1.0, f"x{i}_{p}_{k}")
                share.SetCoefficient(v, 1.0)
                duration.SetCoefficient(v, -o.time_s * _MS)
                objective.SetCoefficient(v, o.dynamic_energy_j * self.problem.gpus_per_stage)
                row.append((o, v))
        return row

    def _price_changes(self, objective: Any) -> None:
        """Charge each pair of instructions that may change clocks its total variation.

        An instruction's weight at clock ``c`` is the sum of its options' at ``c``; a pair
        (a, b) pays b's change energy times ``sum_c max(0, w_a(c) - w_b(c))``, which is 1
        when two whole options differ in clock and 0 when they agree: every plan is a point
        of the program at its own price, so the optimum stays a lower bound.
        """
        lp = self._lp
        clocks: list[dict[float, list[Any]]] = []  # per instruction, its variables per clock
        for row in self._x:
            clocks.append({})
            for o, v in row:
                clocks[-1].setdefault(o.freq_mhz, []).append(v)
        for a, b in self.it.switch_pairs():
            if self.problem.change_j[b] <= 0:
                continue
            for f, xs in sorted(clocks[a].items()):
                u = lp.NumVar(0.0, 1.0, f"u{a}_{b}_{f:g}")  # u >= w_a(f) - w_b(f)
                c = lp.Constraint(0.0, lp.infinity())
                c.SetCoefficient(u, 1.0)
                for v in xs:
                    c.SetCoefficient(v, -1.0)
                for v in clocks[b].get(f, ()):
                    c.SetCoefficient(v, 1.0)
                objective.SetCoefficient(u, self.problem.change_j[b])

    def at(self, bound_s: float | None, gap_limit: float | None = None) -> Relaxed | None:
        """Solve within ``bound_s``; None when no mix meets the bound.

        The plan is rounded as the module says; it is improved by a dive when it is more
        than ``gap_limit`` (a fraction of its energy) above the bound, if one is given.
        """
        self._t.SetUb(self._loose_ms if bound_s is None else bound_s * _MS)
        first = self._solve(warm=self._solved)
        self._solved = True
        if first is None:
            return None
        bound_j, weights, profile_weights = first
        bound_j *= 1 - BOUND_TOLERANCE
        # Each group runs its heaviest profile (ties: the first name, for determinism).
        heaviest = {g: _heaviest(w) for g, w in profile_weights.items()}
        for g, ys in self._y.items():
            for p, v in ys.items():
                v.SetBounds(float(p == heaviest[g]), float(p == heaviest[g]))
        try:
            rounded = weights
            if not all(max(w.values()) > 1 - _WHOLE for w in profile_weights.values()):
                second = self._solve(warm=True)
                if second is None:
                    return Relaxed(bound_j, None)
                rounded = second[1]
            allowed = [
                [o for o in self.options[i.key] if o.profile == heaviest[i.group]]
                for i in self.it.instructions
            ]
            choices = self._rounded(rounded, allowed, bound_s)
            if gap_limit is not None:
                energy = self._energy(choices)
                if energy - bound_j > gap_limit * energy:
                    dived = self._dive(rounded, heaviest, allowed, bound_s)
                    dived_j = None if dived is None else self._energy(dived)
                    _log.debug(
                        "dive within %s: rounded %.1f J, dived %s (bound %.1f J; modelled)",
                        "any time" if bound_s is None else f"{bound_s:.6f} s",
                        energy,
                        "no plan" if dived_j is None else f"{dived_j:.1f} J",
                        bound_j,
                    )
                    if dived is not None and dived_j is not None and dived_j < energy:
                        choices = dived
        finally:
            for ys in self._y.values():
                for v in ys.values():
                    v.SetBounds(0.0, 1.0)
        return Relaxed(bound_j, tuple(choices))

    def _rounded(
        self,
        weights: Sequence[Sequence[tuple[Option, float]]],
        allowed: Sequence[Sequence[Option]],
        bound_s: float | None,
    ) -> list[Option]:
        """Each instruction at the fastest option it mixes, then slowed into the slack."""
        choices = [
            min((o for o, w in row if w > _WHOLE), key=lambda o: (o.time_s, o.dynamic_energy_j))
            for row in weights
        ]
        within = bound_s
        if within is None:
            within = makespan(self.it, [c.time_s for c in choices])
        recover_slack(self.it, choices, allowed, within)
        return choices

    def _dive(
        self,
        weights: list[list[tuple[Option, float]]],
        heaviest: Mapping[tuple[int, str], str],
        allowed: Sequence[Sequence[Option]],
        bound_s: float | None,
    ) -> list[Option] | None:
        """Return the plan of a dive from ``weights`` (profiles fixed to ``heaviest``).

        Each round fixes half of the instructions that mix options, the most nearly whole
        first, to their heaviest option (ties: the faster) and solves again; where the bound
        cannot afford that, to the fastest option each mixed, which the last solution shows
        is feasible. Stops when no instruction mixes, or after :data:`DIVE_ROUNDS` rounds.
        Every option fixed is released before returning. None if a solve fails (the
        simplex's tolerances, at a bound met to a hair).
        """
        # Only the options of the fixed profiles can carry weight; the others are skipped.
        rows = [
            [(o, v) for o, v in row if o.profile == heaviest[instr.group]]
            for row, instr in zip(self._x, self.it.instructions, strict=True)
        ]
        fixed: list[int] = []

        def fix(i: int, option: Option) -> None:
            fixed.append(i)
            for o, v in rows[i]:
                v.SetBounds(float(o is option), float(o is option))

        w = [
            [(o, x) for o, x in row if o.profile == heaviest[instr.group]]
            for row, instr in zip(weights, self.it.instructions, strict=True)
        ]
        try:
            rounds = 0
            while rounds < DIVE_ROUNDS:
                rounds += 1
                mixed = [i for i, row in enumerate(w) if _mixes(row)]
                if not mixed:
                    break
                mixed.sort(key=lambda i: (-max(x for _, x in w[i]), i))
                chunk = mixed[: max(1, len(mixed) // 2)]
                for i in chunk:
                    fix(i, min(w[i], key=lambda ox: (-ox[1], ox[0].time_s))[0])
                solved = self._solve(warm=True, rows=rows)
                if solved is None:
                    for i in chunk:
                        fix(i, min((o for o, x in w[i] if x > _WHOLE), key=lambda o: o.time_s))
                    solved = self._solve(warm=True, rows=rows)
                    if solved is None:  # pragma: no cover - the simplex's tolerances
                        return None
                w = solved[1]
            _log.debug("dive: %d rounds, %d instructions fixed", rounds, len(set(fixed)))
            return self._rounded(w, allowed, bound_s)
        finally:
            for i in fixed:
                for _, v in rows[i]:
                    v.SetBounds(0.0, 1.0)

    def _solve(
        self, *, warm: bool, rows: Sequence[Sequence[tuple[Option, Any]]] | None = None
    ) -> tuple[float, list[list[tuple[Option, float]]], dict[Any, dict[str, float]]] | None:
        """Return (optimum in J, option weights per instruction, profile weights per group).

        ``rows``: the option variables to read (default: all of each instruction's).

        ``warm``: the program was solved before (with other bounds): the dual simplex
        resumes from that basis. A fresh program takes the dual simplex too when the caller
        set no time bound (at 2,048 instructions: 23 s; the primal from a triangular basis,
        180 s) and the primal from a triangular basis under one (12 s against the dual's
        44 s at the least time).
        """
        primal = not warm and self._t.ub() < self._loose_ms
        work = DIVE_WORK_LIMIT if rows is not None else WARM_WORK_LIMIT if warm else None
        limit = "" if work is None else f" max_deterministic_time: {work}"
        self._lp.SetSolverSpecificParametersAsString(
            ("initial_basis: TRIANGULAR" if primal else "use_dual_simplex: true") + limit
        )
        status, objective = self._lp.Solve(), math.nan
        if rows is not None and status not in (self._optimal, self._infeasible):
            _log.debug(
                "relaxation: a dive's solve ended with GLOP status %s; dive abandoned", status
            )
            return None  # the dive keeps the plan it had
        if status not in (self._optimal, self._infeasible):  # abnormal, or stopped by work
            status, objective = self._solve_afresh(status)
        elif status == self._optimal:  # reading it otherwise logs "No solution exists"
            objective = self._lp.Objective().Value()
        if status == self._infeasible:
            return None
        if status != self._optimal:  # pragma: no cover - a bounded feasible LP
            raise KareusError(f"the composition's relaxation ended with GLOP status {status}")
        weights = [[(o, v.solution_value()) for o, v in row] for row in rows or self._x]
        profile_weights = {
            g: {p: v.solution_value() for p, v in ys.items()} for g, ys in self._y.items()
        }
        return objective, weights, profile_weights

    def _solve_afresh(self, status: int) -> tuple[int, float]:
        """Solve a copy of the program from scratch; it becomes the program solved from here.

        ``status`` is how the solve from the current basis ended. GLOP's dual simplex can
        end ABNORMAL (seen on a 113-variable program of a tiny model, from its basis and
        from none alike); the primal simplex solves the same program, or without presolve
        (:data:`AFRESH_PARAMETERS`). It can also stall from a basis (stopped by
        :data:`WARM_WORK_LIMIT`). Either way the old basis is dropped: the copy, with the
        basis of its solution, replaces the program, so the next warm solve resumes from
        there.
        """
        from ortools.linear_solver import linear_solver_pb2

        _log.debug("relaxation: GLOP ended with status %s; solving a fresh copy", status)
        model = linear_solver_pb2.MPModelProto()
        self._lp.ExportModelToProto(model)
        status, fresh = solve_afresh(model)
        # the same variables, in the same order, in the copy
        v = fresh.variables()
        self._t = v[self._t.index()]
        self._y = {g: {p: v[x.index()] for p, x in ys.items()} for g, ys in self._y.items()}
        self._x = [[(o, v[x.index()]) for o, x in row] for row in self._x]
        self._lp = fresh
        if status != self._optimal:
            return status, math.nan
        return status, fresh.Objective().Value()


AFRESH_PARAMETERS = ("", "use_preprocessing: false")
"""GLOP's settings for a fresh solve, tried in turn while it ends ABNORMAL: its defaults (the
primal simplex), then without presolve. Presolve itself can end ABNORMAL: on a replay of
measured CPU profiles (a tiny 16-layer model, TP 2, full recompute) both simplexes did,
and without presolve the same program is proven infeasible."""


def solve_afresh(model: Any) -> tuple[int, Any]:
    """Solve an exported linear program (``MPModelProto``) with GLOP from scratch.

    Returns the status and the solver (its solution loaded where the status is optimal).
    """
    from ortools.linear_solver import pywraplp

    status, fresh = pywraplp.Solver.ABNORMAL, None
    for params in AFRESH_PARAMETERS:
        fresh = pywraplp.Solver.CreateSolver("GLOP")
        fresh.LoadModelFromProto(model)
        fresh.SetSolverSpecificParametersAsString(params)
        status = fresh.Solve()
        if status != pywraplp.Solver.ABNORMAL:
            break
    return status, fresh


DIVE_WORK_LIMIT = 10.0
"""GLOP's deterministic work limit for each solve of a dive (its deterministic time units,
roughly seconds of one core): a limit of work, not of wall-clock time, so that plans never
depend on machine load. A dive's solve starts from the basis of the solve before it, one
bound tighter, and normally takes a fraction of a second; but the warm dual simplex can
stall on a degenerate program (a dive on the traced Llama 3.3 70B PP 8 x 16 ran for more
than 10 minutes under a trial cost model whose matmul costs depended on their shapes). A
dive whose solve reaches the limit, or ends any other way but optimal or infeasible, is
abandoned: the rounded plan stays, with its proven gap."""


WARM_WORK_LIMIT = 10.0
"""GLOP's deterministic work limit for a solve that resumes from the basis of an earlier one
(its deterministic time units, roughly seconds of one core), past which the program is
solved afresh (:meth:`Relaxation._solve_afresh`). Resuming normally takes a fraction of a
second, but the dual simplex can stall from a basis: on the traced Llama 3.2 3B TP 8 x PP 2,
micro-batch 8, seq 8192 with full recompute, a solve after a dive had not ended after 8
minutes (the matrix of ``benchmarks/compare.py`` had that workload unfinished after 117);
with this limit, and the copy solved afresh, the whole A100 plan takes 16 s. A limit of
work, not of wall-clock time: the plan never depends on machine load."""


def _hull(options: Sequence[Option], *, per_clock: bool) -> list[Option]:
    """Return the options a relaxation needs: the lower hull, or each clock's.

    Where clock changes cost, a mix of hull options at several clocks may change clock where
    the option it stands for would not, so only options of one clock stand for each other.
    """
    if not per_clock:
        return lower_hull(options)
    clocks = sorted({o.freq_mhz for o in options})
    out = [o for f in clocks for o in lower_hull([o for o in options if o.freq_mhz == f])]
    return sorted(out, key=lambda o: (o.time_s, o.dynamic_energy_j))


def _mixes(row: Sequence[tuple[Option, float]]) -> bool:
    return any(_WHOLE < x < 1 - _WHOLE for _, x in row)


def _heaviest(weights: Mapping[str, float]) -> str:
    return min(weights, key=lambda p: (-round(weights[p], 9), p))


def recover_slack(
    iteration: Iteration,
    choices: list[Option],
    allowed: Sequence[Sequence[Option]],
    bound_s: float,
    static_per_s: float = 0.0,
) -> None:
    """Slow down, in place, instructions into the slack the rounded plan leaves.

    ``static_per_s``: what a second more of the iteration costs, in the options' energy
    (static power of all GPUs over those that run an instruction); a step that lengthens
    the iteration is taken only where it saves more than that. Zero: any step that fits.

    Rounding runs a mixed instruction at its fastest option; where the plan then leaves an
    instruction slack (its latest finish within ``bound_s`` minus its earliest finish), it
    moves to a slower option of its profile that fits, best move first: the one saving most
    energy per second of slack it uses (on a convex ladder, the next option down). Slowing
    one never gives another more slack, so a move that does not fit now never will; one
    that fits at a lower rate than it was queued at is queued again.
    (On Llama 3.3 70B shapes, PP 8 x 16 at DP 4 with FSDP2, passes over every instruction in
    topological order, a step each, left 10 of 40 solves more than 0.5 % above their bounds,
    the worst 0.62 %; best first, 2 of 36, the worst 0.49 %: ``python benchmarks/planner.py
    --scale 8x16 --dp 4 --dp-mode fsdp``.)
    """
    n = len(choices)
    position = {i: k for k, i in enumerate(topology(iteration)[0])}
    # each move updates only the heads and tails it reaches, not the whole DAG's
    timing = Timing(iteration, [c.time_s for c in choices])

    def move(i: int) -> tuple[float, Option | None]:
        """Return the best rate (J/s) of a slower option of ``i`` that fits, and that option."""
        here, room = choices[i], timing.slack(i, bound_s)
        spare = room - (bound_s - timing.makespan())  # what it may take within the plan's time
        best: tuple[float, Option | None] = (0.0, None)
        for o in allowed[i]:
            longer = o.time_s - here.time_s
            saving = here.dynamic_energy_j - o.dynamic_energy_j
            if longer <= 0 or saving <= 0 or longer > room:
                continue
            if static_per_s > 0:  # what the iteration lengthens by costs static power
                saving -= static_per_s * max(0.0, longer - spare)
                if saving <= 0:
                    continue
            rate = saving / longer
            if rate > best[0]:
                best = (rate, o)
        return best

    # (a move's rate is positive: it saves energy)
    queue = [(-rate, position[i], i) for i, (rate, _o) in enumerate(map(move, range(n))) if rate]
    heapq.heapify(queue)
    while queue:
        queued, _k, i = heapq.heappop(queue)
        rate, step = move(i)
        if step is None:
            continue  # nothing fits it now: nothing will
        if rate < -queued * (1 - 1e-12):  # less than it was queued at: queue it again
            heapq.heappush(queue, (-rate, position[i], i))
            continue
        choices[i] = step
        timing.set(i, step.time_s)
        rate, step = move(i)
        if step is not None:
            heapq.heappush(queue, (-rate, position[i], i))

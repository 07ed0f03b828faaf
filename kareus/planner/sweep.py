"""The iteration's frontier: sweep the time bound, then prove each point.

:meth:`Composer.frontier <kareus.planner.compose.Composer.frontier>` runs it: from the
least-energy plan to the fastest, each solve warm-started from the best plan known to meet
its bound, then every point of the front given the best lower bound any solve proved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kareus.planner.pareto import TIME_RESOLUTION_S, meets, pareto_front
from kareus.planner.problem import Solution, Solves

REFINE_GAP = 0.005
"""A frontier point whose proven gap exceeds this fraction of its energy (or the solver's gap
limit, if larger) is solved again at its own time (once)."""


def best_within(bound: float | None, known: Sequence[Solution]) -> Solution | None:
    """Return the least-energy plan of ``known`` that meets ``bound`` (any, when None)."""
    fits = [s for s in known if meets(s.time_s, bound)]
    return min(fits, key=lambda s: (s.energy_j, s.time_s), default=None)


def _time_energy(s: Solution) -> tuple[float, float]:
    return s.time_s, s.energy_j


def sweep_frontier(c: Solves, points: int = 8, anchors: Sequence[float] = ()) -> list[Solution]:
    """Sweep the time bound from the fastest plan to the least-energy plan.

    ``anchors`` are further time bounds to solve at (the times other plans are compared
    at, such as a baseline's fastest time), so that those comparisons read a solved
    point instead of the nearest point of the sweep.

    Each solve is warm-started from the best plan known to meet its bound (the fastest
    plan, or a uniform-clock plan), and the uniform-clock plans join the candidates: a
    solve stopped by its work limit can return no worse than they are, so no point of
    the frontier is ever above a uniform-clock plan. Each point's ``bound_j`` is the
    best proven lower bound on the energy of any plan as fast as it (from every solve of
    the sweep, kept in :attr:`solves`); the gap between the two is what the limited
    search may have left.
    """
    uniform = c.uniform_plans()
    c.restart()

    # From slow to fast: the least-energy plan, then each bound a little tighter than
    # the last, which the relaxation's dual simplex resumes from cheaply (a jump from
    # one end of the frontier to the other costs it about as much as a fresh start).
    # The least time is known before any solve (every instruction's fastest option).
    greedy = c.fastest_choice()
    frugal = c.solve(hint=best_within(None, [greedy, *uniform]))
    known = [frugal, *uniform]
    lo, hi = greedy.time_s, frugal.time_s
    sweep = [lo + (hi - lo) * k / (points - 1) + 1e-6 for k in range(1, points - 1)]
    sweep += [a + 1e-6 for a in anchors if lo < a < hi]
    for bound in sorted(sweep, reverse=True):
        hint = best_within(bound, [*known, greedy])
        known.append(c.solve(bound_s=bound, hint=hint))
    # The fastest point: the least energy within the resolution of the least time (at
    # the exact least time, every instruction on the critical path has to keep its
    # fastest option, profile included, where a plan 0.2 us slower can be 3 % cheaper).
    start = min([greedy, *uniform], key=lambda s: (s.time_s, s.energy_j))
    fastest = lo + TIME_RESOLUTION_S
    known.append(c.solve(minimise="time", hint=best_within(fastest, [*known, start])))
    return prove(c, known)


def prove(c: Solves, candidates: Sequence[Solution]) -> list[Solution]:
    """Return the front of ``candidates``, each point with its proven lower bound.

    A point between two time bounds already solved (a uniform-clock plan, or another
    method's plan on a subset of these options) is covered only by the next slower bound:
    it is solved once at its own time, so that it is either improved or proven; then
    every point gets the best bound of all solves so far (:attr:`solves`). A point kept
    beside a plan a hair slower (by the model's rounding of times to microseconds) but
    much cheaper keeps its large gap: the report shows it rather than hiding the point
    (it may be the one an iso-time comparison needs).
    """
    known = list(candidates)
    front = pareto_front(known, key=_time_energy, time_resolution=TIME_RESOLUTION_S)
    loose = max(REFINE_GAP, c.gap_limit)
    for p, proven in zip(front, lower_bounds(front, c.solves), strict=True):
        # (a point a solve at its own time, give or take the sweep's microsecond, left
        # loose is where that solve stopped: solving it again would find the same)
        at_own_time = any(
            s.within_s is not None and p.time_s - 1e-9 <= s.within_s <= p.time_s + 2e-6
            for s in c.solves
        )
        if not at_own_time and (proven is None or p.energy_j - proven > loose * p.energy_j):
            known.append(c.solve(bound_s=p.time_s + 1e-6, hint=p))
    front = pareto_front(known, key=_time_energy, time_resolution=TIME_RESOLUTION_S)
    bounds = lower_bounds(front, c.solves)
    return [
        dataclasses.replace(p, within_s=p.time_s, bound_j=b)
        for p, b in zip(front, bounds, strict=True)
    ]


def lower_bounds(points: Sequence[Solution], solves: Sequence[Solution]) -> list[float | None]:
    """Return, per point, the best proven lower bound on the energy at its time or less.

    A solve within ``B`` proves a bound for every point no slower than ``B``; the tightest
    is that of the solve with the smallest such ``B``. None where no solve covers a point.
    """
    out: list[float | None] = []
    for p in points:
        covering = [
            s.bound_j for s in solves if s.bound_j is not None and meets(p.time_s, s.within_s)
        ]
        out.append(min(max(covering), p.energy_j) if covering else None)
    return out

"""Compose instruction options over the iteration with an OR-Tools CP-SAT model.

An *instruction* is one forward or backward of one micro-batch on one pipeline stage. Its
options are (clock, decision profile): the profile fixes a launch slot and SM share per
partition type and is shared by every instruction of that stage and direction (they run the
same compiled graph); the clock is chosen per instruction. The iteration is a DAG — a chain
without pipeline parallelism, synchronous 1F1B with it. CP-SAT picks one option per
instruction, minimising

    Σ dynamic energy of the chosen options + P_static · N_gpus · T

subject to precedence and T ≤ bound; sweeping the bound traces the iteration frontier.
Each solve first solves the model's linear relaxation (:mod:`kareus.planner.relax`, or as
a min-cost flow past ``flow_min_instructions``: :mod:`kareus.planner.flow`): its optimum
is a proven lower bound and its rounding a plan within the bound; CP-SAT (times in
integer microseconds, energies in integer microjoules) searches only where the two are
further apart than the gap limit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence

from kareus.errors import KareusError
from kareus.planner.cp_sat import CpSatSearch
from kareus.planner.dag import Option, change_energy, group_profiles, switches
from kareus.planner.flow import FlowRelaxation
from kareus.planner.mip import MipSearch
from kareus.planner.pareto import TIME_RESOLUTION_S, meets
from kareus.planner.problem import Problem, Solution, SolveKnobs
from kareus.planner.relax import Relaxation, Relaxed
from kareus.planner.sweep import lower_bounds, prove, sweep_frontier
from kareus.planner.switch_pay import pay_for_switches

__all__ = ["Composer", "Problem", "Solution", "SolveKnobs", "brute_force"]

_log = logging.getLogger(__name__)


def _undominated(options: Sequence[Option]) -> tuple[Option, ...]:
    """Return ``options`` without those another option of the same profile dominates."""
    keep = []
    for o in options:
        beaten = any(
            p.profile == o.profile
            and p.time_s <= o.time_s
            and p.dynamic_energy_j <= o.dynamic_energy_j
            and (p.time_s, p.dynamic_energy_j) != (o.time_s, o.dynamic_energy_j)
            for p in options
        )
        if not beaten:
            keep.append(o)
    # Of exact duplicates within a profile, the first stays.
    seen: set[tuple[str, float, float]] = set()
    out = []
    for o in keep:
        key = (o.profile, o.time_s, o.dynamic_energy_j)
        if key not in seen:
            seen.add(key)
            out.append(o)
    return tuple(out)


def _better(prior: Solution, hint: Solution | None, bound_s: float | None) -> Solution:
    """Return ``prior`` (an earlier solve at ``bound_s``), or ``hint`` if it is better."""
    if hint is None or not meets(hint.time_s, bound_s):
        return prior
    if (hint.energy_j, hint.time_s) >= (prior.energy_j, prior.time_s):
        return prior
    bound_j = None if prior.bound_j is None else min(prior.bound_j, hint.energy_j)
    return dataclasses.replace(hint, status="HINT", within_s=bound_s, bound_j=bound_j)


class Composer:
    """Builds and solves the CP-SAT model for one iteration and its options.

    Args:
        problem: the iteration, its options and what a plan is priced on (its
            ``change_j`` is left out: the composer prices clock changes by ``knobs.switch``).
        knobs: how hard each solve works (:class:`~kareus.planner.problem.SolveKnobs`;
            None: its defaults).
    """

    def __init__(self, problem: Problem, knobs: SolveKnobs | None = None) -> None:
        knobs = knobs or SolveKnobs()
        it = problem.iteration
        for instr in it.instructions:
            if not problem.options.get(instr.key):
                raise KareusError(f"no options for stage {instr.stage} {instr.key[1]}")
        switch = knobs.switch if knobs.switch is not None and knobs.switch.time_s > 0 else None
        self.knobs = dataclasses.replace(knobs, switch=switch)
        # the energy of a clock change before each instruction, on all GPUs of its stage
        # (empty when changes are free)
        change_j = tuple(
            change_energy(switch, problem.options[i.key], problem.static_power_w)
            * problem.gpus_per_stage
            for i in (it.instructions if switch is not None else ())
        )
        self.problem = dataclasses.replace(problem, change_j=change_j)
        self.it = it
        self.options = self.problem.options
        # An option dominated within its profile can only tie, unless clock changes cost
        # something: at its neighbours' clock it saves one (CP-SAT and the simplex price
        # changes and keep them all then; the flow leaves changes out).
        undominated = {g: _undominated(o) for g, o in self.options.items()}
        self.model_options = undominated
        self._search = (
            dataclasses.replace(self.problem, options=undominated)
            if switch is None
            else self.problem
        )
        self.solves: list[Solution] = []  # every solve since the last frontier() began
        self.searches = 0  # of which a search went further (the relaxation had not proven them)
        self.branch_searches = 0  # of those, by SCIP's branch and bound (the rest by CP-SAT)
        self._relaxation: Relaxation | None = None  # built at its first solve, then kept
        self._flow: FlowRelaxation | None = None  # likewise
        self._memo: dict[float | None, Solution] = {}  # each bound's solution, since frontier()

    @property
    def gap_limit(self) -> float:
        """The fraction of its energy a solve's plan is proven within before it stops."""
        return self.knobs.gap_limit

    def restart(self) -> None:
        """Forget the solves so far (a new frontier begins)."""
        self.solves = []
        self.searches = 0
        self.branch_searches = 0
        self._memo = {}

    def option(self, key: tuple[int, str], profile: str, freq_mhz: float) -> Option | None:
        """Return ``key``'s option of ``profile`` at ``freq_mhz`` (None: it has none).

        ``key``: the :attr:`~kareus.planner.dag.Instruction.key` of the instructions.
        """
        return self.problem.option(key, profile, freq_mhz)

    def evaluate(self, choices: Sequence[Option]) -> tuple[float, float]:
        """Return (iteration time, energy of all GPUs) of one choice per instruction."""
        return self.problem.cost(choices)

    def switches(self, choices: Sequence[Option]) -> int:
        """Return the clock changes one iteration of ``choices`` makes, on all GPUs."""
        return len(switches(self.it, choices))

    def solve(
        self,
        *,
        bound_s: float | None = None,
        minimise: str = "energy",
        hint: Solution | None = None,
    ) -> Solution:
        """Solve for least energy under ``bound_s``; with ``minimise="time"``, least time first.

        The least time is exact without a search (every instruction's fastest option is
        feasible together and no choice finishes sooner), so a least-time solve is the
        least-energy solve bounded by it, to the composer's resolution
        (:data:`TIME_RESOLUTION_S` more). The linear relaxation (:mod:`kareus.planner.relax`)
        gives a proven lower bound and a rounded plan (improved by a dive when rounding
        leaves it outside the gap limit); when that plan, or ``hint`` (an earlier solution)
        if better, is proven within the gap limit, that is the answer; so is it, with its
        gap, in an iteration of more than ``search_max_instructions``. Otherwise CP-SAT
        searches from it, within its deterministic work limit, and the better of the two
        bounds is kept. A bound solved before since :meth:`frontier` began returns that
        solve's answer (or ``hint``, if better) without solving again.

        Raises:
            KareusError: no plan meets the bound.
        """
        if minimise == "time":
            bound_s = self.fastest_choice().time_s + TIME_RESOLUTION_S
        elif minimise != "energy":
            raise KareusError(f"minimise must be 'energy' or 'time', got {minimise!r}")
        prior = self._memo.get(bound_s)
        if prior is not None:  # solved at this bound already (a point proved twice)
            return _better(prior, hint, bound_s)
        relaxed = self._relax(bound_s)
        fits = hint is not None and meets(hint.time_s, bound_s)
        if relaxed is None:
            if fits:  # the relaxation's tolerances, at a bound the hint meets to a hair
                assert hint is not None
                found = dataclasses.replace(hint, status="HINT", within_s=bound_s, bound_j=None)
                return self._record(found)
            fastest = self.fastest_choice().time_s
            raise KareusError(
                f"no plan runs within {bound_s:.6f} s: the fastest takes {fastest:.6f} s"
            )
        known = [] if relaxed.choices is None else [self._solution(relaxed.choices, "RELAXED")]
        # (the rounded plan meets the bound up to the simplex's tolerances: checked anyway)
        known = [k for k in known if meets(k.time_s, bound_s)]
        known += [hint] if fits and hint is not None else []
        best = min(known, key=lambda s: (s.energy_j, s.time_s), default=None)
        _log.debug(
            "relaxation within %s: bound %.1f J, best plan %s",
            "any time" if bound_s is None else f"{bound_s:.6f} s",
            relaxed.bound_j,
            "none" if best is None else f"{best.energy_j:.1f} J ({best.status})",
        )
        proven = (
            best is not None and best.energy_j - relaxed.bound_j <= self.gap_limit * best.energy_j
        )
        most = self.knobs.search_max_instructions
        too_large = most is not None and len(self.it.instructions) > most
        if best is not None and (proven or too_large):
            found = dataclasses.replace(
                best, within_s=bound_s, bound_j=min(relaxed.bound_j, best.energy_j)
            )
            return self._record(found)
        branch = self.knobs.branch_max_instructions
        if branch is not None and len(self.it.instructions) <= branch:
            return self._branch(bound_s, best, relaxed.bound_j)
        return self._cp_sat(bound_s, best, relaxed.bound_j)

    def _branch(self, bound_s: float | None, hint: Solution | None, proven_j: float) -> Solution:
        """Search with SCIP's branch and bound from ``hint``; ``proven_j`` is proven already.

        See :mod:`kareus.planner.mip`. Its plan is priced here again (the model's times are
        exact to SCIP's tolerances, so a plan past ``bound_s`` by a hair is left out).
        """
        self.searches += 1
        self.branch_searches += 1
        status, choices, bound_j = MipSearch(self._search, self.knobs).run(bound_s, hint)
        proven = proven_j if bound_j is None else max(proven_j, bound_j)
        found = None if choices is None else self._solution(choices, status)
        if found is not None and not meets(found.time_s, bound_s):
            found = None
        if found is None and hint is None:
            within = f"within {bound_s:.6f} s " if bound_s is not None else ""
            raise KareusError(
                f"SCIP found no plan {within}within its node limit (status {status}); "
                "raise PlannerSettings.solver_time_limit_s"
            )
        return self._keep(found, hint, bound_s, proven)

    def _keep(
        self, found: Solution | None, hint: Solution | None, bound_s: float | None, proven_j: float
    ) -> Solution:
        """Record the better of a search's plan and its hint (one of them given).

        ``proven_j`` is the bound proven at ``bound_s``; the hint is kept where the search
        stopped short of it.
        """
        if hint is not None and (
            found is None or (hint.energy_j, hint.time_s) < (found.energy_j, found.time_s)
        ):
            found = dataclasses.replace(hint, status="HINT")
        assert found is not None
        bound_j = min(proven_j, found.energy_j)
        return self._record(dataclasses.replace(found, within_s=bound_s, bound_j=bound_j))

    def _relax(self, bound_s: float | None) -> Relaxed | None:
        """Return the relaxation's bound and plan within ``bound_s`` (None: no plan fits).

        Past ``flow_min_instructions`` the flow solves it; where the flow's plan is not
        proven within the gap limit and the iteration is small enough to dive, the simplex
        dives too, and the better bound and plan are kept.
        """
        n = len(self.it.instructions)
        most, least = self.knobs.dive_max_instructions, self.knobs.flow_min_instructions
        dives = most is None or n <= most
        flows = least is not None and n >= least
        first: Relaxed | None = None
        if flows:
            if self._flow is None:  # (the flow leaves clock changes out)
                free = dataclasses.replace(self.problem, options=self.model_options, change_j=())
                self._flow = FlowRelaxation(free)
            first = self._flow.at(bound_s, self.gap_limit)
            if first is None or not dives or self._proven(first):
                return first
        if self._relaxation is None:
            self._relaxation = Relaxation(self._search)
        second = self._relaxation.at(bound_s, self.gap_limit if dives else None)
        if first is None or second is None:
            return second
        plans = [r.choices for r in (first, second) if r.choices is not None]
        best = min(plans, key=lambda c: self.evaluate(c)[::-1], default=None)
        return Relaxed(max(first.bound_j, second.bound_j), best)

    def _proven(self, relaxed: Relaxed) -> bool:
        if relaxed.choices is None:
            return False
        energy = self.evaluate(relaxed.choices)[1]
        return energy - relaxed.bound_j <= self.gap_limit * energy

    def _record(self, found: Solution) -> Solution:
        found = pay_for_switches(self.problem, found)
        self.solves.append(found)
        self._memo[found.within_s] = found
        return found

    def _solution(self, choices: Sequence[Option], status: str) -> Solution:
        time_s, energy_j = self.evaluate(choices)
        return Solution(tuple(choices), time_s, energy_j, status)

    def _cp_sat(self, bound_s: float | None, hint: Solution | None, proven_j: float) -> Solution:
        """Search with CP-SAT from ``hint``; ``proven_j`` is a lower bound already proven.

        The model's times are whole microseconds rounded down, its bound too, so every plan
        within ``bound_s`` is within the model's and CP-SAT's objective bound is a bound on
        them all (less its rounding of energies to microjoules). A plan CP-SAT finds may run
        over ``bound_s`` by that rounding: unless the hint is proven within the gap limit,
        CP-SAT then searches once more with times rounded up, where every plan it finds
        meets the bound (and its bound proves nothing).
        """
        self.searches += 1
        search = CpSatSearch(self._search, self.knobs)
        opts = [self._search.options[i.key] for i in self.it.instructions]
        bound_us = None if bound_s is None else math.floor(bound_s * 1e6)
        # each energy term of the objective is rounded to the nearest microjoule
        rounding_j = 0.5e-6 * (len(opts) + len(self.it.switch_pairs()))
        proven, found = proven_j, None
        for attempt, rounded in enumerate((math.floor, math.ceil)):
            us = [[rounded(o.time_s * 1e6) for o in row] for row in opts]
            status, choices, objective_bound = search.run(opts, us, bound_us, hint)
            if attempt == 0 and objective_bound is not None:
                proven = max(proven, objective_bound / 1e6 - rounding_j)
            if choices is not None:
                found = self._solution(choices, status)
                if meets(found.time_s, bound_s):
                    break
                found = None
            if hint is not None and hint.energy_j - proven <= self.gap_limit * hint.energy_j:
                break  # the hint is proven good enough: no second search
        if found is None and hint is None:
            within = f"within {bound_s:.6f} s " if bound_s is not None else ""
            limit = self.knobs.time_limit_s * max(1.0, len(self.it.instructions) / 64)
            raise KareusError(
                f"CP-SAT found no plan {within}within its work limit ({limit:.1f} "
                "deterministic units; raise PlannerSettings.solver_time_limit_s) "
                f"(status {status})"
            )
        if found is not None:
            _log.debug(
                "CP-SAT's plan %.1f J, from %s (modelled)",
                found.energy_j,
                "no hint" if hint is None else f"{hint.energy_j:.1f} J",
            )
        # (out of work before CP-SAT found a plan: the hint is still a valid plan; OPTIMAL
        # means within gap_limit, not exact)
        return self._keep(found, hint, bound_s, proven)

    def fastest_choice(self) -> Solution:
        """Every instruction's fastest option (least energy among equals): a feasible start."""
        choices = tuple(
            min(self.options[i.key], key=lambda o: (o.time_s, o.dynamic_energy_j))
            for i in self.it.instructions
        )
        time_s, energy_j = self.evaluate(choices)
        return Solution(choices, time_s, energy_j, "GREEDY")

    def uniform_plans(self) -> list[Solution]:
        """Every plan that runs all instructions at one clock with one profile name.

        The simple plans a user could pick by hand (one locked clock for the job, one
        overlap setting); the frontier is built never to lose to any of them.
        """
        keys = sorted({i.key for i in self.it.instructions})
        by_key = {g: {(o.freq_mhz, o.profile): o for o in self.options[g]} for g in keys}
        common = set.intersection(*(set(k) for k in by_key.values()))
        out = []
        for key in sorted(common):
            choices = tuple(by_key[i.key][key] for i in self.it.instructions)
            time_s, energy_j = self.evaluate(choices)
            out.append(Solution(choices, time_s, energy_j, "UNIFORM"))
        return out

    def frontier(self, points: int = 8, anchors: Sequence[float] = ()) -> list[Solution]:
        """Sweep the time bound from the fastest plan to the least-energy plan.

        See :func:`kareus.planner.sweep.sweep_frontier`; ``anchors`` are further bounds.
        """
        return sweep_frontier(self, points, anchors)

    def prove(self, candidates: Sequence[Solution]) -> list[Solution]:
        """Return the front of ``candidates``, each with its proven lower bound.

        See :func:`kareus.planner.sweep.prove`.
        """
        return prove(self, candidates)

    @staticmethod
    def lower_bounds(points: Sequence[Solution], solves: Sequence[Solution]) -> list[float | None]:
        """Return per point the best proven lower bound at its time or less.

        See :func:`kareus.planner.sweep.lower_bounds`.
        """
        return lower_bounds(points, solves)


def brute_force(c: Composer, bound_s: float | None = None) -> tuple[float, float] | None:
    """Return the least (energy, time) under ``bound_s`` by enumeration (small instances).

    The tests' oracle for the composer's solves.
    """
    best: tuple[float, float] | None = None
    profiles = group_profiles(c.it, c.options)
    groups = sorted(profiles)
    for combo in itertools.product(*(profiles[g] for g in groups)):
        chosen = dict(zip(groups, combo, strict=True))
        per_instr = [
            [o for o in c.options[i.key] if o.profile == chosen[i.group]] for i in c.it.instructions
        ]
        for choices in itertools.product(*per_instr):
            t, e = c.evaluate(choices)
            if not meets(t, bound_s):
                continue
            if best is None or (e, t) < best:
                best = (e, t)
    return best

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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kareus.errors import KareusError
from kareus.planner.dag import (
    Iteration,
    Option,
    SwitchCost,
    Timing,
    change_energy,
    group_profiles,
    makespan,
    plan_cost,
    switches,
)
from kareus.planner.pareto import TIME_RESOLUTION_S, pareto_front

if TYPE_CHECKING:
    from kareus.planner.flow import FlowRelaxation
    from kareus.planner.relax import Relaxation, Relaxed

_log = logging.getLogger(__name__)

WALL_CLOCK_GUARD_S = 600.0
"""A wall-clock stop for one solve, far beyond its deterministic limit: it only guards
against a hung machine (a solve it stops reports it in its status)."""


REFINE_GAP = 0.005
"""A frontier point whose proven gap exceeds this fraction of its energy (or the solver's gap
limit, if larger) is solved again at its own time (once)."""


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


BOUND_SLACK_S = 1e-9
"""How far past a time bound a plan still meets it: the float noise of summed durations.
(Tighter than :func:`kareus.planner.pareto.no_slower`, which compares plans with the
model's precision; a bound is met exactly, up to rounding.)"""


def meets(time_s: float, bound_s: float | None) -> bool:
    """Whether ``time_s`` meets the time bound ``bound_s`` (None: no bound)."""
    return bound_s is None or time_s <= bound_s + BOUND_SLACK_S


def _time_energy(s: Solution) -> tuple[float, float]:
    return s.time_s, s.energy_j


def best_within(bound: float | None, known: Sequence[Solution]) -> Solution | None:
    """Return the least-energy plan of ``known`` that meets ``bound`` (any, when None)."""
    fits = [s for s in known if meets(s.time_s, bound)]
    return min(fits, key=lambda s: (s.energy_j, s.time_s), default=None)


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


class Composer:
    """Builds and solves the CP-SAT model for one iteration and its options.

    Args:
        iteration: the DAG.
        options: per group (stage, kind), the options of its instructions.
        static_power_w: static power of one GPU.
        gpus: GPUs the iteration runs on (all stages, all tensor-parallel ranks).
        gpus_per_stage: GPUs that run each instruction (tensor-parallel ranks).
        time_limit_s: CP-SAT deterministic work limit per solve, per 64 instructions of the
            iteration (deterministic time units: the result never depends on machine load).
        workers: CP-SAT search workers, interleaved in one thread when more than one.
        gap_limit: a solve stops once its plan is proven within this fraction of the least
            energy (deterministic: the proof, not the clock, decides).
        search_max_instructions: CP-SAT searches only iterations of at most this many
            instructions (None: any); a larger one keeps the relaxation's plan and reports
            its gap, proven or not.
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

    def __init__(
        self,
        iteration: Iteration,
        options: Mapping[tuple[int, str], Sequence[Option]],
        *,
        static_power_w: float,
        gpus: int,
        gpus_per_stage: int = 1,
        time_limit_s: float = 10.0,
        workers: int = 1,
        seed: int = 0,
        gap_limit: float = 0.0,
        search_max_instructions: int | None = None,
        dive_max_instructions: int | None = None,
        flow_min_instructions: int | None = None,
        switch: SwitchCost | None = None,
    ) -> None:
        self.it = iteration
        self.options = {g: tuple(o) for g, o in options.items()}
        for instr in iteration.instructions:
            if not self.options.get(instr.key):
                raise KareusError(f"no options for stage {instr.stage} {instr.key[1]}")
        # Without clock changes, each option dominated within its profile (another is no
        # slower and no more energy-hungry) is dropped: it can only tie. CP-SAT and the
        # simplex's relaxation price changes, and a dominated option at the clock of its
        # neighbours saves one, so they keep them all when changes cost anything (the flow,
        # which leaves changes out, never needs them).
        self.model_options = {g: _undominated(o) for g, o in self.options.items()}
        self.switch = switch if switch is not None and switch.time_s > 0 else None
        self.search_options = self.model_options if self.switch is None else self.options
        self.static_w = static_power_w
        self.gpus = gpus
        self.per_stage = gpus_per_stage
        self.time_limit_s = time_limit_s
        self.workers = workers
        self.seed = seed
        self.gap_limit = gap_limit
        self.search_max_instructions = search_max_instructions
        self.dive_max_instructions = dive_max_instructions
        self.flow_min_instructions = flow_min_instructions
        self.solves: list[Solution] = []  # every solve since the last frontier() began
        self.searches = 0  # of which CP-SAT searched (the relaxation had not proven them)
        self._relaxation: Relaxation | None = None  # built at its first solve, then kept
        self._flow: FlowRelaxation | None = None  # likewise
        self._memo: dict[float | None, Solution] = {}  # each bound's solution, since frontier()
        # the energy of a clock change before each instruction, on all GPUs of its stage
        # (empty when changes are free)
        self._change_j = [
            change_energy(self.switch, self.options[i.key], static_power_w) * gpus_per_stage
            for i in (iteration.instructions if self.switch is not None else ())
        ]
        self._by_clock = {
            g: {(o.profile, o.freq_mhz): o for o in opts} for g, opts in self.options.items()
        }

    def option(self, key: tuple[int, str], profile: str, freq_mhz: float) -> Option | None:
        """Return ``key``'s option of ``profile`` at ``freq_mhz`` (None: it has none).

        ``key``: the :attr:`~kareus.planner.dag.Instruction.key` of the instructions.
        """
        return self._by_clock[key].get((profile, freq_mhz))

    def evaluate(self, choices: Sequence[Option]) -> tuple[float, float]:
        """Return (iteration time, energy of all GPUs) of one choice per instruction."""
        return plan_cost(
            self.it,
            choices,
            static_power_w=self.static_w,
            gpus=self.gpus,
            gpus_per_stage=self.per_stage,
            change_j=self._change_j,
        )

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
            return self._better(prior, hint, bound_s)
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
        too_large = (
            self.search_max_instructions is not None
            and len(self.it.instructions) > self.search_max_instructions
        )
        if best is not None and (proven or too_large):
            found = dataclasses.replace(
                best, within_s=bound_s, bound_j=min(relaxed.bound_j, best.energy_j)
            )
            return self._record(found)
        return self._cp_sat(bound_s, best, relaxed.bound_j)

    def _relax(self, bound_s: float | None) -> Relaxed | None:
        """Return the relaxation's bound and plan within ``bound_s`` (None: no plan fits).

        Past ``flow_min_instructions`` the flow solves it; where the flow's plan is not
        proven within the gap limit and the iteration is small enough to dive, the simplex
        dives too, and the better bound and plan are kept.
        """
        from kareus.planner.flow import FlowRelaxation
        from kareus.planner.relax import Relaxation, Relaxed

        n = len(self.it.instructions)
        dives = self.dive_max_instructions is None or n <= self.dive_max_instructions
        flows = self.flow_min_instructions is not None and n >= self.flow_min_instructions
        kw: dict[str, Any] = {
            "static_power_w": self.static_w,
            "gpus": self.gpus,
            "gpus_per_stage": self.per_stage,
        }
        first: Relaxed | None = None
        if flows:
            if self._flow is None:
                self._flow = FlowRelaxation(self.it, self.model_options, **kw)
            first = self._flow.at(bound_s, self.gap_limit)
            if first is None or not dives or self._proven(first):
                return first
        if self._relaxation is None:
            self._relaxation = Relaxation(
                self.it, self.search_options, change_j=self._change_j, **kw
            )
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
        found = self._pay_for_switches(found)
        self.solves.append(found)
        self._memo[found.within_s] = found
        return found

    @staticmethod
    def _better(prior: Solution, hint: Solution | None, bound_s: float | None) -> Solution:
        """Return ``prior`` (an earlier solve at ``bound_s``), or ``hint`` if it is better."""
        if hint is None or not meets(hint.time_s, bound_s):
            return prior
        if (hint.energy_j, hint.time_s) >= (prior.energy_j, prior.time_s):
            return prior
        bound_j = None if prior.bound_j is None else min(prior.bound_j, hint.energy_j)
        return dataclasses.replace(hint, status="HINT", within_s=bound_s, bound_j=bound_j)

    def _pay_for_switches(self, found: Solution) -> Solution:
        """Undo each clock change whose saving does not pay for it (greedy, to a fixpoint).

        At each change, the instruction after it takes the clock before it, or the one
        before takes the clock after it (the same profile at that clock); a move is kept
        when it lowers the energy and keeps the bound.
        """
        if self.switch is None:
            return found
        choices = list(found.choices)
        best = (found.energy_j, found.time_s)
        pairs = self.it.switch_pairs()
        around: dict[int, list[tuple[int, int]]] = {}  # the changes an instruction touches
        for a, b in pairs:
            around.setdefault(a, []).append((a, b))
            around.setdefault(b, []).append((a, b))
        within = found.within_s
        # A move changes one instruction: its slack prices most moves without a walk of the
        # DAG (a slower option lengthens only the paths through it; a faster one off every
        # longest path changes nothing), and the timing follows a kept move, or one priced
        # in full, only as far as it reaches.
        timing = Timing(self.it, [c.time_s for c in choices])
        changed = True
        while changed:
            changed = False
            for a, b in pairs:
                if choices[a].freq_mhz == choices[b].freq_mhz:
                    continue
                for i, j in ((b, a), (a, b)):
                    key = self.it.instructions[i].key
                    alt = self.option(key, choices[i].profile, choices[j].freq_mhz)
                    if alt is None:
                        continue
                    margin = 1e-9 * abs(best[0])
                    priced = self._trial(choices, i, alt, around[i], best, timing)
                    if priced is None or not self._pays(priced, best, within, margin):
                        continue  # refused (a near-tie is not worth a change)
                    timing.set(i, alt.time_s)
                    t = timing.makespan()  # the guess's time, to the float sums' order
                    priced = self._moved(choices, i, alt, around[i], best, 0.0, new_time_s=t)
                    if priced is not None and self._pays(priced, best, within, margin):
                        choices[i] = alt
                        best, changed = (priced[1], t), True
                        break
                    timing.set(i, choices[i].time_s)
        if best == (found.energy_j, found.time_s):
            return found
        time_s, energy_j = self.evaluate(choices)  # summed afresh, as every plan is
        return dataclasses.replace(found, choices=tuple(choices), energy_j=energy_j, time_s=time_s)

    def _trial(
        self,
        choices: Sequence[Option],
        i: int,
        alt: Option,
        pairs: Sequence[tuple[int, int]],
        now: tuple[float, float],
        timing: Timing,
    ) -> tuple[float, float] | None:
        """Return (time, energy) of the plan with ``alt`` at ``i``; None if surely worse."""
        room = timing.slack(i, now[1])
        known_s = None
        if alt.time_s < choices[i].time_s and room <= 1e-12 and not timing.sole(i, now[1]):
            known_s = now[1]  # another longest path avoids ``i``: the time stays
        guess = self._moved(choices, i, alt, pairs, now, room, new_time_s=known_s)
        if guess is not None:
            return guess if guess[1] <= now[0] else None
        # ``i`` is on every longest path and runs faster: the new time needs the DAG
        durations = list(timing.durations)
        durations[i] = alt.time_s
        return self._moved(
            choices, i, alt, pairs, now, room, new_time_s=makespan(self.it, durations)
        )

    @staticmethod
    def _pays(
        priced: tuple[float, float], now: tuple[float, float], within: float | None, margin: float
    ) -> bool:
        t, e = priced
        return e < now[0] - margin and meets(t, within)

    def _moved(
        self,
        choices: Sequence[Option],
        i: int,
        alt: Option,
        pairs: Sequence[tuple[int, int]],
        now: tuple[float, float],
        room: float,
        *,
        new_time_s: float | None = None,
    ) -> tuple[float, float] | None:
        """Return (time, energy) of the plan with ``alt`` at ``i``, from the plan's ``now``.

        ``room``: ``i``'s slack within the plan's time. Exact up to the order of float sums,
        except where the move shortens a longest path (the new time needs the DAG):
        there the energy of the shortest time the move could reach, which refuses a move
        surely (returned) or leaves it to the full price (None). ``new_time_s``: the new
        time, when known (then exact).
        """
        old = choices[i]
        longer = alt.time_s - old.time_s
        shortens = new_time_s is None and longer < 0 and room <= 1e-12  # in [T + longer, T]
        t = now[1] + max(0.0, longer - room) if longer > 0 else now[1]
        t = t if new_time_s is None else new_time_s
        e = now[0] + (alt.dynamic_energy_j - old.dynamic_energy_j) * self.per_stage
        e += self.static_w * self.gpus * ((t - now[1]) if not shortens else longer)
        for a, b in pairs:
            before = choices[a].freq_mhz != choices[b].freq_mhz
            fa = alt.freq_mhz if a == i else choices[a].freq_mhz
            fb = alt.freq_mhz if b == i else choices[b].freq_mhz
            e += self._change_j[b] * ((fa != fb) - before)
        if shortens:  # e is a lower bound: enough to refuse, not to accept
            return None if e <= now[0] + 1e-9 * abs(now[0]) else (t, e)
        return t, e

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
        opts = [self.search_options[i.key] for i in self.it.instructions]
        bound_us = None if bound_s is None else math.floor(bound_s * 1e6)
        # each energy term of the objective is rounded to the nearest microjoule
        rounding_j = 0.5e-6 * (len(opts) + len(self.it.switch_pairs()))
        proven, found = proven_j, None
        for attempt, rounded in enumerate((math.floor, math.ceil)):
            us = [[rounded(o.time_s * 1e6) for o in row] for row in opts]
            status, choices, objective_bound = self._cp_sat_search(opts, us, bound_us, hint)
            if attempt == 0 and objective_bound is not None:
                proven = max(proven, objective_bound / 1e6 - rounding_j)
            if choices is not None:
                found = self._solution(choices, status)
                if meets(found.time_s, bound_s):
                    break
                found = None
            if hint is not None and hint.energy_j - proven <= self.gap_limit * hint.energy_j:
                break  # the hint is proven good enough: no second search
        if found is None:
            if hint is not None:
                # Out of work before CP-SAT found a plan: the hint is still a valid plan.
                found = dataclasses.replace(
                    hint, status="HINT", within_s=bound_s, bound_j=min(proven, hint.energy_j)
                )
                return self._record(found)
            within = f"within {bound_s:.6f} s " if bound_s is not None else ""
            limit = self.time_limit_s * max(1.0, len(self.it.instructions) / 64)
            raise KareusError(
                f"CP-SAT found no plan {within}within its work limit ({limit:.1f} "
                "deterministic units; raise PlannerSettings.solver_time_limit_s) "
                f"(status {status})"
            )
        _log.debug(
            "CP-SAT's plan %.1f J, from %s (modelled)",
            found.energy_j,
            "no hint" if hint is None else f"{hint.energy_j:.1f} J",
        )
        if hint is not None and (hint.energy_j, hint.time_s) < (found.energy_j, found.time_s):
            found = dataclasses.replace(hint, status="HINT")  # the search stopped short of it
        # OPTIMAL means within gap_limit, not exact
        found = dataclasses.replace(found, within_s=bound_s, bound_j=min(proven, found.energy_j))
        return self._record(found)

    def _cp_sat_search(
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

        m, x = self._cp_sat_model(opts, us, bound_us)
        if hint is not None:
            for i in range(len(opts)):
                for k, o in enumerate(opts[i]):
                    m.add_hint(x[i][k], o == hint.choices[i])
        solver = cp_model.CpSolver()
        # Deterministic: the search is interleaved in one thread and stopped by CP-SAT's
        # deterministic work count, not by the wall clock, so the same inputs give the same
        # plan on any machine under any load. Larger iterations get proportionally more
        # work: the limit is per 64 instructions.
        solver.parameters.num_workers = self.workers
        solver.parameters.interleave_search = self.workers > 1
        solver.parameters.random_seed = self.seed
        solver.parameters.relative_gap_limit = self.gap_limit
        limit = self.time_limit_s * max(1.0, len(self.it.instructions) / 64)
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

    def _cp_sat_model(
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
        profiles = group_profiles(self.it, self.search_options)
        groups = sorted(profiles)
        y = {g: {p: m.new_bool_var(f"y{g}_{p}") for p in profiles[g]} for g in groups}
        for g in groups:
            m.add_exactly_one(y[g].values())
        start, end = [], []
        switch_uj = self._switch_terms(m, x, opts)
        for i, instr in enumerate(self.it.instructions):
            m.add_exactly_one(x[i])
            for k, opt in enumerate(opts[i]):
                m.add_implication(x[i][k], y[instr.group][opt.profile])
            s = m.new_int_var(0, horizon, f"s{i}")
            e = m.new_int_var(0, horizon, f"e{i}")
            m.add(e == s + sum(d * v for d, v in zip(us[i], x[i], strict=True)))
            start.append(s)
            end.append(e)
        for a, b in self.it.edges:
            m.add(end[a] <= start[b])
        t = m.new_int_var(0, horizon, "T")
        for e in end:
            m.add(t >= e)
        if bound_us is not None:
            m.add(t <= bound_us)
        dyn = sum(
            round(o.dynamic_energy_j * 1e6 * self.per_stage) * x[i][k]
            for i in range(len(opts))
            for k, o in enumerate(opts[i])
        )
        static_w = math.floor(self.static_w * self.gpus)  # W x us = uJ (down: a bound stays one)
        m.minimize(dyn + switch_uj + static_w * t)
        return m, x

    def _switch_terms(self, m: Any, x: list[list[Any]], opts: Sequence[Sequence[Option]]) -> Any:
        """Add the clock changes to CP-SAT's model; return their energy (uJ).

        A change before instruction b (its predecessor on the GPU runs another clock) costs
        b's :func:`~kareus.planner.dag.change_energy` on all its GPUs.
        """
        if self.switch is None:
            return 0
        clocks = [
            sum(round(o.freq_mhz) * v for o, v in zip(opts[i], x[i], strict=True))
            for i in range(len(opts))
        ]
        top = max(round(o.freq_mhz) for row in opts for o in row)
        energy: Any = 0
        for a, b in self.it.switch_pairs():
            w = m.new_bool_var(f"w{a}_{b}")
            m.add(clocks[a] - clocks[b] <= top * w)
            m.add(clocks[b] - clocks[a] <= top * w)
            energy += round(self._change_j[b] * 1e6) * w
        return energy

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
        uniform = self.uniform_plans()
        self.solves = []
        self.searches = 0
        self._memo = {}

        # From slow to fast: the least-energy plan, then each bound a little tighter than
        # the last, which the relaxation's dual simplex resumes from cheaply (a jump from
        # one end of the frontier to the other costs it about as much as a fresh start).
        # The least time is known before any solve (every instruction's fastest option).
        greedy = self.fastest_choice()
        frugal = self.solve(hint=best_within(None, [greedy, *uniform]))
        known = [frugal, *uniform]
        lo, hi = greedy.time_s, frugal.time_s
        sweep = [lo + (hi - lo) * k / (points - 1) + 1e-6 for k in range(1, points - 1)]
        sweep += [a + 1e-6 for a in anchors if lo < a < hi]
        for bound in sorted(sweep, reverse=True):
            hint = best_within(bound, [*known, greedy])
            known.append(self.solve(bound_s=bound, hint=hint))
        # The fastest point: the least energy within the resolution of the least time (at
        # the exact least time, every instruction on the critical path has to keep its
        # fastest option, profile included, where a plan 0.2 us slower can be 3 % cheaper).
        start = min([greedy, *uniform], key=lambda s: (s.time_s, s.energy_j))
        fastest = lo + TIME_RESOLUTION_S
        known.append(self.solve(minimise="time", hint=best_within(fastest, [*known, start])))
        return self.prove(known)

    def prove(self, candidates: Sequence[Solution]) -> list[Solution]:
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
        loose = max(REFINE_GAP, self.gap_limit)
        for p, proven in zip(front, self.lower_bounds(front, self.solves), strict=True):
            # (a point a solve at its own time, give or take the sweep's microsecond, left
            # loose is where that solve stopped: solving it again would find the same)
            at_own_time = any(
                s.within_s is not None and p.time_s - 1e-9 <= s.within_s <= p.time_s + 2e-6
                for s in self.solves
            )
            if not at_own_time and (proven is None or p.energy_j - proven > loose * p.energy_j):
                known.append(self.solve(bound_s=p.time_s + 1e-6, hint=p))
        front = pareto_front(known, key=_time_energy, time_resolution=TIME_RESOLUTION_S)
        bounds = self.lower_bounds(front, self.solves)
        return [
            dataclasses.replace(p, within_s=p.time_s, bound_j=b)
            for p, b in zip(front, bounds, strict=True)
        ]

    @staticmethod
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

    def brute_force(self, bound_s: float | None = None) -> tuple[float, float] | None:
        """Least (energy, time) under ``bound_s`` by enumeration (small instances only)."""
        best: tuple[float, float] | None = None
        profiles = group_profiles(self.it, self.options)
        groups = sorted(profiles)
        for combo in itertools.product(*(profiles[g] for g in groups)):
            chosen = dict(zip(groups, combo, strict=True))
            per_instr = [
                [o for o in self.options[i.key] if o.profile == chosen[i.group]]
                for i in self.it.instructions
            ]
            for choices in itertools.product(*per_instr):
                t, e = self.evaluate(choices)
                if not meets(t, bound_s):
                    continue
                if best is None or (e, t) < best:
                    best = (e, t)
        return best

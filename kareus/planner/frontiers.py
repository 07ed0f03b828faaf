"""Every method's frontier, composed side by side, and kareus's proven against the others.

kareus's frontier is proven against the baselines' plans on the split graphs (each is a kareus
plan too) and, given the original graphs, against Perseus's plans that leave them whole: a
plan never loses to the simpler plan of not splitting at all.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kareus.planner.compose import Composer
from kareus.planner.instruction_options import ORIGINAL
from kareus.planner.pareto import TIME_RESOLUTION_S, pareto_front
from kareus.planner.problem import Solution
from kareus.planner.settings import PlannerSettings
from kareus.planner.sweep import REFINE_GAP, best_within

METHODS = ("megatron", "perseus", "nanobatch+perseus", "kareus")


def compose_frontiers(
    comps: dict[str, Composer],
    settings: PlannerSettings,
    deadline_s: float | None,
    note: Callable[[str], Any],
    *,
    with_originals: bool,
) -> dict[str, list[Solution]]:
    """Compose every method's frontier; kareus's is proven against the baselines' plans."""
    # kareus is also solved at each baseline's fastest time (every instruction at its
    # fastest option: known without a solve) and at the policy's deadline, the times it is
    # compared and selected at.
    anchors = [comps[m].fastest_choice().time_s for m in METHODS if m != "kareus"]
    anchors += [deadline_s] if deadline_s is not None else []

    # Where no block splits and no collective overlaps, kareus's options are Perseus's under
    # other names: its frontier is Perseus's, composed once (at kareus's anchors).
    alike = with_originals and priced_alike(comps["kareus"], comps["perseus"])

    def compose(method: str) -> list[Solution]:
        comp = comps[method]
        if method == "megatron":
            return [comp.solve(minimise="time")]
        mine = method == "kareus" or (alike and method == "perseus")
        return comp.frontier(settings.sweep_points, anchors if mine else ())

    def baselines() -> dict[str, list[Solution]]:
        # a baseline priced as one composed before it has its frontier (as nanobatch+perseus
        # where nothing splits: Perseus's)
        out: dict[str, list[Solution]] = {}
        for m in METHODS[:-1]:
            twin = next((d for d in out if _frontier_twins(comps, m, d)), None)
            out[m] = list(out[twin]) if twin is not None else compose(m)
        return out

    if alike:
        note("composing the baselines (kareus's options are Perseus's: nothing splits)")
        frontiers = baselines()
        return {**frontiers, "kareus": list(frontiers["perseus"])}

    # The baselines are composed in a second thread while kareus is composed in this one:
    # the linear solver releases the GIL, and no composer reads another's results, so the
    # plan is the same as one thread's (at PP 16 x 64 this saves the baselines' ~25 s).
    note("composing kareus (the baselines alongside)")
    frontiers = _alongside(baselines, lambda: compose("kareus"))
    note("proving kareus's frontier against the baselines")

    # Every baseline plan on the split graphs is also a kareus plan (its options are a
    # subset of kareus's): a point kareus's solves missed (CP-SAT stopped at its work limit)
    # must not make kareus look worse.
    # Its lower bounds are those kareus's own solves proved (a baseline's hold for its
    # options only); a baseline point left on it between kareus's bounds is solved at its
    # time by kareus's composer, so that it is improved or proven.
    split = [s for sols in frontiers.values() for s in sols if s.choices[0].profile != ORIGINAL]
    frontiers["kareus"] = comps["kareus"].prove(split)
    if with_originals:
        # A Perseus plan leaves the graphs unsplit; where no split plan beats it, it is
        # kareus's plan too (on a tie the simpler plan stays), proven by either bound.
        frontiers["kareus"] = with_unsplit(
            frontiers["kareus"], frontiers["perseus"], comps["kareus"], comps["perseus"]
        )
    return frontiers


def _frontier_twins(comps: dict[str, Composer], a: str, b: str) -> bool:
    """Whether methods ``a`` and ``b`` compose one frontier (Megatron's is one point)."""
    return "megatron" not in (a, b) and priced_alike(comps[a], comps[b])


def priced_alike(a: Composer, b: Composer) -> bool:
    """Whether two composers solve one problem.

    The same iteration, and options alike in all but their profiles' names: the same clocks,
    times and energies (two profiles priced the same, as a split graph's blocks left whole
    and the original's, count once).
    """
    if a.it is not b.it or a.options.keys() != b.options.keys():
        return False
    return all(
        {(o.freq_mhz, o.time_s, o.dynamic_energy_j) for o in a.options[g]}
        == {(o.freq_mhz, o.time_s, o.dynamic_energy_j) for o in b.options[g]}
        for g in a.options
    )


def _alongside(
    baselines: Callable[[], dict[str, list[Solution]]], kareus: Callable[[], list[Solution]]
) -> dict[str, list[Solution]]:
    """Run ``baselines`` in a daemon thread and ``kareus`` in this one; return both.

    The thread is a daemon so that an interrupt need not wait for it. What either raised is
    raised here, this thread's first; the baselines' frontiers come first in the result.
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["baselines"] = baselines()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="kareus-baselines", daemon=True)
    thread.start()
    mine = kareus()
    thread.join()
    if "error" in out:
        raise out["error"]
    return {**out["baselines"], "kareus": mine}


UNSPLIT_REFINE_ROUNDS = 4
"""Rounds of solving interleaved split and unsplit points at their own times (a solve's
plan can itself land between the other composer's bounds)."""


def with_unsplit(
    split: Sequence[Solution], unsplit: Sequence[Solution], mine: Composer, theirs: Composer
) -> list[Solution]:
    """Return the front of both frontiers, each point with the lower of both proven bounds.

    A split point's bound holds for split plans only; the least energy of any plan within
    its time is the lower of that and what the Perseus solves proved for unsplit plans
    (none is faster than Perseus's fastest: no bound is needed below it). Unsplit points
    come first, so that of two equal points the one that does not split stays. Where the
    two frontiers interleave, a point's time falls between the other composer's swept
    bounds, whose proof there is loose: a point left outside the refine gap is solved at
    its own time by each composer whose bound is loose there (once per composer and time),
    and what those solves find joins the front, for up to :data:`UNSPLIT_REFINE_ROUNDS`
    rounds (a solve's plan can itself land between the other composer's bounds).
    """
    known_split, known_unsplit = list(split), list(unsplit)
    # (no plan of a family is faster than its least time: no bound is needed below it)
    fastest_split = mine.fastest_choice().time_s
    fastest_unsplit = theirs.fastest_choice().time_s if unsplit else float("inf")

    def bounds(p: Solution) -> tuple[float | None, float | None]:
        ours = Composer.lower_bounds([p], mine.solves)[0]
        other = Composer.lower_bounds([p], theirs.solves)[0]
        return (
            float("inf") if p.time_s < fastest_split else ours,
            float("inf") if p.time_s < fastest_unsplit else other,
        )

    def front() -> list[Solution]:
        return pareto_front(
            [*known_unsplit, *known_split],
            key=lambda s: (s.time_s, s.energy_j),
            time_resolution=TIME_RESOLUTION_S,
        )

    def solved_at(comp: Composer, at: float) -> bool:
        return any(s.within_s is not None and abs(s.within_s - at) < 1e-9 for s in comp.solves)

    for _round in range(UNSPLIT_REFINE_ROUNDS):
        solved = False
        for p in front():
            ours, other = bounds(p)
            if ours is None or other is None:
                continue
            loose = max(REFINE_GAP, mine.gap_limit) * p.energy_j
            if p.energy_j - min(ours, other) <= loose:
                continue
            at = p.time_s + 1e-6
            split_loose = p.energy_j - ours > loose and p.time_s >= fastest_split
            if split_loose and not solved_at(mine, at):
                known_split.append(mine.solve(bound_s=at, hint=best_within(at, known_split)))
                solved = True
            unsplit_loose = p.energy_j - other > loose and p.time_s >= fastest_unsplit
            if unsplit_loose and not solved_at(theirs, at):
                hint = best_within(at, known_unsplit)
                known_unsplit.append(theirs.solve(bound_s=at, hint=hint))
                solved = True
        if not solved:
            break
    out = []
    for p in front():
        ours, other = bounds(p)
        bound = None if ours is None or other is None else min(ours, other)
        out.append(dataclasses.replace(p, within_s=p.time_s, bound_j=bound))
    return out

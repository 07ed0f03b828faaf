"""Undo the clock changes of a composed plan whose saving does not pay for them.

A greedy pass to a fixpoint over each solve's plan (:class:`kareus.planner.compose.Composer`
runs it on every solution it records): at each change, one side takes the other's clock
when that lowers the energy and keeps the time bound. Moves are priced from the instruction's
slack without walking the DAG where they can be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kareus.planner.dag import Option, Timing, makespan
from kareus.planner.pareto import meets
from kareus.planner.problem import Problem, Solution


def pay_for_switches(c: Problem, found: Solution) -> Solution:
    """Undo each clock change whose saving does not pay for it (greedy, to a fixpoint).

    At each change, the instruction after it takes the clock before it, or the one
    before takes the clock after it (the same profile at that clock); a move is kept
    when it lowers the energy and keeps the bound.
    """
    if not c.change_j:  # changes are free
        return found
    choices = list(found.choices)
    best = (found.energy_j, found.time_s)
    pairs = c.iteration.switch_pairs()
    around: dict[int, list[tuple[int, int]]] = {}  # the changes an instruction touches
    for a, b in pairs:
        around.setdefault(a, []).append((a, b))
        around.setdefault(b, []).append((a, b))
    within = found.within_s
    # A move changes one instruction: its slack prices most moves without a walk of the
    # DAG (a slower option lengthens only the paths through it; a faster one off every
    # longest path changes nothing), and the timing follows a kept move, or one priced
    # in full, only as far as it reaches.
    timing = Timing(c.iteration, [c.time_s for c in choices])
    changed = True
    while changed:
        changed = False
        for a, b in pairs:
            if choices[a].freq_mhz == choices[b].freq_mhz:
                continue
            for i, j in ((b, a), (a, b)):
                key = c.iteration.instructions[i].key
                alt = c.option(key, choices[i].profile, choices[j].freq_mhz)
                if alt is None:
                    continue
                margin = 1e-9 * abs(best[0])
                priced = _trial(c, choices, i, alt, around[i], best, timing)
                if priced is None or not _pays(priced, best, within, margin):
                    continue  # refused (a near-tie is not worth a change)
                timing.set(i, alt.time_s)
                t = timing.makespan()  # the guess's time, to the float sums' order
                priced = _moved(c, choices, i, alt, around[i], best, 0.0, new_time_s=t)
                if priced is not None and _pays(priced, best, within, margin):
                    choices[i] = alt
                    best, changed = (priced[1], t), True
                    break
                timing.set(i, choices[i].time_s)
    if best == (found.energy_j, found.time_s):
        return found
    time_s, energy_j = c.cost(choices)  # summed afresh, as every plan is
    return dataclasses.replace(found, choices=tuple(choices), energy_j=energy_j, time_s=time_s)


def _trial(
    c: Problem,
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
    guess = _moved(c, choices, i, alt, pairs, now, room, new_time_s=known_s)
    if guess is not None:
        return guess if guess[1] <= now[0] else None
    # ``i`` is on every longest path and runs faster: the new time needs the DAG
    durations = list(timing.durations)
    durations[i] = alt.time_s
    return _moved(c, choices, i, alt, pairs, now, room, new_time_s=makespan(c.iteration, durations))


def _pays(
    priced: tuple[float, float], now: tuple[float, float], within: float | None, margin: float
) -> bool:
    t, e = priced
    return e < now[0] - margin and meets(t, within)


def _moved(
    c: Problem,
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
    e = now[0] + (alt.dynamic_energy_j - old.dynamic_energy_j) * c.gpus_per_stage
    e += c.static_power_w * c.gpus * ((t - now[1]) if not shortens else longer)
    for a, b in pairs:
        before = choices[a].freq_mhz != choices[b].freq_mhz
        fa = alt.freq_mhz if a == i else choices[a].freq_mhz
        fb = alt.freq_mhz if b == i else choices[b].freq_mhz
        e += c.change_j[b] * ((fa != fb) - before)
    if shortens:  # e is a lower bound: enough to refuse, not to accept
        return None if e <= now[0] + 1e-9 * abs(now[0]) else (t, e)
    return t, e

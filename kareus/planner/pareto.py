"""Pareto fronts and hypervolume of (time, energy) points, both minimised."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

TIME_TOLERANCE = 1e-4
"""Relative slack of "no slower than": the composer rounds times to microseconds per
instruction, so equal plans may differ by a few microseconds."""

TIME_RESOLUTION_S = 1e-6
"""The composer's unit of time (CP-SAT's, and the sweep's offset): plans whose iteration
times differ by less are equally fast, so a frontier keeps the cheaper (its fastest point is
the least-time solve's plan, the least energy within this of the least time, or a cheaper
one at most this much slower) and "no slower than" allows it too."""


BOUND_SLACK_S = 1e-9
"""How far past a time bound a plan still meets it: the float noise of summed durations.
(Tighter than :func:`no_slower`, which compares plans with the model's precision; a bound is
met exactly, up to rounding.)"""


def meets(time_s: float, bound_s: float | None) -> bool:
    """Whether ``time_s`` meets the time bound ``bound_s`` (None: no bound)."""
    return bound_s is None or time_s <= bound_s + BOUND_SLACK_S


def no_slower(time_s: float, limit_s: float) -> bool:
    """Whether ``time_s`` is no slower than ``limit_s``, to the model's precision."""
    return time_s <= limit_s * (1 + TIME_TOLERANCE) + TIME_RESOLUTION_S


def pareto_front(
    items: Iterable[T], key: Callable[[T], tuple[float, float]], time_resolution: float = 0.0
) -> list[T]:
    """Return the items no other item beats in both time and energy, fastest first.

    Of items with equal (time, energy) the first is kept. Times less than
    ``time_resolution`` apart count as equal: from the slowest point of the front on, a point
    at most that much faster than the last point kept is dropped for it (which uses less
    energy): a plan a fraction of a microsecond faster at a few percent more energy is not a
    trade-off the model can tell from rounding. Points kept are more than the resolution
    apart, and the fastest is within it of the fastest item.
    """
    ordered = sorted(items, key=key)
    front: list[T] = []
    best_energy = float("inf")
    for item in ordered:
        _t, e = key(item)
        if e < best_energy:
            front.append(item)
            best_energy = e
    kept: list[T] = []
    for item in reversed(front):  # slowest first; each kept point is cheaper than the faster
        if not kept or key(kept[-1])[0] - key(item)[0] > time_resolution:
            kept.append(item)
    return kept[::-1]


def hypervolume(points: Sequence[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Return the area dominated by ``points`` and bounded by ``reference`` (worse in both).

    Points that do not beat the reference in both coordinates add nothing.
    """
    rt, re = reference
    front = pareto_front([p for p in points if p[0] < rt and p[1] < re], key=lambda p: p)
    area = 0.0
    for i, (t, e) in enumerate(front):
        t_next = front[i + 1][0] if i + 1 < len(front) else rt
        area += (t_next - t) * (re - e)
    return area


def hypervolume_share(
    reference_points: Sequence[tuple[float, float]], points: Sequence[tuple[float, float]]
) -> float:
    """Return the share of the reference set's hypervolume that ``points`` reach.

    The reference point is 5 % worse than the reference set's worst time and energy.
    """
    ref = (max(p[0] for p in reference_points) * 1.05, max(p[1] for p in reference_points) * 1.05)
    return hypervolume(points, ref) / hypervolume(reference_points, ref)


def is_monotone(front: Sequence[tuple[float, float]]) -> bool:
    """Return whether time rises and energy falls strictly along ``front``."""
    return all(a[0] < b[0] and a[1] > b[1] for a, b in itertools.pairwise(front))


def iso_time_energy_reduction(
    frontier: Sequence[tuple[float, float]], baseline: Sequence[tuple[float, float]]
) -> float | None:
    """Energy saved at the baseline's best time, as a fraction of the baseline's energy there.

    Least energy among ``frontier`` points no slower than the baseline's fastest point
    (:func:`no_slower`), against that fastest point's energy. None when no point is that fast.
    """
    t0, e0 = min(baseline)
    ok = [e for t, e in frontier if no_slower(t, t0)]
    return (e0 - min(ok)) / e0 if ok else None


def iso_energy_time_reduction(
    frontier: Sequence[tuple[float, float]], baseline: Sequence[tuple[float, float]]
) -> float | None:
    """Time saved at the baseline's least energy, as a fraction of the baseline's time there.

    Shortest time among ``frontier`` points using no more energy than the baseline's
    least-energy point, against that point's time. None when no point is that frugal.
    """
    e0, t0 = min((e, t) for t, e in baseline)
    ok = [t for t, e in frontier if e <= e0 * (1 + 1e-9)]
    return (t0 - min(ok)) / t0 if ok else None

"""Pick one plan from a frontier by the user's policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from kareus.errors import KareusError
from kareus.planner.pareto import no_slower

POLICIES = ("max_throughput", "iso_time", "energy_budget_j", "deadline_s", "min_energy")


class InfeasiblePlanError(KareusError, ValueError):
    """No plan on the frontier meets the request; the message says what is achievable."""


class _Point(Protocol):
    time_s: float
    energy_j: float


@dataclasses.dataclass(frozen=True)
class Pick:
    """Which frontier point to plan with: a policy and its budget or deadline (:func:`select`)."""

    policy: str = "iso_time"
    energy_budget_j: float | None = None
    deadline_s: float | None = None


def select(
    frontier: Sequence[_Point],
    policy: str,
    *,
    baseline_time_s: float | None = None,
    energy_budget_j: float | None = None,
    deadline_s: float | None = None,
) -> _Point:
    """Return the frontier point the policy asks for.

    Policies: ``max_throughput`` (fastest), ``iso_time`` (least energy no slower than the
    baseline, to the model's precision: :func:`~kareus.planner.pareto.no_slower`),
    ``energy_budget_j`` (fastest within the budget), ``deadline_s`` (least energy within
    the deadline), ``min_energy``.

    Raises:
        InfeasiblePlanError: the budget or deadline cannot be met; says the best achievable.
        ValueError: an unknown policy or a missing parameter.
    """
    if not frontier:
        raise InfeasiblePlanError("the frontier is empty: nothing was planned")
    fastest = min(frontier, key=lambda p: (p.time_s, p.energy_j))
    frugal = min(frontier, key=lambda p: (p.energy_j, p.time_s))
    if policy == "max_throughput":
        return fastest
    if policy == "min_energy":
        return frugal
    if policy == "iso_time":
        if baseline_time_s is None:
            raise ValueError("iso_time needs the baseline's iteration time")
        return _least_energy_within(frontier, baseline_time_s, fastest, "the baseline's time")
    for name, value in (("deadline_s", deadline_s), ("energy_budget_j", energy_budget_j)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if policy == "deadline_s":
        if deadline_s is None:
            raise ValueError("policy deadline_s needs deadline_s=...")
        return _least_energy_within(frontier, deadline_s, fastest, f"the deadline {deadline_s} s")
    if policy == "energy_budget_j":
        if energy_budget_j is None:
            raise ValueError("policy energy_budget_j needs energy_budget_j=...")
        ok = [p for p in frontier if p.energy_j <= energy_budget_j * (1 + 1e-9)]
        if not ok:
            raise InfeasiblePlanError(
                f"no plan uses at most {energy_budget_j:.3f} J per iteration; the least "
                f"achievable is {frugal.energy_j:.3f} J (at {frugal.time_s:.6f} s)"
            )
        return min(ok, key=lambda p: (p.time_s, p.energy_j))
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def _least_energy_within(
    frontier: Sequence[_Point], limit_s: float, fastest: _Point, what: str
) -> _Point:
    ok = [p for p in frontier if no_slower(p.time_s, limit_s)]
    if not ok:
        raise InfeasiblePlanError(
            f"no plan finishes an iteration within {what} ({limit_s:.6f} s); the fastest "
            f"achievable is {fastest.time_s:.6f} s"
        )
    return min(ok, key=lambda p: (p.energy_j, p.time_s))

"""The composition's relaxation solved as a min-cost flow: its bound and plan at scale.

:mod:`kareus.planner.relax` solves the linear relaxation of the composition with a simplex
over every instruction's option weights; at thousands of instructions each solve takes
seconds, and its dive many solves. With each group on one profile, that program is the
classic project time-cost trade-off (Fulkerson 1961), whose dual is a min-cost flow: a
price of time (J per ms) flows along the DAG's paths; an instruction carrying ``phi`` pays,
per millisecond it runs, ``phi``, and runs the option of least ``energy + phi * time`` (a
concave function of ``phi``, broken at the slopes of its lower hull). The flow is a
circulation: a source feeds the first instructions, the last feed a sink, and the sink
returns to the source through an arc free up to the static power of the GPUs (the price
the iteration's time has anyway) and costing the time bound beyond it (each J/ms more than
that price buys a millisecond of the bound). OR-Tools' min-cost flow (integer, exact,
deterministic) solves it in 0.1-2 s at 4,096 instructions.

- **The bound**: Lagrangian duality (:meth:`FlowRelaxation._flow`). Any non-negative
  prices on the precedences prove a lower bound on every plan within the time bound; the
  flow's optimal prices prove the relaxation's optimum, to the integer scaling's rounding.
  Solved with every group free to use any profile's options (the union's hull), they
  prove it within 0.15 % where the relaxation mixes a group's profiles (crossing made-up
  profiles), within 0.003 % on a model's options. The arcs leave out hull vertices that
  lie within :data:`HULL_TOLERANCE` of the segment between their neighbours (the default
  19 clocks nearly double the vertices, and the arcs with them): the prices are then a
  little off the optimum (bounds up to about 0.06 % lower), but the bound is evaluated on
  every option, so it stays a bound.
- **The plan**: each group runs the profile of least cost at those prices, and the flow
  is solved again on those profiles alone. Its node potentials (longest paths in its
  residual network: an optimal schedule of the relaxation) say how long each instruction
  runs; each runs the slowest option that takes no longer, which keeps the plan within the
  bound, and then steps down its ladder into the slack left where a step saves more
  dynamic energy than the static power costs over what it lengthens the iteration.

On Llama 3.3 70B shapes, TP 8 x PP 8 x 64 micro-batches (1,024 instructions), the bounds
agree with the simplex's to 0.003 % and the plans' gaps with the simplex's rounding
(0.02-0.24 %). There is no dive: the composer dives with the simplex where the flow's plan
is not proven and the iteration is small enough (:class:`~kareus.planner.compose.Composer`).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Mapping, Sequence

import numpy as np

from kareus.errors import KareusError
from kareus.planner.dag import Iteration, Option, group_profiles, makespan, slack, topology
from kareus.planner.problem import Problem
from kareus.planner.relax import BOUND_TOLERANCE, Priced, Relaxed, lower_hull, recover_slack

TIME_UNITS_PER_MS = 1_000
"""The flow's costs are times in integer microseconds (the composer's resolution)."""
PRICE_UNITS_PER_J_PER_MS = 1_000_000
"""The flow's capacities are prices of time in integer uJ per ms."""
_UNLIMITED = 10**12  # a capacity no price reaches
HULL_TOLERANCE = 2e-3
"""How close to the segment between its neighbours a hull vertex may lie and be left out of
the flow's arcs (:func:`thin`; relative to its energy). On Llama 3.3 70B shapes at PP 16 x
128 on the 19 default clocks (``python benchmarks/planner.py --scale 16x128``, 2026-12-03,
2 cores) it cut planning from 137 to 106 s, gaps as before (0.38 % at most)."""


class FlowRelaxation(Priced):
    """The relaxation of one composition, solved as a min-cost flow at any time bound.

    Takes the problem :class:`kareus.planner.relax.Relaxation` takes and answers :meth:`at`
    as it does, without a dive; it leaves clock changes out (``problem.change_j`` is not
    read).
    """

    def __init__(self, problem: Problem, hull_tolerance: float = HULL_TOLERANCE) -> None:
        super().__init__(problem)
        iteration, options = problem.iteration, problem.options
        gpus_per_stage = problem.gpus_per_stage
        self._per_stage = gpus_per_stage
        self._static_per_ms = problem.static_power_w * problem.gpus / 1e3  # J per ms of time
        self._thinned = hull_tolerance > 0
        # per group, its instructions by key (:attr:`~kareus.planner.dag.Instruction.key`)
        self._groups: dict[tuple[int, str], dict[tuple[int, str], list[int]]] = {}
        for i, instr in enumerate(iteration.instructions):
            self._groups.setdefault(instr.group, {}).setdefault(instr.key, []).append(i)
        self._profiles = group_profiles(iteration, options)
        # per key, a ladder per profile, and (None) one over every profile's options: a
        # key's hull before any profile is chosen
        self._ladders: dict[tuple[int, str], dict[str | None, _Ladder]] = {}
        for g, keys in self._groups.items():
            for k in keys:
                opts = options[k]
                hulls: dict[str | None, list[Option]] = {
                    p: lower_hull([o for o in opts if o.profile == p]) for p in self._profiles[g]
                }
                hulls[None] = lower_hull(opts)
                self._ladders[k] = {
                    p: _Ladder(h, gpus_per_stage, hull_tolerance) for p, h in hulls.items()
                }
        slowest = [max(o.time_s for o in options[i.key]) for i in iteration.instructions]
        self._loose_s = makespan(iteration, slowest) * (1 + 1e-6)  # "any time"
        self._union: dict[tuple[int, str], str | None] = {g: None for g in self._groups}
        self._least_s = self._fastest(self._union)  # the least time any plan takes
        self._net = _Network(iteration)
        self._wholes: dict[tuple[tuple[int, str], str | None], _Ladder] = {}

    def at(self, bound_s: float | None, gap_limit: float | None = None) -> Relaxed | None:
        """Return the bound and the plan within ``bound_s`` (any time: None); None if none fits.

        Where the plan is more than ``gap_limit`` (a fraction of its energy) above the bound,
        the flow on the picked profiles is solved again on their whole hulls (none of
        their vertices thinned out) and the better plan, and bound, kept: the thinned
        hulls' prices prove nearly as much, but where a hull is nearly straight over many
        clocks its thinned schedule gives an instruction a few distant clocks to mix where
        the whole one spreads the time over those between (on Llama 3.3 70B shapes at PP
        16 x 64 with FSDP2 at DP 4, one Perseus point: 1.47 % above the bound thinned,
        0.48 % whole).
        """
        horizon_s = self._loose_s if bound_s is None else bound_s
        if self._least_s > horizon_s:
            return None
        # Every group on every profile's hull: prices that prove the relaxation's optimum
        # (within 0.15 % where its groups mix profiles); each group then runs the profile
        # of least cost at those prices, and the flow on those gives the plan.
        # (A group of one profile has that profile's hull: one flow does both.)
        flow, bound_j = self._flow(self._union, bound_s)
        out = flow.out
        pick: dict[tuple[int, str], str | None] = {g: self._cheapest(g, out) for g in self._groups}
        if self._fastest(pick) > horizon_s:  # near the least time: the fastest profiles
            pick = {g: self._cheapest(g, out, fastest=True) for g in self._groups}
        if self._fastest(pick) > horizon_s:
            return Relaxed(bound_j * (1 - BOUND_TOLERANCE), None)
        if any(len(self._profiles[g]) > 1 for g in self._groups):
            flow, bound = self._flow(pick, bound_s)
            bound_j = max(bound_j, bound)
        choices = self._plan(flow, pick, bound_s)
        if gap_limit is not None and self._thinned:
            energy = self._energy(choices)
            if energy - bound_j > gap_limit * energy:
                whole, bound = self._flow(pick, bound_s, whole=True)
                bound_j = max(bound_j, bound)
                again = self._plan(whole, pick, bound_s)
                if self._energy(again) < energy:
                    choices = again
        return Relaxed(bound_j * (1 - BOUND_TOLERANCE), tuple(choices))

    def _plan(
        self, flow: _Flow, pick: Mapping[tuple[int, str], str | None], bound_s: float | None
    ) -> list[Option]:
        """Return the plan ``flow``'s schedule rounds to, slowed into the slack it leaves."""
        choices, schedule_s = flow.plan()
        allowed = [
            [o for o in self.options[i.key] if o.profile == pick[i.group]]
            for i in self.it.instructions
        ]
        if bound_s is not None:
            _meet(self.it, choices, allowed, bound_s)
        # Slowed into the slack within the bound where a step saves more dynamic energy than
        # the static power costs over what it lengthens the iteration (a bound that does
        # not bind leaves slack beyond the optimal schedule's time).
        within = bound_s if bound_s is not None else schedule_s
        recover_slack(
            self.it, choices, allowed, within, self._static_per_ms * 1e3 / self._per_stage
        )
        return choices

    def _ladders_of(
        self, pick: Mapping[tuple[int, str], str | None], *, whole: bool = False
    ) -> list[_Ladder]:
        if whole:
            return [self._whole(i.key, pick[i.group]) for i in self.it.instructions]
        return [self._ladders[i.key][pick[i.group]] for i in self.it.instructions]

    def _whole(self, key: tuple[int, str], profile: str | None) -> _Ladder:
        """Return the ladder of ``key``'s ``profile``, every hull vertex an arc (built once)."""
        if (key, profile) not in self._wholes:
            ladder = _Ladder(self._ladders[key][profile].options, self._per_stage, 0.0)
            self._wholes[key, profile] = ladder
        return self._wholes[key, profile]

    def _fastest(self, pick: Mapping[tuple[int, str], str | None]) -> float:
        return makespan(self.it, [lad.options[0].time_s for lad in self._ladders_of(pick)])

    def _flow(
        self,
        pick: Mapping[tuple[int, str], str | None],
        bound_s: float | None,
        *,
        whole: bool = False,
    ) -> tuple[_Flow, float]:
        """Solve the flow on the picked hulls; return it and the bound its prices prove.

        Lagrangian duality: prices ``out[i]`` (J per ms) on what instruction ``i``'s end
        must precede and ``into[i]`` on what its start must follow make ``i`` pay
        ``out[i]`` per ms it runs, and its start earn ``into[i] - out[i]`` per ms it is late
        (starts and the end lie in ``[0, horizon]``). So every plan within the horizon costs
        at least, per group, its profile of least ``sum_i min_k (energy_k + out[i] *
        time_k)``, plus, where prices are unbalanced, the most lateness can earn. Valid for
        any non-negative prices (a bound over every profile, whichever were picked); a
        flow's balance makes the corrections vanish, its optimality the bound tight.
        """
        flow = _Flow(self._net, self._ladders_of(pick, whole=whole), self._static_per_ms, bound_s)
        horizon_ms = (self._loose_s if bound_s is None else bound_s) * 1e3
        unbalanced = float(np.minimum(0.0, flow.out - flow.into).sum())
        bound_j = horizon_ms * (min(0.0, self._static_per_ms - flow.paid) + unbalanced)
        out = flow.out
        for g, profiles in self._profiles.items():
            bound_j += min(self._cost(g, p, out) for p in profiles)
        return flow, bound_j

    def _cheapest(self, group: tuple[int, str], out: np.ndarray, *, fastest: bool = False) -> str:
        """Return the group's profile of least cost at the prices ``out`` (ties: first name).

        ``fastest``: among the profiles that run the group's fastest option.
        """
        ladders = [self._ladders[k] for k in self._groups[group]]

        def runs_fastest(p: str) -> bool:
            return all(lad[p].options[0].time_s <= lad[None].options[0].time_s for lad in ladders)

        profiles = [p for p in self._profiles[group] if not fastest or runs_fastest(p)]
        return min(profiles, key=lambda p: self._cost(group, p, out))

    def _cost(self, group: tuple[int, str], profile: str, out: np.ndarray) -> float:
        """Return the least the group's instructions cost on ``profile``, time priced at ``out``."""
        return sum(
            self._ladders[k][profile].cost(out[idx]) for k, idx in self._groups[group].items()
        )


def thin(hull: Sequence[Option], tolerance: float) -> list[Option]:
    """Return the vertices of ``hull`` (fastest first) the flow's arcs are made from.

    A vertex is left out where the segment between its neighbours kept passes within
    ``tolerance`` of its dynamic energy (relative): its prices change little. The flow's
    prices are then those of a slightly higher hull, but the bound is evaluated on the
    whole one (any prices prove a bound) and the plan picks among all its options, so
    leaving vertices out costs a little tightness, never soundness.
    """
    if tolerance <= 0 or len(hull) <= 2:
        return list(hull)
    kept = [hull[0]]
    for k in range(1, len(hull) - 1):
        a, b, c = kept[-1], hull[k], hull[k + 1]
        share = (b.time_s - a.time_s) / (c.time_s - a.time_s)
        chord = a.dynamic_energy_j + share * (c.dynamic_energy_j - a.dynamic_energy_j)
        if chord - b.dynamic_energy_j > tolerance * b.dynamic_energy_j:
            kept.append(b)
    return [*kept, hull[-1]]


class _Ladder:
    """One hull's options (fastest first), scaled for the flow, and its arcs (slowest first).

    The arcs come from the hull :func:`thin` keeps (``tolerance``); the costs and the plan
    from all of it.
    """

    def __init__(self, hull: Sequence[Option], gpus_per_stage: int, tolerance: float) -> None:
        self.options = list(hull)
        self.times = [math.ceil(o.time_s * 1e3 * TIME_UNITS_PER_MS) for o in hull]
        self._energy = np.asarray([o.dynamic_energy_j * gpus_per_stage for o in hull])
        self._ms = np.asarray([o.time_s * 1e3 for o in hull])
        arcs = thin(hull, tolerance)
        times = [math.ceil(o.time_s * 1e3 * TIME_UNITS_PER_MS) for o in arcs]
        energy = [o.dynamic_energy_j * gpus_per_stage for o in arcs]
        caps, costs = [], []  # of its arcs, slowest option first
        below = 0  # the price (integer) where an option starts to pay
        for k in range(len(arcs) - 1, 0, -1):  # the price where the next faster is as cheap
            per_ms = (energy[k - 1] - energy[k]) * TIME_UNITS_PER_MS
            per_ms /= max(1, times[k] - times[k - 1])
            top = max(below, round(per_ms * PRICE_UNITS_PER_J_PER_MS))
            caps.append(top - below)
            costs.append(-times[k])
            below = top
        self.caps = np.asarray([*caps, _UNLIMITED], dtype=np.int64)
        self.costs = np.asarray([*costs, -times[0]], dtype=np.int64)

    def cost(self, prices: np.ndarray) -> float:
        """Return the sum over ``prices`` of the least ``energy + price * time`` (ms)."""
        return float((self._energy[None, :] + prices[:, None] * self._ms[None, :]).min(1).sum())


class _Network:
    """The arcs every flow of one iteration shares: its precedences, starts and ends.

    Nodes: 0 the source, 1 the sink, ``2 + 2i`` instruction ``i``'s start, ``3 + 2i`` its end.
    """

    def __init__(self, iteration: Iteration) -> None:
        _order, preds, succs = topology(iteration)
        n = len(iteration.instructions)
        edges = np.asarray(iteration.edges, dtype=np.int64).reshape(-1, 2)
        self.n = n
        self.edge_from, self.edge_to = edges[:, 0], edges[:, 1]
        starts = np.asarray([i for i in range(n) if not preds[i]], dtype=np.int64)
        self.ends = np.asarray([i for i in range(n) if not succs[i]], dtype=np.int64)
        self.tail = np.concatenate([3 + 2 * self.edge_from, 0 * starts, 3 + 2 * self.ends])
        self.head = np.concatenate([2 + 2 * self.edge_to, 2 + 2 * starts, 0 * self.ends + 1])
        self.first_end = len(self.edge_from) + len(starts)
        self.iteration = iteration


class _Flow:
    """One min-cost circulation: the prices it leaves, and the plan its potentials give.

    Instruction ``i``'s hull (fastest first) becomes parallel start-to-end arcs, from the
    slowest: the k-th slowest option's arc carries prices between the hull's breaks, at
    cost minus its time (a price pays for the time it buys), the fastest's without limit.
    ``horizon_s`` None: no time bound (the iteration's time is priced by static power only).
    """

    def __init__(
        self,
        net: _Network,
        ladders: Sequence[_Ladder],
        static_per_ms: float,
        horizon_s: float | None,
    ) -> None:
        from ortools.graph.python import min_cost_flow

        self.ladders = ladders
        counts = [len(ladder.caps) for ladder in ladders]
        segment_tail = np.repeat(2 + 2 * np.arange(net.n, dtype=np.int64), counts)
        tail = [segment_tail, net.tail]
        head = [segment_tail + 1, net.head]
        cap = [
            np.concatenate([ladder.caps for ladder in ladders]),
            np.full(len(net.tail), _UNLIMITED),
        ]
        cost = [
            np.concatenate([ladder.costs for ladder in ladders]),
            np.zeros(len(net.tail), np.int64),
        ]
        if horizon_s is not None:
            # Times are rounded up: a plan within the integer horizon is within the bound.
            # Where that rounding alone puts the fastest plan past it (a bound a microsecond
            # above the least time), the horizon is the fastest plan's: the flow stays bounded.
            horizon = max(
                math.floor(horizon_s * 1e3 * TIME_UNITS_PER_MS),
                int(makespan(net.iteration, [ladder.times[0] for ladder in ladders])),
            )
            for column, value in zip(
                (tail, head, cap, cost), (1, 0, _UNLIMITED, horizon), strict=True
            ):
                column.append(np.asarray([value], dtype=np.int64))
        self._arcs = [np.concatenate(column).astype(np.int64) for column in (tail, head, cap, cost)]
        m = min_cost_flow.SimpleMinCostFlow()
        m.add_arcs_with_capacity_and_unit_cost(*self._arcs)
        # The static power's arc, always saturated at the optimum (every path takes time):
        # not an arc of the potentials' network, so added last, apart.
        m.add_arc_with_capacity_and_unit_cost(
            1, 0, round(static_per_ms * PRICE_UNITS_PER_J_PER_MS), 0
        )
        status = m.solve()
        if status != m.OPTIMAL:
            raise KareusError(
                f"the composition's min-cost flow ended with status {status} at {net.n} "
                "instructions (an integer overflow of its scaled costs?); plan with "
                "PlannerSettings(flow_min_instructions=None) to solve it by the simplex"
            )
        self._flows = m.flows(np.arange(len(self._arcs[0]), dtype=np.int64))
        first = len(segment_tail)
        prices = self._flows[first : first + len(net.edge_from)] / PRICE_UNITS_PER_J_PER_MS
        self.out, self.into = np.zeros(net.n), np.zeros(net.n)
        np.add.at(self.out, net.edge_from, prices)
        np.add.at(self.into, net.edge_to, prices)
        first += net.first_end
        paid = self._flows[first : first + len(net.ends)] / PRICE_UNITS_PER_J_PER_MS
        np.add.at(self.out, net.ends, paid)
        self.paid = float(paid.sum())

    def plan(self) -> tuple[list[Option], float]:
        """Return each instruction's option and the optimal schedule's iteration time (s).

        Each instruction runs the slowest option within its time in that schedule, which
        mixes two options at most: the faster, so the plan keeps the schedule's time.
        """
        time = self._potentials()
        choices = []
        for i, ladder in enumerate(self.ladders):
            fits = bisect.bisect_right(ladder.times, time[3 + 2 * i] - time[2 + 2 * i])
            choices.append(ladder.options[max(0, fits - 1)])
        return choices, (time[1] - time[0]) / TIME_UNITS_PER_MS / 1e3

    def _potentials(self) -> list[int]:
        """Return each node's time in the flow's optimal schedule (integer units).

        The optimality conditions of the flow are difference constraints on the nodes'
        times, one per arc of its residual network (``time_v >= time_u - cost``); their
        least solution from the source (longest paths, by a queue-based Bellman-Ford: the
        flow's optimality rules out positive cycles) is an optimal schedule.
        """
        tail, head, cap, cost = self._arcs
        flows = self._flows
        out: list[list[tuple[int, int]]] = [[] for _ in range(2 * len(self.ladders) + 2)]
        for keep, sign, ends in ((flows < cap, -1, (tail, head)), (flows > 0, 1, (head, tail))):
            columns = (ends[0][keep].tolist(), ends[1][keep].tolist(), (sign * cost[keep]).tolist())
            for u, v, w in zip(*columns, strict=True):
                out[u].append((v, w))
        return _longest_paths(out, 0)


def _meet(
    iteration: Iteration, choices: list[Option], allowed: Sequence[Sequence[Option]], bound_s: float
) -> None:
    """Run, in place, every instruction past the bound at its fastest option, until it fits.

    The flow's integer times are rounded up, so its plan fits the bound, but for a bound
    within that rounding of the least time (the fastest point: the least time and a
    microsecond) the flow's horizon is the rounded least time: a plan a few microseconds
    over is brought back here.
    """
    for _ in range(len(choices)):
        durations = [c.time_s for c in choices]
        late = [i for i, room in enumerate(slack(iteration, durations, bound_s)) if room < 0]
        faster = {i: min(allowed[i], key=lambda o: (o.time_s, o.dynamic_energy_j)) for i in late}
        if not late or all(faster[i] is choices[i] for i in late):
            return
        for i in late:
            choices[i] = faster[i]


def _longest_paths(arcs: Sequence[Sequence[tuple[int, int]]], source: int) -> list[int]:
    """Return the longest path lengths from ``source`` (no positive cycles; -inf unreached)."""
    time = [-(1 << 62)] * len(arcs)
    time[source] = 0
    queue = collections.deque([source])
    queued = [False] * len(arcs)
    queued[source] = True
    while queue:
        u = queue.popleft()
        queued[u] = False
        base = time[u]
        for v, w in arcs[u]:
            if base + w > time[v]:
                time[v] = base + w
                if not queued[v]:
                    queued[v] = True
                    queue.append(v)
    return time

"""The iteration DAG the composer and the relaxation share: instructions, options, schedules.

An :class:`Iteration` is a pipeline schedule's instructions (a forward or backward of one
micro-batch on one stage) and the edges between them; an :class:`Option` is one way to run an
instruction. :func:`makespan` and :func:`plan_cost` price a choice of options over it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from kareus.errors import KareusError


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run an instruction: its clock, profile, time and dynamic energy."""

    freq_mhz: float
    profile: str
    time_s: float
    dynamic_energy_j: float


@dataclasses.dataclass(frozen=True)
class Instruction:
    """A node of the iteration DAG."""

    stage: int
    kind: str  # "forward" or "backward"
    microbatch: int
    traffic: str = ""  # what it carries beside its graph that others of its group do not

    @property
    def group(self) -> tuple[int, str]:
        """Instructions of one group share a compiled graph, hence a profile."""
        return self.stage, self.kind

    @property
    def key(self) -> tuple[int, str]:
        """Instructions of one key share options: their group's, or with ``traffic`` beside.

        Data parallelism's collectives (FSDP2's all-gathers under a pipeline schedule) run
        beside some instructions of a group and not others: each such set is a key of its
        own, its options priced with the traffic, its profile still the group's.
        """
        return self.stage, self.kind + self.traffic


@dataclasses.dataclass(frozen=True)
class Iteration:
    """The DAG: instructions, precedence edges, and each GPU's execution order.

    ``orders`` lists, per pipeline rank (a GPU), the indices of its instructions in the order
    it runs them: a clock change happens between consecutive ones, and between its last and
    its first (the clock one iteration ends with is the one the next starts with).
    """

    instructions: tuple[Instruction, ...]
    edges: tuple[tuple[int, int], ...]
    orders: tuple[tuple[int, ...], ...] = ()

    def switch_pairs(self) -> list[tuple[int, int]]:
        """Return (before, after) of each place a GPU may change its clock, wrap included."""
        cached = self.__dict__.get("_switch_pairs")
        if cached is None:
            cached = []
            for order in self.orders:
                if len(order) > 1:
                    cached.extend(itertools.pairwise(order))
                    cached.append((order[-1], order[0]))
            object.__setattr__(self, "_switch_pairs", cached)  # frozen: a cache, not a field
        return list(cached)


def chain(microbatches: int = 1) -> Iteration:
    """Forward then backward of each micro-batch on one stage (gradient accumulation)."""
    instrs = tuple(
        Instruction(0, kind, m) for m in range(microbatches) for kind in ("forward", "backward")
    )
    edges = tuple((i, i + 1) for i in range(len(instrs) - 1))
    return Iteration(instrs, edges, (tuple(range(len(instrs))),))


def one_f_one_b(stages: int, microbatches: int) -> Iteration:
    """Return synchronous 1F1B: warm-up forwards, steady 1F1B, cool-down backwards.

    Each stage's order is that of ``torch.distributed.pipelining.Schedule1F1B``.
    """
    _check_sizes("1F1B", stages, microbatches)
    orders = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        seq = [("forward", m) for m in range(warm)]
        f, b = warm, 0
        while b < microbatches:
            if f < microbatches:
                seq.append(("forward", f))
                f += 1
            seq.append(("backward", b))
            b += 1
        orders.append(seq)
    return pipeline(orders)


def gpipe(stages: int, microbatches: int) -> Iteration:
    """Return GPipe: every stage runs all forwards, then all backwards (``ScheduleGPipe``)."""
    _check_sizes("GPipe", stages, microbatches)
    seq = [("forward", m) for m in range(microbatches)]
    seq += [("backward", m) for m in range(microbatches)]
    return pipeline([list(seq) for _ in range(stages)])


def interleaved_one_f_one_b(ranks: int, microbatches: int, virtual: int = 2) -> Iteration:
    """Return interleaved 1F1B: ``virtual`` stages per rank, stage ``v * ranks + r`` on rank r.

    Each rank's order is the one ``torch.distributed.pipelining.ScheduleInterleaved1F1B``
    computes (:func:`interleaved_order`), so the DAG is what torch runs.

    Raises:
        KareusError: sizes torch's schedule does not accept.
    """
    _check_sizes("Interleaved 1F1B", ranks, microbatches)
    if virtual < 2:
        raise KareusError(f"Interleaved 1F1B needs 2 or more stages per rank, got {virtual}")
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise KareusError(
            f"Interleaved 1F1B needs the micro-batches ({microbatches}) to be a multiple of "
            f"the rounds ({rounds} = micro-batches // ranks), as torch's schedule does"
        )
    orders = [interleaved_order(r, ranks, virtual, microbatches) for r in range(ranks)]
    return _dag(orders, ranks * virtual)


def interleaved_order(
    rank: int, ranks: int, virtual: int, microbatches: int
) -> list[tuple[int, str, int]]:
    """Return rank ``rank``'s (stage, kind, micro-batch) order under interleaved 1F1B.

    The algorithm of torch's ``ScheduleInterleaved1F1B`` (depth first, micro-batches in
    rounds of ``microbatches // max(1, microbatches // ranks)``): warm-up forwards, then a
    forward and a backward per step, then the remaining backwards. The tests check it
    against torch's own computation and against the order a real run takes.
    """
    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), microbatches * virtual)
    steady = microbatches * virtual - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % virtual) * ranks + rank

    def backward_stage(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * ranks + rank

    done: dict[tuple[int, str], int] = {}
    order: list[tuple[int, str, int]] = []

    def run(stage: int, kind: str) -> None:
        m = done.get((stage, kind), 0)
        done[(stage, kind)] = m + 1
        order.append((stage, kind, m))

    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            run(forward_stage(step), "forward")
        if step >= warmup:
            run(backward_stage(step), "backward")
    return order


SCHEDULES: dict[str, Callable[..., Iteration]] = {
    "1F1B": one_f_one_b,
    "GPipe": gpipe,
    "Interleaved1F1B": interleaved_one_f_one_b,
}
"""The pipeline schedules the composer builds, by the names plans record. Each takes
(ranks, micro-batches) and, for the interleaved one, the stages per rank."""


def pipeline(orders: Sequence[Sequence[tuple[str, int]]]) -> Iteration:
    """Return the DAG of a pipeline whose stage ``s`` runs ``orders[s]`` in that order."""
    return _dag([[(s, k, m) for k, m in order] for s, order in enumerate(orders)], len(orders))


def _dag(rank_orders: Sequence[Sequence[tuple[int, str, int]]], stages: int) -> Iteration:
    """Return the DAG of ``stages`` stages whose rank ``r`` runs ``rank_orders[r]`` in order.

    Items are (stage, kind, micro-batch). Edges: each rank's order; a micro-batch's forward
    from stage to stage, its backward back; and, on the last stage, a micro-batch's backward
    after its forward.
    """
    instrs: list[Instruction] = []
    index: dict[tuple[int, str, int], int] = {}
    edges: set[tuple[int, int]] = set()
    orders = []
    for order in rank_orders:
        ids = []
        for s, kind, m in order:
            index[(s, kind, m)] = len(instrs)
            ids.append(len(instrs))
            instrs.append(Instruction(s, kind, m))
        edges.update(itertools.pairwise(ids))
        orders.append(tuple(ids))
    last = stages - 1
    for (s, kind, m), i in index.items():
        if kind == "forward" and s < last:
            edges.add((i, index[(s + 1, "forward", m)]))
        if kind == "backward" and s < last:
            edges.add((index[(s + 1, "backward", m)], i))
        if kind == "backward" and s == last:
            edges.add((index[(s, "forward", m)], i))
    return Iteration(tuple(instrs), tuple(sorted(edges)), tuple(orders))


def schedule_iteration(schedule: str, ranks: int, microbatches: int, virtual: int = 1) -> Iteration:
    """Return the DAG of one iteration under ``schedule`` (a key of :data:`SCHEDULES`).

    One rank under 1F1B is a chain (forward, backward, forward...: gradient accumulation);
    ``virtual`` is the stages per rank of ``Interleaved1F1B``.
    """
    if ranks == 1 and schedule == "1F1B":
        return chain(microbatches)
    extra = (virtual,) if virtual > 1 else ()
    return SCHEDULES[schedule](ranks, microbatches, *extra)


STEP = "step"
"""The kind of an iteration's once-per-iteration instructions (:func:`with_steps`)."""


def with_steps(iteration: Iteration) -> tuple[Iteration, dict[int, list[int]]]:
    """Return ``iteration`` with a step instruction after each rank's last one, and its stages.

    The step (kind ``step``, the rank's index as its stage) holds what runs once per
    iteration after the backward: data-parallel gradient communication and the optimizer
    step. It ends the rank's order: it has a clock of its own, and a change before it (and
    from it to the next iteration's first instruction) is a change like any other.
    """
    instrs = list(iteration.instructions)
    edges = list(iteration.edges)
    orders = []
    ranks: dict[int, list[int]] = {}
    for rank, order in enumerate(iteration.orders):
        ranks[rank] = sorted({instrs[i].stage for i in order})
        edges.append((order[-1], len(instrs)))
        orders.append((*order, len(instrs)))
        instrs.append(Instruction(rank, STEP, 0))
    return Iteration(tuple(instrs), tuple(edges), tuple(orders)), ranks


def _check_sizes(name: str, stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise KareusError(
            f"{name} needs stages >= 1 and micro-batches >= 1, got {stages}, {microbatches}"
        )


@dataclasses.dataclass(frozen=True)
class SwitchCost:
    """What one clock change costs the GPU that makes it (see ``hardware/specs.py``).

    The GPU keeps computing through a change, at the clock it had: a change costs energy
    (:func:`change_energy`: ``time_s`` at the highest power the instruction it starts may
    draw), not time, so every time bound the composer proves holds with changes too.
    """

    time_s: float = 0.0
    source: str = "none: clock changes are free"


def change_energy(switch: SwitchCost | None, options: Sequence[Option], static_w: float) -> float:
    """Return what one change before an instruction with ``options`` costs one GPU (J)."""
    if switch is None or switch.time_s <= 0:
        return 0.0
    dynamic_w = max((o.dynamic_energy_j / o.time_s for o in options if o.time_s > 0), default=0.0)
    return switch.time_s * (dynamic_w + static_w)


def switches(iteration: Iteration, choices: Sequence[Option]) -> list[int]:
    """Return the instructions that start with a clock change (wrap-around included)."""
    return [b for a, b in iteration.switch_pairs() if choices[a].freq_mhz != choices[b].freq_mhz]


def group_profiles(
    iteration: Iteration, options: Mapping[tuple[int, str], Sequence[Option]]
) -> dict[tuple[int, str], list[str]]:
    """Return each group's profiles (sorted): those the options of every key of it run.

    A group runs one profile (one compiled graph) on all its instructions, so a profile one
    of its keys has no option of is not the group's.
    """
    keys: dict[tuple[int, str], set[tuple[int, str]]] = {}
    for i in iteration.instructions:
        keys.setdefault(i.group, set()).add(i.key)
    return {
        g: sorted(set.intersection(*({o.profile for o in options[k]} for k in group_keys)))
        for g, group_keys in keys.items()
    }


def makespan(iteration: Iteration, durations: Sequence[float]) -> float:
    """Longest path through the DAG with the given instruction durations."""
    return max(finishes(iteration, durations), default=0.0)


def finishes(iteration: Iteration, durations: Sequence[float]) -> list[float]:
    """Return each instruction's earliest finish with the given durations."""
    order, preds, _succs = topology(iteration)
    finish = [0.0] * len(order)
    for j in order:
        start = 0.0
        for p in preds[j]:
            if finish[p] > start:
                start = finish[p]
        finish[j] = start + durations[j]
    return finish


def slack(iteration: Iteration, durations: Sequence[float], bound_s: float) -> list[float]:
    """Return how much longer each instruction may run with the iteration within ``bound_s``."""
    order, preds, _succs = topology(iteration)
    finish = finishes(iteration, durations)
    latest = [bound_s] * len(order)  # latest finish
    for j in reversed(order):
        start = latest[j] - durations[j]
        for p in preds[j]:
            if start < latest[p]:
                latest[p] = start
    return [latest[j] - finish[j] for j in range(len(order))]


_TIGHT_S = 1e-12
"""Slack (s) within which an instruction is on a longest path: float sums' rounding."""


class Timing:
    """Earliest starts and longest tails of one choice of durations, kept as durations change.

    ``head[j]``: the longest path to ``j``'s start; ``tail[j]``: the longest path from its
    start to the iteration's end, its own duration included. A change of one duration
    updates only what it reaches (descendants' heads, ancestors' tails), so a greedy that
    tries thousands of one-instruction moves pays for what each move touches, not for the
    DAG. Heads are computed as :func:`finishes` computes starts, so :meth:`makespan` is
    exactly :func:`makespan`'s.
    """

    def __init__(self, iteration: Iteration, durations: Sequence[float]) -> None:
        self._order, self._preds, self._succs = topology(iteration)
        self._pos = [0] * len(durations)
        for k, j in enumerate(self._order):
            self._pos[j] = k
        self._ends = [j for j in self._order if not self._succs[j]]
        self.durations = list(durations)
        self.head = [0.0] * len(durations)
        for j in self._order:
            self.head[j] = self._start(j)
        self.tail = [0.0] * len(durations)
        for j in reversed(self._order):
            self.tail[j] = self._rest(j)
        self._sole: tuple[float, set[int]] | None = None  # (makespan, instructions alone)

    def makespan(self) -> float:
        """Return the iteration's time: the longest path."""
        return max((self.head[j] + self.durations[j] for j in self._ends), default=0.0)

    def slack(self, j: int, makespan: float) -> float:
        """How much longer ``j`` may run with the iteration within ``makespan``."""
        return makespan - self.head[j] - self.tail[j]

    def sole(self, j: int, makespan: float) -> bool:
        """Whether every longest path (within ``makespan``) runs through ``j``.

        A longest path covers the iteration's time with its instructions, end to end; so a
        path avoids ``j`` exactly where another instruction of no slack overlaps ``j``'s
        time. Only then can running ``j`` faster shorten the iteration.
        """
        if self._sole is None or self._sole[0] != makespan:
            tight = sorted(
                (self.head[k], k)
                for k in range(len(self.durations))
                if self.slack(k, makespan) <= _TIGHT_S and self.durations[k] > 0
            )
            ends = [h + self.durations[k] for h, k in tight]
            alone = set()
            reach = -math.inf  # the latest end of the instructions starting before
            for p, (h, k) in enumerate(tight):
                after = p + 1 < len(tight) and tight[p + 1][0] < ends[p] - _TIGHT_S
                if not after and reach <= h + _TIGHT_S:
                    alone.add(k)
                reach = max(reach, ends[p])
            self._sole = (makespan, alone)
        return j in self._sole[1]

    def set(self, i: int, duration: float) -> None:
        """Change ``i``'s duration; heads and tails follow."""
        self._sole = None
        self.durations[i] = duration
        self._spread(self._succs[i], self.head, self._start, self._succs, 1)
        self.tail[i] = self._rest(i)
        self._spread(self._preds[i], self.tail, self._rest, self._preds, -1)

    def _start(self, j: int) -> float:
        start = 0.0
        for p in self._preds[j]:
            f = self.head[p] + self.durations[p]
            if f > start:
                start = f
        return start

    def _rest(self, j: int) -> float:
        after = 0.0
        for q in self._succs[j]:
            if self.tail[q] > after:
                after = self.tail[q]
        return after + self.durations[j]

    def _spread(
        self,
        first: Sequence[int],
        values: list[float],
        compute: Callable[[int], float],
        onward: Sequence[Sequence[int]],
        direction: int,
    ) -> None:
        """Recompute ``values`` from ``first`` on, in topological order (``direction``)."""
        heap = [(direction * self._pos[j], j) for j in first]
        heapq.heapify(heap)
        queued = set(first)
        while heap:
            _k, j = heapq.heappop(heap)
            queued.discard(j)
            value = compute(j)
            if value == values[j]:
                continue
            values[j] = value
            for q in onward[j]:
                if q not in queued:
                    queued.add(q)
                    heapq.heappush(heap, (direction * self._pos[q], q))


def topology(iteration: Iteration) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Return a topological order of the DAG, each instruction's predecessors and successors.

    Computed once per iteration and kept on it: the composer prices thousands of plans of
    one iteration (plain loops: at 1,024 instructions, most of planning's time was here).
    """
    cached = iteration.__dict__.get("_topology")
    if cached is None:
        n = len(iteration.instructions)
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for a, b in iteration.edges:
            preds[b].append(a)
            succs[a].append(b)
        waiting = [len(p) for p in preds]
        ready = [i for i in range(n) if not waiting[i]]
        order = []
        while ready:
            i = ready.pop()
            order.append(i)
            for j in succs[i]:
                waiting[j] -= 1
                if not waiting[j]:
                    ready.append(j)
        if len(order) != n:
            raise KareusError("the iteration's DAG has a cycle")
        cached = (order, preds, succs)
        object.__setattr__(iteration, "_topology", cached)  # frozen: a cache, not a field
    return cached  # type: ignore[no-any-return]


def plan_cost(
    iteration: Iteration,
    choices: Sequence[Option],
    *,
    static_power_w: float,
    gpus: int,
    gpus_per_stage: int,
    change_j: Sequence[float] = (),
) -> tuple[float, float]:
    """Return (iteration time, energy of all GPUs) of one choice per instruction.

    ``change_j``: per instruction, what a clock change before it costs on all its GPUs
    (:func:`change_energy`); each change (:func:`switches`) adds it. Empty: changes free.
    """
    t = makespan(iteration, [c.time_s for c in choices])
    dyn = sum(c.dynamic_energy_j for c in choices) * gpus_per_stage
    changes = sum(change_j[b] for b in switches(iteration, choices)) if change_j else 0.0
    return t, dyn + changes + static_power_w * gpus * t

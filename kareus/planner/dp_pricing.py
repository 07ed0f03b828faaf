"""Data-parallel traffic priced into the iteration, and what seeing it gains.

:mod:`kareus.planner.data_parallel` says what DDP, FSDP2 and HSDP communicate and where
(:func:`~kareus.planner.data_parallel.iteration_traffic`); here each instruction that
carries traffic gets options priced with it beside its compute (:class:`Pricing`, the
hardware model), each pipeline rank gets its step (the exposed gradient communication and
the optimizer; :func:`add_data_parallel`), and :func:`blind_gain` prices the plan kareus
would pick without seeing the traffic against the one it picks seeing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.hardware import Emulator, GPUSpec
from kareus.ir.costs import CollectiveCost, Estimate, Evaluator, Knobs, OpCost, PartitionWork
from kareus.ir.partitions import PartitionSet
from kareus.planner.compose import Composer
from kareus.planner.dag import STEP, Instruction, Iteration, Option, with_steps
from kareus.planner.data_parallel import (
    ADAM_BYTES_PER_PARAM,
    ADAM_FLOPS_PER_PARAM,
    IN_GRAPH,
    MAX_ACTIVE_STAGES,
    STEP_ORIGINAL,
    Carried,
    DataParallel,
    StageWeights,
    Traffic,
    iteration_traffic,
    scaled,
)
from kareus.planner.problem import Solution
from kareus.planner.select import select


@dataclasses.dataclass(frozen=True)
class Pricing:
    """How data-parallel collectives are priced: by the hardware model, beside compute or alone.

    A collective's group sets its link (:attr:`CollectiveCost.nodes`: the network where it
    spans nodes, :meth:`Emulator.link`).
    """

    evaluator: Evaluator
    static_power_w: float
    sm_share: int  # the SMs NCCL's default communicator takes
    # What each (compute, collective, clock) was priced at: pipeline stages alike
    # (the middle ones of a model) run the same compute beside the same traffic, and the
    # options of every profile of one graph at one clock share it.
    _priced: dict[tuple[Any, ...], Estimate] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def beside(
        self, ops: tuple[OpCost, ...], coll: CollectiveCost, freq: float
    ) -> tuple[float, float]:
        """(time, dynamic energy) ``coll`` adds to ``ops`` when it runs beside them."""
        if coll.bytes <= 0 or coll.world_size <= 1:
            return 0.0, 0.0
        if not ops:
            return self.alone(coll, freq)
        with_comm = self._estimate(ops, coll, freq)
        without = self._estimate(ops, None, freq)
        return (
            with_comm.time_s - without.time_s,
            self._dynamic(with_comm) - self._dynamic(without),
        )

    def alone(self, coll: CollectiveCost, freq: float) -> tuple[float, float]:
        """(time, dynamic energy) of ``coll`` with nothing beside it."""
        if coll.bytes <= 0 or coll.world_size <= 1:
            return 0.0, 0.0
        est = self._estimate((), coll, freq)
        return est.time_s, self._dynamic(est)

    def _estimate(
        self, ops: tuple[OpCost, ...], coll: CollectiveCost | None, freq: float
    ) -> Estimate:
        """Return the hardware model's estimate of ``ops`` beside ``coll`` (launched with them)."""
        key = (ops, coll, freq)
        if key not in self._priced:
            if coll is None:
                est = self.evaluator.ops(ops, freq)
            else:
                knobs = Knobs(freq, self.sm_share, launch_slot=0 if ops else None)
                est = self.evaluator.partition(PartitionWork(ops, coll), knobs)
            self._priced[key] = est
        return self._priced[key]

    def _dynamic(self, est: Estimate) -> float:
        return est.energy_j - self.static_power_w * est.time_s


def instruction_ops(pset: PartitionSet, kind: str) -> tuple[OpCost, ...]:
    """All compute one ``kind`` instruction runs: partitions, the rest, and recompute."""
    counts = pset.counts(kind)
    ops = list(pset.outside(kind)) + list(pset.recompute.get(kind, ()))
    for key, count in counts.items():
        ops.extend(pset.types[key].compute * count)
    return tuple(ops)


def per_instruction_cost(
    carried: Sequence[Carried], ops: tuple[OpCost, ...], pricing: Pricing, freq: float
) -> tuple[float, float]:
    """(time, dynamic energy) the collectives ``carried`` add to ``ops`` at ``freq``.

    Of each, its ``alone`` share runs alone and the rest beside the instruction's compute.
    """
    t = e = 0.0
    for c in carried:
        dt, de = pricing.alone(scaled(c.coll, c.alone), freq)
        bt, be = pricing.beside(ops, scaled(c.coll, 1 - c.alone), freq)
        t, e = t + dt + bt, e + de + be
    return t, e


def step_cost(
    tr: Traffic, pricing: Pricing, freq: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(time, dynamic energy) after a stage's last backward: its communication, its optimizer.

    Both at the step's ``freq``; the optimizer updates the parameters this GPU holds.
    """
    t = e = 0.0
    for c in tr.after:
        dt, de = pricing.alone(c.coll, freq)
        t, e = t + dt, e + de
    n = tr.optimizer_params
    adam = OpCost("memory", ADAM_FLOPS_PER_PARAM * n, ADAM_BYTES_PER_PARAM * n, "fp32", "adamw")
    est = pricing.evaluator.ops((adam,), freq)
    return (t, e), (est.time_s, est.energy_j - pricing.static_power_w * est.time_s)


def alone_time(tr: Traffic, pricing: Pricing, fmax: float) -> float:
    """Seconds one iteration's data-parallel collectives take alone, at the maximum clock."""
    return sum(pricing.alone(c.coll, fmax)[0] for cs in (*tr.per_instruction, tr.after) for c in cs)


@dataclasses.dataclass(frozen=True)
class DataParallelPlanning:
    """What planning needs to add data parallelism to the iteration.

    Attributes:
        layout: degree, mode, GPUs per node, stride.
        weights: each pipeline stage's parameters on one GPU (one entry: every stage).
        pricing: how its collectives are priced.
    """

    layout: DataParallel
    weights: Sequence[StageWeights]
    pricing: Pricing


def data_parallel_planning(
    spec: GPUSpec,
    evaluator: Evaluator,
    layout: DataParallel,
    weights: Sequence[StageWeights] | None,
    sm_share: int,
) -> DataParallelPlanning:
    """Return what planning ``layout`` needs: where its collectives are priced.

    ``sm_share``: the SMs NCCL's default communicator takes.

    Raises:
        KareusError: the evaluator is not the hardware model (a replay or a profile holds no
            data-parallel collectives), or no stage's parameters are given.
    """
    if not isinstance(evaluator, Emulator):
        raise KareusError(
            "data-parallel communication is priced by the hardware model only: drop --dp "
            f"with this evaluator ({type(evaluator).__name__})"
        )
    if not weights:
        raise KareusError("planning data parallelism needs each stage's parameters")
    static = spec.calibration.static_power_w
    return DataParallelPlanning(layout, weights, Pricing(evaluator, static, sm_share))


def add_data_parallel(
    iteration: Iteration,
    options: dict[tuple[int, str], list[Option]],
    stages: Sequence[PartitionSet],
    dpp: DataParallelPlanning,
    freqs: Sequence[float],
    fmax: float | None = None,
    originals: tuple[Sequence[PartitionSet] | None, str] = (None, ""),
) -> tuple[Iteration, dict[str, Any]]:
    """Add the data-parallel traffic to the iteration and ``options`` (in place), and steps.

    Each instruction that carries traffic (:func:`traffic`, in the order its stage runs
    them; a pipeline of more than one stage runs under ``torch.distributed.pipelining``)
    is tagged with it: its key's options are its group's with the traffic priced at each
    clock of ``freqs``, beside the compute of the graphs each option runs: ``originals``
    (the original graphs' sets, and the profile of the options that run them) or
    ``stages``. The step is priced at each of ``freqs`` and ``fmax`` (the GPU's maximum
    clock; default the highest of ``freqs``), once per graph family (profiles :data:`STEP`
    and :data:`STEP_ORIGINAL`, alike: the baselines' composers keep the latter).

    Returns the iteration with its tags and steps, and the record the plan keeps: per
    stage, the bytes one iteration moves and, at the maximum clock, the seconds its
    collectives take alone, the seconds they add to the split graphs' instructions (the
    rest is hidden behind compute), and the optimizer step's.
    """
    weights = list(dpp.weights)
    weights = weights if len(weights) == len(stages) else weights[:1] * len(stages)
    fmax = max(freqs) if fmax is None else fmax
    step_freqs = sorted({*freqs, fmax}, reverse=True)
    original_sets, original_profile = originals
    placed = iteration_traffic(iteration, dpp.layout, weights)
    instrs = list(iteration.instructions)
    for i, carried in sorted(placed.carried.items()):
        si = instrs[i].stage
        graphs = {True: original_sets[si] if original_sets else stages[si], False: stages[si]}
        instrs[i] = dataclasses.replace(instrs[i], traffic=_tag(carried))
        _carry(instrs[i], carried, graphs, original_profile, dpp.pricing, options)
    # stage -> clock -> (time, dynamic energy) of the stage's share of its rank's step
    steps: dict[int, dict[float, tuple[float, float]]] = {}
    per_stage = []
    for si, (pset, tr) in enumerate(zip(stages, placed.stages, strict=True)):
        in_step = dataclasses.replace(tr, after=placed.after[si])
        parts = {f: step_cost(in_step, dpp.pricing, f) for f in step_freqs}
        steps[si] = {f: (c[0] + o[0], c[1] + o[1]) for f, (c, o) in parts.items()}
        # at the maximum clock, to the split graphs' instructions (the tail wherever it runs)
        added = sum(
            per_instruction_cost(carried, instruction_ops(pset, instrs[i].kind), dpp.pricing, fmax)[
                0
            ]
            for i, carried in zip(placed.runs[si], tr.per_instruction, strict=True)
        )
        added += step_cost(tr, dpp.pricing, fmax)[0][0]
        per_stage.append(
            {
                "parameters": weights[si].total,
                "bytes": tr.bytes,
                "alone_s": alone_time(tr, dpp.pricing, fmax),
                "added_s": added,
                "optimizer_s": parts[fmax][1][0],
            }
        )
    tagged = dataclasses.replace(iteration, instructions=tuple(instrs))
    tagged, ranks = with_steps(tagged)
    for rank, rank_stages in ranks.items():
        options[(rank, STEP)] = [
            Option(
                f,
                profile,
                sum(steps[s][f][0] for s in rank_stages),
                sum(steps[s][f][1] for s in rank_stages),
            )
            for profile in ((STEP, STEP_ORIGINAL) if original_sets else (STEP,))
            for f in step_freqs
        ]
    dp = dpp.layout
    summary = {"degree": dp.degree, "mode": dp.mode, "gpus_per_node": dp.gpus_per_node}
    summary["in_graph"] = dp.mode in IN_GRAPH
    summary |= _unpriced(iteration, dp)
    return tagged, {**summary, "describe": dp.describe(), "stages": per_stage}


def _unpriced(iteration: Iteration, dp: DataParallel) -> dict[str, str]:
    """Return the record's ``caveat`` where the plan leaves out traffic torch issues."""
    kept = max(len({iteration.instructions[i].stage for i in order}) for order in iteration.orders)
    if dp.mode not in ("fsdp", "hsdp") or kept <= MAX_ACTIVE_STAGES:
        return {}
    return {
        "caveat": f"{kept} stages a rank: torch's runtime schedule keeps {MAX_ACTIVE_STAGES} "
        "unsharded and gathers a stage again (root and layers) when it comes back; kareus "
        "prices every stage of a rank as kept, so those gathers are not in this plan"
    }


def _tag(carried: Sequence[Carried]) -> str:
    """Return the tag of the instructions that carry ``carried`` (``+dp gather layers``)."""
    return "+" + "+".join(c.coll.name for c in carried)


def _carry(
    instr: Instruction,
    carried: Sequence[Carried],
    graphs: Mapping[bool, PartitionSet],
    original_profile: str,
    pricing: Pricing,
    options: dict[tuple[int, str], list[Option]],
) -> None:
    """Give ``instr``'s key its group's options with ``carried`` beside them (once per key).

    ``graphs``: the graphs an option runs, by whether its profile is ``original_profile``.
    """
    if instr.key in options:
        return
    ops = {original: instruction_ops(g, instr.kind) for original, g in graphs.items()}
    with_traffic = []
    for o in options[instr.group]:
        original = o.profile == original_profile
        dt, de = per_instruction_cost(carried, ops[original], pricing, o.freq_mhz)
        with_traffic.append(Option(o.freq_mhz, o.profile, o.time_s + dt, o.dynamic_energy_j + de))
    options[instr.key] = with_traffic


def blind_gain(
    blind: Composer,
    aware: Composer,
    policy: str,
    *,
    baseline_time_s: float,
    sweep_points: int,
    energy_budget_j: float | None = None,
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """Return what planning with the data-parallel traffic in view gained over planning blind.

    The *blind* plan is what kareus picks by ``policy`` on the iteration without data
    parallelism (``blind``: kareus's composer over the options before the traffic was added,
    no step; ``baseline_time_s``: Megatron-LM's time there), run with it: every instruction
    keeps its clock and overlap, now with the traffic beside it, and each rank's step runs
    at the clock its last instruction leaves (no step, no clock of its own). The
    *aware* plan is the least energy ``aware`` (kareus's composer over the iteration with the
    traffic) finds no slower than that; the blind plan is one of its plans, so its energy is
    at most the blind plan's and the gain is never negative.

    Returns the record the plan keeps: the blind plan's time and energy with the traffic,
    the aware plan's energy and proven lower bound, and the saving.
    """
    try:
        picked = _policy_solve(
            blind, policy, baseline_time_s, sweep_points, energy_budget_j, deadline_s
        )
    except KareusError as err:  # e.g. only the original graphs meet the baseline's time
        return {
            "note": "not priced: kareus's split graphs cannot meet the policy on the iteration "
            f"without the data-parallel traffic ({err})"
        }

    def same(key: tuple[int, str], profile: str, freq_mhz: float) -> Option:
        opt = aware.option(key, profile, freq_mhz)  # the blind option, with the traffic
        assert opt is not None, (key, profile, freq_mhz)
        return opt

    choices = [
        same(instr.key, picked.choices[j].profile, picked.choices[j].freq_mhz)
        for j, instr in enumerate(aware.it.instructions)
        if instr.kind != STEP
    ]
    # Blind to the step, the runtime leaves it at the clock of the rank's last instruction.
    for order in aware.it.orders:
        step = aware.it.instructions[order[-1]]
        choices.append(same(step.key, STEP, choices[order[-2]].freq_mhz))
    time_s, energy_j = aware.evaluate(choices)
    # searched from the blind plan: the search starts where planning blind left off
    found = aware.solve(bound_s=time_s, hint=Solution(tuple(choices), time_s, energy_j, "BLIND"))
    best = min(found.energy_j, energy_j)
    return {
        "policy": policy,
        "time_s": time_s,
        "energy_j": energy_j,
        "aware_energy_j": best,
        "aware_bound_j": found.bound_j,
        "saving": 1 - best / energy_j if energy_j > 0 else 0.0,
    }


def _policy_solve(
    comp: Composer,
    policy: str,
    baseline_time_s: float,
    sweep_points: int,
    energy_budget_j: float | None,
    deadline_s: float | None,
) -> Solution:
    """Return the plan ``policy`` picks among ``comp``'s, solving only where it must.

    Least energy within a time (the baseline's, the deadline; none for ``min_energy``) is
    one solve; the fastest is a least-time solve; only a budget needs the frontier.
    """
    if policy == "energy_budget_j":
        chosen = select(
            comp.frontier(sweep_points),  # type: ignore[arg-type]
            policy,
            energy_budget_j=energy_budget_j,
        )
        assert isinstance(chosen, Solution)
        return chosen
    if policy == "max_throughput":
        return comp.solve(minimise="time")
    bounds = {"iso_time": baseline_time_s, "deadline_s": deadline_s, "min_energy": None}
    if policy not in bounds:
        raise KareusError(f"unknown policy {policy!r}")
    return comp.solve(bound_s=bounds[policy])

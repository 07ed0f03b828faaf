"""Data parallelism in the iteration: what DDP, FSDP2 and HSDP communicate, where, and at what cost.

Data-parallel replicas run alike, so kareus plans one pipeline replica (as Perseus does) and
adds to it the communication its data-parallel groups carry, issued where PyTorch's hooks
issue it, on a stream of its own beside the compute:

- **DDP**: the gradients are all-reduced once per iteration, in buckets (25 MiB by default)
  while the last micro-batch's backward runs; the last bucket, and whatever the backward
  did not hide, is exposed after it. Then the optimizer step.
- **FSDP2** (``fully_shard``, resharding after forward): each layer's parameters are
  all-gathered before its forward and again before its backward, and its gradients
  reduce-scattered after its backward, in every micro-batch. FSDP2 prefetches the next
  layer's all-gather while a layer computes, so one layer's all-gather (the first) and one
  reduce-scatter (the last) are exposed per instruction, the rest hidden as far as the
  compute lasts. The optimizer step updates each rank's shard.
- **HSDP**: FSDP2 within a node (the shard group), and the gradient shards all-reduced
  across nodes (the replicate group) after each backward.

This prices what hooks issue as they issue it: kareus does not choose their launch point
or SM share (NCCL's defaults). A collective's time comes from the hardware model with the
link its group crosses: NVLink where the group lies within a node, else the node's network
(``GPUSpec.network``). Communication hidden behind compute still costs: the emulator prices
the compute beside it (SMs it takes, the contention for memory, the power of its kernel), so
each micro-batch instruction's options grow by what the traffic adds at their clock, and
the composer chooses clocks knowing what is exposed. What happens once per iteration (DDP's
all-reduce, the optimizer step) is a *step* instruction after each pipeline rank's last
backward, with a clock of its own: the exposed end of the gradient all-reduce waits on the
network and the optimizer on memory, so a low clock there costs little time and saves
power. kareus's runtime sets the step's clock where the rank's last backward graph ends
(:mod:`kareus.runtime.switcher`); the baselines leave the step at the maximum clock, as
Megatron-LM and Perseus (whose plans cover the pipeline's compute only) do.

The planner stays free of graphs: the parameters each stage holds come from the workload
(:class:`StageWeights`), the compute from the partition sets.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.hardware import Emulator, GPUSpec
from kareus.ir.costs import CollectiveCost, Estimate, Evaluator, Knobs, OpCost, PartitionWork
from kareus.ir.partitions import PartitionSet
from kareus.planner.compose import Composer, Solution
from kareus.planner.dag import STEP, Iteration, Option, with_steps
from kareus.planner.select import select

MODES = ("ddp", "fsdp", "hsdp")
# STEP (from dag): the kind of an iteration's once-per-iteration instructions, and the
# profile of their option priced beside the split graphs' last backward.
STEP_ORIGINAL = "step-original"
"""The profile of a step's option priced beside the original graphs' last backward (the
Megatron-LM and Perseus baselines run those)."""

ADAM_BYTES_PER_PARAM = 28.0
"""HBM traffic of one parameter's Adam update with fp32 master weights: read the bf16
gradient (2), read and write the fp32 master weight, both moments (6 x 4 = 24), write the
bf16 parameter (2): PyTorch's fused AdamW reads and writes each state once."""
ADAM_FLOPS_PER_PARAM = 12.0


@dataclasses.dataclass(frozen=True)
class StageWeights:
    """The parameters one GPU of a pipeline stage holds, before data-parallel sharding.

    Attributes:
        layers: decoder layers of the stage.
        per_layer: parameters of one layer on one GPU (its tensor-parallel shard).
        other: parameters outside layers on this stage (embedding, head, final norm).
    """

    layers: int
    per_layer: float
    other: float = 0.0

    @property
    def total(self) -> float:
        """All parameters of the stage on one GPU."""
        return self.layers * self.per_layer + self.other


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """The data-parallel layout a plan is made for.

    Attributes:
        degree: data-parallel replicas (1: the step instruction, with no communication).
        mode: ``ddp``, ``fsdp`` (FSDP2) or ``hsdp`` (FSDP2 sharded within a node,
            replicated across nodes).
        gpus_per_node: GPUs a node's NVLink joins.
        stride: ranks between data-parallel neighbours (tensor x context parallel, as
            Megatron-LM and torch's device meshes order ranks: data parallel outside them).
        param_bytes: bytes of a parameter and of its gradient as communicated (bf16: 2).
        bucket_bytes: DDP's gradient bucket (``bucket_cap_mb``, 25 MiB by default).
    """

    degree: int = 1
    mode: str = "ddp"
    gpus_per_node: int = 8
    stride: int = 1
    param_bytes: float = 2.0
    bucket_bytes: float = 25 * 2**20

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KareusError(f"data-parallel mode {self.mode!r}: kareus plans {', '.join(MODES)}")
        if self.degree < 1 or self.gpus_per_node < 1 or self.stride < 1:
            raise KareusError(
                f"data-parallel degree {self.degree}, {self.gpus_per_node} GPUs per node and "
                f"stride {self.stride} must all be at least 1"
            )
        if self.mode == "hsdp" and self.degree > 1:
            shard = self.shard_size
            if shard < 2:
                raise KareusError(
                    f"HSDP over {self.degree} replicas: a node of {self.gpus_per_node} GPUs "
                    f"holds one replica's stage ({self.stride} GPUs, TP x CP), so HSDP has no "
                    "shard group within a node: use --dp-mode ddp or fsdp"
                )
            if self.degree % shard:
                raise KareusError(
                    f"HSDP over {self.degree} replicas shards within a node ({shard} replicas "
                    f"of {self.stride} GPUs in a node of {self.gpus_per_node}) and replicates "
                    f"across nodes: the degree must be a multiple of {shard}"
                )

    @property
    def shard_size(self) -> int:
        """HSDP's shard group: the replicas one node holds (FSDP: all of them)."""
        if self.mode != "hsdp":
            return self.degree
        return max(1, min(self.degree, self.gpus_per_node // self.stride))

    def crosses_nodes(self, group: int) -> bool:
        """Whether a data-parallel group of ``group`` consecutive replicas spans nodes."""
        return group > 1 and group * self.stride > self.gpus_per_node

    def describe(self) -> str:
        """One line, e.g. ``DDP over 4 replicas (across nodes)``."""
        where = "across nodes" if self.crosses_nodes(self.degree) else "within a node"
        if self.mode == "hsdp" and self.degree > 1:
            where = f"shards of {self.shard_size} within a node, replicated across nodes"
        return f"{self.mode.upper()} over {self.degree} replica(s) ({where})"


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one stage's data-parallel groups carry per instruction and per iteration."""

    per_forward: tuple[tuple[CollectiveCost, bool], ...]  # (collective, across nodes)
    per_backward: tuple[tuple[CollectiveCost, bool], ...]
    per_iteration: tuple[tuple[CollectiveCost, bool], ...]
    units: int  # layers the per-instruction traffic is spread over (one exposed, rest hidden)
    optimizer_params: float  # parameters this GPU updates

    def bytes_moved(self, microbatches: int) -> float:
        """Bytes the collectives of one iteration of ``microbatches`` micro-batches move."""
        per_microbatch = sum(c.bytes for c, _x in self.per_forward + self.per_backward)
        return per_microbatch * microbatches + sum(c.bytes for c, _x in self.per_iteration)


def traffic(dp: DataParallel, weights: StageWeights) -> Traffic:
    """Return what ``weights``' stage communicates under ``dp``."""
    full = weights.total * dp.param_bytes
    units = weights.layers + (1 if weights.other else 0)
    if dp.degree == 1:
        return Traffic((), (), (), units, weights.total)
    if dp.mode == "ddp":
        across = dp.crosses_nodes(dp.degree)
        reduce = ((CollectiveCost("all_reduce", full, dp.degree, "dp gradients"), across),)
        return Traffic((), (), reduce, units, weights.total)
    shard = dp.shard_size
    across = dp.crosses_nodes(shard)
    gather = (CollectiveCost("all_gather", full, shard, "dp parameters"), across)
    scatter = (CollectiveCost("reduce_scatter", full, shard, "dp gradients"), across)
    backward = [gather, scatter]
    replicas = dp.degree // shard
    if replicas > 1:  # HSDP: each shard's gradients across the replicas
        backward.append(
            (CollectiveCost("all_reduce", full / shard, replicas, "dp gradient shards"), True)
        )
    return Traffic((gather,), tuple(backward), (), units, weights.total / shard)


@dataclasses.dataclass(frozen=True)
class Pricing:
    """Where data-parallel collectives are priced: within a node and across nodes."""

    local: Evaluator
    network: Evaluator
    static_power_w: float
    sm_share: int  # the SMs NCCL's default communicator takes
    # What each (compute, collective, link, clock) was priced at: pipeline stages alike
    # (the middle ones of a model) run the same compute beside the same traffic, and a
    # step prices its last backward's traffic at one clock for each clock of its own.
    _priced: dict[tuple[Any, ...], Estimate] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def evaluator(self, across: bool) -> Evaluator:
        """Return the evaluator whose link carries a group within a node or across nodes."""
        return self.network if across else self.local

    def beside(
        self, ops: tuple[OpCost, ...], coll: CollectiveCost, across: bool, freq: float
    ) -> tuple[float, float]:
        """(time, dynamic energy) ``coll`` adds to ``ops`` when it runs beside them."""
        if coll.bytes <= 0 or coll.world_size <= 1:
            return 0.0, 0.0
        if not ops:
            return self.alone(coll, across, freq)
        with_comm = self._estimate(ops, coll, across, freq)
        without = self._estimate(ops, None, False, freq)
        return (
            with_comm.time_s - without.time_s,
            self._dynamic(with_comm) - self._dynamic(without),
        )

    def alone(self, coll: CollectiveCost, across: bool, freq: float) -> tuple[float, float]:
        """(time, dynamic energy) of ``coll`` with nothing beside it."""
        if coll.bytes <= 0 or coll.world_size <= 1:
            return 0.0, 0.0
        est = self._estimate((), coll, across, freq)
        return est.time_s, self._dynamic(est)

    def _estimate(
        self, ops: tuple[OpCost, ...], coll: CollectiveCost | None, across: bool, freq: float
    ) -> Estimate:
        """Return the hardware model's estimate of ``ops`` beside ``coll`` (launched with them)."""
        key = (ops, coll, across, freq)
        if key not in self._priced:
            if coll is None:
                est = self.local.ops(ops, freq)
            else:
                knobs = Knobs(freq, self.sm_share, launch_slot=0 if ops else None)
                est = self.evaluator(across).partition(PartitionWork(ops, coll), knobs)
            self._priced[key] = est
        return self._priced[key]

    def _dynamic(self, est: Estimate) -> float:
        return est.energy_j - self.static_power_w * est.time_s


def _scaled(coll: CollectiveCost, fraction: float) -> CollectiveCost:
    return dataclasses.replace(coll, bytes=coll.bytes * fraction)


def instruction_ops(pset: PartitionSet, kind: str) -> tuple[OpCost, ...]:
    """All compute one ``kind`` instruction runs: partitions, the rest, and recompute."""
    counts = pset.counts(kind)
    ops = list(pset.outside(kind)) + list(pset.recompute.get(kind, ()))
    for key, count in counts.items():
        ops.extend(pset.types[key].compute * count)
    return tuple(ops)


def per_instruction_cost(
    colls: Sequence[tuple[CollectiveCost, bool]],
    ops: tuple[OpCost, ...],
    units: int,
    pricing: Pricing,
    freq: float,
) -> tuple[float, float]:
    """(time, dynamic energy) an instruction's data-parallel traffic adds at ``freq``.

    Of each collective (the sum over ``units`` layers), one layer's share runs alone (the
    first all-gather, the last reduce-scatter: nothing to hide them behind) and the rest
    beside the instruction's compute.
    """
    t = e = 0.0
    for coll, across in colls:
        one = 1.0 / max(units, 1)
        dt, de = pricing.alone(_scaled(coll, one), across, freq)
        bt, be = pricing.beside(ops, _scaled(coll, 1 - one), across, freq)
        t, e = t + dt + bt, e + de + be
    return t, e


def step_cost(
    tr: Traffic,
    dp: DataParallel,
    last_backward: tuple[OpCost, ...],
    pricing: Pricing,
    fmax: float,
    freq: float | None = None,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(time, dynamic energy) of one stage's once-per-iteration communication and optimizer.

    DDP's all-reduce: all buckets but the last beside the last backward's compute (at the
    maximum clock: the backward's own clock is chosen apart, and this is the most its
    traffic can cost it), the last bucket after it, at the step's clock ``freq`` (default
    the maximum); then the optimizer step over the parameters this GPU updates, at ``freq``.
    """
    freq = fmax if freq is None else freq
    t = e = 0.0
    for coll, across in tr.per_iteration:
        last = min(1.0, dp.bucket_bytes / coll.bytes) if coll.bytes else 1.0
        dt, de = pricing.alone(_scaled(coll, last), across, freq)
        bt, be = pricing.beside(last_backward, _scaled(coll, 1 - last), across, fmax)
        t, e = t + dt + bt, e + de + be
    n = tr.optimizer_params
    adam = OpCost("memory", ADAM_FLOPS_PER_PARAM * n, ADAM_BYTES_PER_PARAM * n, "fp32", "adamw")
    est = pricing.local.ops((adam,), freq)
    return (t, e), (est.time_s, est.energy_j - pricing.static_power_w * est.time_s)


def alone_time(tr: Traffic, pricing: Pricing, fmax: float, microbatches: int) -> float:
    """Seconds one iteration's data-parallel collectives take alone, at the maximum clock."""
    per_microbatch = sum(pricing.alone(c, x, fmax)[0] for c, x in tr.per_forward + tr.per_backward)
    return per_microbatch * microbatches + sum(
        pricing.alone(c, x, fmax)[0] for c, x in tr.per_iteration
    )


@dataclasses.dataclass(frozen=True)
class DataParallelPlanning:
    """What planning needs to add data parallelism to the iteration.

    Attributes:
        layout: degree, mode, GPUs per node, stride.
        weights: each pipeline stage's parameters on one GPU (one entry: every stage).
        pricing: the evaluators of collectives within a node and across nodes.
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
    network = Emulator(spec.across_nodes(), evaluator.harness)
    return DataParallelPlanning(layout, weights, Pricing(evaluator, network, static, sm_share))


def add_data_parallel(
    iteration: Iteration,
    options: dict[tuple[int, str], list[Option]],
    stages: Sequence[PartitionSet],
    dpp: DataParallelPlanning,
    freqs: Sequence[float],
    fmax: float | None = None,
    originals: tuple[Sequence[PartitionSet] | None, str] = (None, ""),
) -> tuple[Iteration, dict[str, Any]]:
    """Add the data-parallel traffic to ``options`` (in place) and a step per rank.

    The per-micro-batch traffic is priced at each clock of ``freqs``, beside the compute of
    the graphs each option runs: ``originals`` (the original graphs' sets, and the profile
    of the options that run them) or ``stages``. The step is priced at each of ``freqs``
    and ``fmax`` (the GPU's maximum clock; default the highest of ``freqs``), once beside
    each graph family's last backward (profiles :data:`STEP` and :data:`STEP_ORIGINAL`).

    Returns the iteration with its steps, and the record the plan keeps: per stage, the
    bytes one iteration moves and, at the maximum clock, the seconds its collectives take
    alone, the seconds they add to the split graphs' instructions (the rest is hidden
    behind compute), and the optimizer step's.
    """
    weights = list(dpp.weights)
    weights = weights if len(weights) == len(stages) else weights[:1] * len(stages)
    microbatches = sum(1 for i in iteration.instructions if i.stage == 0 and i.kind == "forward")
    fmax = max(freqs) if fmax is None else fmax
    step_freqs = sorted({*freqs, fmax}, reverse=True)
    original_sets, original_profile = originals
    # profile -> stage -> clock -> (time, dynamic energy) of the stage's share of the step
    steps: dict[str, dict[int, dict[float, tuple[float, float]]]] = {STEP: {}, STEP_ORIGINAL: {}}
    per_stage = []
    for si, pset in enumerate(stages):
        graphs = {STEP: pset, STEP_ORIGINAL: original_sets[si] if original_sets else None}
        tr = traffic(dpp.layout, weights[si])
        for profile, graph in graphs.items():
            if graph is None:
                continue
            original = profile == STEP_ORIGINAL
            picks = functools.partial(operator.eq if original else operator.ne, original_profile)
            added_here = _add_traffic(si, graph, tr, dpp.pricing, options, freqs, picks)
            last_backward = instruction_ops(graph, "backward")
            parts = {
                f: step_cost(tr, dpp.layout, last_backward, dpp.pricing, fmax, f)
                for f in step_freqs
            }
            steps[profile][si] = {f: (c[0] + o[0], c[1] + o[1]) for f, (c, o) in parts.items()}
            comm, optimizer = parts[fmax]
            if profile == STEP:
                at_fmax = added_here.get(fmax, added_here[max(added_here)])
                per_stage.append(
                    {
                        "parameters": weights[si].total,
                        "bytes": tr.bytes_moved(microbatches),
                        "alone_s": alone_time(tr, dpp.pricing, fmax, microbatches),
                        "added_s": at_fmax * microbatches + comm[0],
                        "optimizer_s": optimizer[0],
                    }
                )
    iteration, ranks = with_steps(iteration)
    for rank, rank_stages in ranks.items():
        options[(rank, STEP)] = [
            Option(
                f,
                profile,
                sum(by[s][f][0] for s in rank_stages),
                sum(by[s][f][1] for s in rank_stages),
            )
            for profile, by in steps.items()
            if by
            for f in step_freqs
        ]
    dp = dpp.layout
    summary = {"degree": dp.degree, "mode": dp.mode, "gpus_per_node": dp.gpus_per_node}
    return iteration, {**summary, "describe": dp.describe(), "stages": per_stage}


def _add_traffic(
    si: int,
    pset: PartitionSet,
    tr: Traffic,
    pricing: Pricing,
    options: dict[tuple[int, str], list[Option]],
    freqs: Sequence[float],
    picks: Callable[[str], bool],
) -> dict[float, float]:
    """Add stage ``si``'s per-micro-batch traffic, beside ``pset``'s compute, to its options.

    ``picks(profile)`` says which options run ``pset``. Returns the seconds added to one
    forward and one backward, by clock.
    """
    added: dict[float, float] = dict.fromkeys(freqs, 0.0)
    for kind, colls in (("forward", tr.per_forward), ("backward", tr.per_backward)):
        ops = instruction_ops(pset, kind)
        extra = {f: per_instruction_cost(colls, ops, tr.units, pricing, f) for f in freqs}
        options[(si, kind)] = [
            Option(
                o.freq_mhz,
                o.profile,
                o.time_s + extra[o.freq_mhz][0],
                o.dynamic_energy_j + extra[o.freq_mhz][1],
            )
            if picks(o.profile)
            else o
            for o in options[(si, kind)]
        ]
        for f in freqs:
            added[f] += extra[f][0]
    return added


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

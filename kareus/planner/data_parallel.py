"""Data parallelism in the iteration: what DDP, FSDP2 and HSDP communicate, where, and at what cost.

Data-parallel replicas run alike, so kareus plans one pipeline replica (as Perseus does) and
adds to it the communication its data-parallel groups carry, issued where PyTorch's hooks
issue it, on a stream of its own beside the compute:

- **DDP**: the gradients are all-reduced once per iteration, in buckets (25 MiB by default)
  while the last micro-batch's backward runs (``no_sync`` before it, as
  ``torch.distributed.pipelining`` does); the last bucket after it. Then the optimizer step.
- **FSDP2** (``fully_shard`` on each layer and on the stage's module, the *root*: embedding,
  head, final norm): a parameter group is all-gathered before a forward or backward that
  finds it sharded. The layers are resharded after each forward (``reshard_after_forward``,
  FSDP2's default; torchtitan keeps them under pipelining), the root never. Alone, each
  backward reshards everything and reduce-scatters its gradients, so every micro-batch
  gathers and reduce-scatters. Under a ``torch.distributed.pipelining`` schedule the
  stage keeps parameters and gradients through every backward and reduce-scatters once,
  after the last (``perform_reduce_grad``): a stage gathers its layers before its first
  forward and before each forward or backward that follows a forward, and no more. Which
  instruction carries what is stepped through FSDP2's states along each stage's order
  (:func:`traffic`) and placed on the rank's order (:func:`iteration_traffic`: a rank of
  several stages gathers them all as the iteration starts, and reduces a stage's gradients
  when its last backward ends); checked against what torch issues under 1F1B, GPipe and
  interleaved 1F1B (``tests/test_data_parallel.py``).
  FSDP2 prefetches the next layer's all-gather while a layer computes, so one layer's
  all-gather and one reduce-scatter (and the root's) run alone, the rest beside the
  instruction's compute, as far as it lasts. The optimizer step updates each rank's shard.
- **HSDP**: FSDP2 within a node (the shard group), and each reduce-scatter's shards
  all-reduced across nodes (the replicate group) after it.
- **SimpleFSDP** (``simplefsdp``): the parameters are gathered and their gradients
  reduce-scattered *in the graphs* (torchtitan's SimpleFSDP; ``kareus plan`` traces them
  so, :func:`kareus.models.parallel.gather_in_graph`). Those collectives are the graphs'
  own: partitions whose launch slot, SM share and clock kareus plans like the tensor-parallel
  ones, priced on the network where the group spans nodes (``CollectiveCost.nodes``).
  Nothing is added here but the optimizer step on each rank's shard.

This prices what hooks issue as they issue it: kareus does not choose their launch point
or SM share (NCCL's defaults). A collective's time comes from the hardware model with the
link its group crosses: NVLink where the group lies within a node, else the node's network
(``GPUSpec.network``). Communication hidden behind compute still costs: the emulator prices
the compute beside it (SMs it takes, the contention for memory, the power of its kernel), so
the options of each instruction that carries traffic grow by what it adds at their clock
(such instructions are a key of their own, :attr:`~kareus.planner.dag.Instruction.key`,
their profile still their group's), and the composer chooses clocks knowing what is
exposed. What runs once per iteration after the last backward (DDP's last bucket, FSDP2's
reduce-scatters under a pipeline schedule, the optimizer step) is a *step* instruction
after each pipeline rank's last backward, with a clock of its own: the exposed gradient
communication waits on the network and the optimizer on memory, so a low clock there
costs little time and saves power. kareus's runtime sets the step's clock where the
rank's last backward graph ends (:mod:`kareus.runtime.switcher`); the baselines leave the
step at the maximum clock, as Megatron-LM and Perseus (whose plans cover the pipeline's
compute only) do.

The planner stays free of graphs: the parameters each stage holds come from the workload
(:class:`StageWeights`), the compute from the partition sets.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from kareus.errors import KareusError
from kareus.ir.costs import CollectiveCost
from kareus.planner.dag import Iteration

MODES = ("ddp", "fsdp", "hsdp", "simplefsdp")
MAX_ACTIVE_STAGES = 3
"""Stages of a rank torch's runtime pipeline schedules keep unsharded (``_add_unshard_reshard``'s
``max_active_stages``): within it, kareus's placement is checked against torch."""
IN_GRAPH = ("simplefsdp",)
"""Modes whose collectives are in the traced graphs (none added by :func:`traffic`)."""
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
        mode: ``ddp``, ``fsdp`` (FSDP2), ``hsdp`` (FSDP2 sharded within a node,
            replicated across nodes) or ``simplefsdp`` (gathered in the graphs).
        gpus_per_node: GPUs a node's NVLink joins.
        stride: ranks between data-parallel neighbours (tensor x context parallel, as
            Megatron-LM and torch's device meshes order ranks: data parallel outside them).
        param_bytes: bytes of a parameter and of its gradient as communicated (bf16: 2).
        bucket_bytes: DDP's gradient bucket (``bucket_cap_mb``, 25 MiB by default).
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for the layers (its
            default True: gathered again before the backward; torchtitan passes False
            under pipeline parallelism: gathered once per iteration).
    """

    degree: int = 1
    mode: str = "ddp"
    gpus_per_node: int = 8
    stride: int = 1
    param_bytes: float = 2.0
    bucket_bytes: float = 25 * 2**20
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KareusError(f"data-parallel mode {self.mode!r}: kareus plans {', '.join(MODES)}")
        if self.degree < 1 or self.gpus_per_node < 1 or self.stride < 1:
            raise KareusError(
                f"data-parallel degree {self.degree}, {self.gpus_per_node} GPUs per node and "
                f"stride {self.stride} must all be at least 1"
            )
        if self.mode in ("ddp", *IN_GRAPH) and not self.reshard_after_forward:
            raise KareusError(
                "reshard_after_forward=False (--no-reshard-after-forward) is FSDP2's: "
                + (
                    "DDP keeps every parameter whole"
                    if self.mode == "ddp"
                    else "under SimpleFSDP the compiler decides what the backward gathers again"
                )
                + "; use --dp-mode fsdp or hsdp, or drop it"
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

    def nodes(self, group: int) -> int:
        """Nodes a data-parallel group of ``group`` consecutive replicas spans."""
        if not self.crosses_nodes(group):
            return 1
        return -(-group * self.stride // self.gpus_per_node)

    def describe(self) -> str:
        """One line, e.g. ``DDP over 4 replicas (across nodes)``."""
        where = "across nodes" if self.crosses_nodes(self.degree) else "within a node"
        if self.mode == "hsdp" and self.degree > 1:
            where = f"shards of {self.shard_size} within a node, replicated across nodes"
        if self.mode in IN_GRAPH:
            return f"SimpleFSDP over {self.degree} replica(s) ({where}; collectives in the graphs)"
        if self.mode != "ddp" and not self.reshard_after_forward:
            where += "; layers kept from forward to backward"
        return f"{self.mode.upper()} over {self.degree} replica(s) ({where})"


@dataclasses.dataclass(frozen=True)
class Carried:
    """A collective an instruction carries beside its compute.

    Attributes:
        coll: the collective (its bytes: all it moves in the instruction; its nodes: those
            its group spans, the network carrying it where they are more than one).
        alone: the share no compute hides (FSDP2 prefetches the next layer's all-gather
            while a layer computes: the first layer's runs alone, and the last layer's
            reduce-scatter), run alone at the instruction's clock; the rest beside its
            compute. 1: all alone.
    """

    coll: CollectiveCost
    alone: float = 1.0

    @property
    def across(self) -> bool:
        """Whether its group spans nodes."""
        return self.coll.nodes > 1


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one stage's data-parallel groups carry in one iteration.

    Attributes:
        per_instruction: what each of the stage's instructions carries, in the order the
            stage runs them.
        after: what runs alone after the stage's last backward, before the optimizer step
            (at the step's clock).
        optimizer_params: parameters this GPU updates.
    """

    per_instruction: tuple[tuple[Carried, ...], ...]
    after: tuple[Carried, ...]
    optimizer_params: float

    @property
    def bytes(self) -> float:
        """Bytes the stage's collectives move in one iteration."""
        return sum(c.coll.bytes for cs in (*self.per_instruction, self.after) for c in cs)


def traffic(
    dp: DataParallel,
    weights: StageWeights,
    kinds: Sequence[str] = ("forward", "backward"),
    *,
    pipelined: bool = False,
) -> Traffic:
    """Return what ``weights``' stage communicates under ``dp``, running ``kinds`` in order.

    ``pipelined``: the stage runs under a ``torch.distributed.pipelining`` schedule, which
    has FSDP2 keep each layer's parameters and gradients through every backward of the
    iteration (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``)
    and reduce-scatter them once, after the last (``perform_reduce_grad``); DDP syncs in
    the last backward alone (``no_sync`` before it) either way.
    """
    none: list[tuple[Carried, ...]] = [() for _ in kinds]
    if dp.degree == 1:
        return Traffic(tuple(none), (), weights.total)
    if dp.mode in IN_GRAPH:  # the graphs' own collectives: only the step on the shard
        return Traffic(tuple(none), (), weights.total / dp.degree)
    if dp.mode != "ddp":
        return _fsdp_traffic(dp, weights, kinds, pipelined)
    # DDP: the gradients' buckets are all-reduced as the last backward produces them, all
    # but the last beside its compute; the last after it.
    params = weights.total * dp.param_bytes
    reduce = CollectiveCost("all_reduce", params, dp.degree, "dp grads", dp.nodes(dp.degree))
    last = min(1.0, dp.bucket_bytes / reduce.bytes) if reduce.bytes else 1.0
    backwards = [j for j, kind in enumerate(kinds) if kind == "backward"]
    if backwards and last < 1:
        none[backwards[-1]] = (Carried(scaled(reduce, 1 - last), 0.0),)
    return Traffic(tuple(none), (Carried(scaled(reduce, last)),), weights.total)


def scaled(coll: CollectiveCost, fraction: float) -> CollectiveCost:
    """Return ``coll`` with ``fraction`` of its bytes."""
    return dataclasses.replace(coll, bytes=coll.bytes * fraction)


def _fsdp_traffic(
    dp: DataParallel, weights: StageWeights, kinds: Sequence[str], pipelined: bool
) -> Traffic:
    """FSDP2's (HSDP's) collectives, stepped through its parameter groups' states.

    Two groups: the layers (one ``fully_shard`` each, all alike) and the root (the stage's
    module: embedding, head, final norm), which FSDP2 does not reshard after forward. A
    group gathers before a forward or backward where it is sharded; after a forward, the
    layers are resharded (``reshard_after_forward``); after a backward, both, and their
    gradients reduce-scattered (and, under HSDP, the shards all-reduced across the
    replicas), unless ``pipelined``: then all at once after the last backward.
    """
    shard = dp.shard_size
    nodes = dp.nodes(shard)
    replicas = dp.degree // shard
    groups = [  # (name, parameters, layers, resharded after forward)
        (
            "layers",
            weights.layers * weights.per_layer,
            max(weights.layers, 1),
            dp.reshard_after_forward,
        ),
        ("root", weights.other, 1, False),
    ]
    groups = [g for g in groups if g[1] > 0]

    def gather(name: str, params: float, units: int) -> Carried:
        coll = CollectiveCost(
            "all_gather", params * dp.param_bytes, shard, f"dp gather {name}", nodes
        )
        return Carried(coll, 1 / units)

    def reduce(name: str, params: float, alone: float) -> list[Carried]:
        full = params * dp.param_bytes
        scatter = CollectiveCost("reduce_scatter", full, shard, f"dp scatter {name}", nodes)
        out = [Carried(scatter, alone)]
        if replicas > 1:  # HSDP: each shard's gradients across the replicas, a node each
            coll = CollectiveCost(
                "all_reduce", full / shard, replicas, f"dp reduce {name}", replicas
            )
            out.append(Carried(coll, alone))
        return out

    sharded = {name: True for name, *_ in groups}
    per: list[tuple[Carried, ...]] = []
    for kind in kinds:
        carried: list[Carried] = []
        for name, params, units, after_forward in groups:
            if sharded[name]:
                carried.append(gather(name, params, units))
                sharded[name] = False
            if kind == "forward":
                sharded[name] = after_forward
            elif kind == "backward" and not pipelined:  # the last layer's (root: all) alone
                carried += reduce(name, params, 1 / units)
                sharded[name] = True
        per.append(tuple(carried))
    after = [c for name, params, *_ in groups if pipelined for c in reduce(name, params, 1.0)]
    return Traffic(tuple(per), tuple(after), weights.total / shard)


@dataclasses.dataclass(frozen=True)
class PlacedTraffic:
    """Each stage's traffic, placed on the iteration's instructions where torch issues it.

    Attributes:
        stages: each stage's :class:`Traffic` (:func:`traffic`, along the stage's order).
        runs: each stage's instructions (indices into the iteration), in the order it runs them.
        carried: what each instruction that carries traffic carries (its own stage's, and
            the tail of a stage whose last backward it follows on its rank).
        after: per stage, the tail that runs in its rank's step (the stage's last backward
            ends its rank's order); empty where the tail runs before a later instruction.
    """

    stages: tuple[Traffic, ...]
    runs: tuple[tuple[int, ...], ...]
    carried: dict[int, tuple[Carried, ...]]
    after: tuple[tuple[Carried, ...], ...]


def iteration_traffic(
    iteration: Iteration, dp: DataParallel, weights: Sequence[StageWeights]
) -> PlacedTraffic:
    """Place each stage's data-parallel traffic (``weights``: one per stage) on ``iteration``.

    A pipeline of more than one stage runs under ``torch.distributed.pipelining``. Its
    schedules reduce a stage's gradients as soon as its last backward ends
    (``perform_reduce_grad``); FSDP2's final callback then has the compute stream wait for
    them. So where another stage on the same rank runs after it (interleaved 1F1B), the
    tail runs alone before that stage's next instruction, at its clock; else in the step.
    A rank of several stages (torch's runtime schedules, which keep up to three stages
    unsharded) gathers every stage's parameters when the iteration starts, asynchronously:
    the first gathers of its stages but the first run beside the rank's first instruction.
    """
    instrs = iteration.instructions
    stages = range(len(weights))
    runs = tuple(tuple(i for o in iteration.orders for i in o if instrs[i].stage == si)
                 for si in stages)  # fmt: skip
    traffics = tuple(
        traffic(dp, weights[si], [instrs[i].kind for i in runs[si]], pipelined=len(weights) > 1)
        for si in stages
    )
    carried: dict[int, list[Carried]] = {}
    after: list[tuple[Carried, ...]] = []
    following = {a: b for o in iteration.orders for a, b in itertools.pairwise(o)}
    first = {i: o[0] for o in iteration.orders for i in o}  # each instruction's rank's first
    for si, tr in enumerate(traffics):
        for k, (i, own) in enumerate(zip(runs[si], tr.per_instruction, strict=True)):
            if k == 0 and own and first[i] != i:  # prefetched as the rank starts
                carried.setdefault(first[i], []).extend(_of(c, si, alone=0.0) for c in own)
            elif own:
                carried.setdefault(i, []).extend(own)
        later = following.get(runs[si][-1]) if runs[si] else None
        if later is None or not tr.after:
            after.append(tr.after)
            continue
        after.append(())
        carried.setdefault(later, []).extend(_of(c, si) for c in tr.after)
    return PlacedTraffic(traffics, runs, {i: tuple(c) for i, c in carried.items()}, tuple(after))


def _of(c: Carried, stage: int, alone: float | None = None) -> Carried:
    """``c``, another stage's, carried by an instruction of ``stage``'s rank (named so)."""
    coll = dataclasses.replace(c.coll, name=f"{c.coll.name} of {stage}")
    return dataclasses.replace(c, coll=coll, alone=c.alone if alone is None else alone)

"""Plain data shared by the graph passes, the hardware model and the planner.

The passes describe work (what each op costs, which collective a partition overlaps); the
hardware model and the planner read it. Nothing here imports torch or fx, so the planner
stays free of graphs and the descriptions serialise to JSON as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

OpClass = Literal["gemm", "attention", "memory", "view", "collective_issue", "collective_wait"]
"""How an op uses the GPU: tensor-core math, fused attention, memory traffic, or nothing."""

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]

Source = Literal["modelled", "measured"]


@dataclasses.dataclass(frozen=True)
class OpCost:
    """The cost of one compute op: its class, arithmetic and memory traffic."""

    op_class: OpClass
    flops: float
    bytes: float
    dtype: str = "bf16"
    name: str = ""
    dims: tuple[int, ...] = ()  # a matmul's (batch, M, N, K); empty for other ops


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective: kind, size of the (full) tensor in bytes, and the group's size.

    ``nodes``: the nodes the group's ranks span (1: within one node's NVLink; more: its ring
    crosses the network between nodes, which carries it). ``group``: the name its process
    group is registered under in the process that traced it ("" where none was), which
    compile-time pricing asks how its collectives run (:mod:`kareus.compiler.split_pricing`).
    """

    kind: CollectiveKind
    bytes: float
    world_size: int
    name: str = ""
    nodes: int = 1
    group: str = ""


@dataclasses.dataclass(frozen=True)
class PartitionWork:
    """The compute of one nanobatch overlapped with one collective of the other.

    Attributes:
        ops: the compute ops in execution order.
        collective: the collective in flight, or None for compute alone.
    """

    ops: tuple[OpCost, ...]
    collective: CollectiveCost | None = None


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One knob setting of a partition.

    Attributes:
        freq_mhz: the locked SM clock.
        sm_share: SMs (CTAs) the collective kernel uses.
        launch_slot: index of the op at whose start the collective is launched; None runs the
            collective after the compute, without overlap.
        wait_after: index of the op after which the compute waits for the collective;
            None waits at the end of the partition.
        threads_per_block: threads of each collective CTA (1024 fills one SM).
    """

    freq_mhz: float
    sm_share: int
    launch_slot: int | None = 0
    wait_after: int | None = None
    threads_per_block: int = 1024


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Time and energy of a piece of work on one GPU, and where the numbers come from.

    ``energy_j`` includes static power over ``time_s``; ``dynamic_energy_j`` does not.
    """

    time_s: float
    energy_j: float
    dynamic_energy_j: float
    source: Source
    throttled: bool = False

    @property
    def avg_power_w(self) -> float:
        """Average power over the work."""
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


class Evaluator(Protocol):
    """What the planner asks of a time/energy source (emulator, profiler, recorded replay)."""

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Estimate one partition under one knob setting."""
        ...

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Estimate compute that overlaps nothing (non-partition work) at one clock."""
        ...

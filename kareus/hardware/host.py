"""A model of a CPU host's time for kareus's split decision, where no GPU runs the model.

The split into nanobatches pays only where a collective flies while the other nanobatch
computes. On a CPU the collective library (gloo) runs on threads that share the cores the
compute runs on, so overlapping it hides nothing (measured: two gloo ranks on two cores
gain nothing from overlap; ``../shared/NOTES.md``), while the split still costs its extra
kernels. What a CPU's kernels cost is modelled here as a roofline plus a fixed cost per
kernel, with constants read off the project's machines (2 cores, torch 2.13, Inductor's
C++ kernels, fp32): the model decides whether a split could pay, never a clock, and its
figures are labelled modelled like the GPU's.

A collective on a group that declares its own durations (an emulated group,
:class:`kareus.testing.EmulatedGroup`) takes no compute: the split pricing
(:mod:`kareus.planner.split_pays`) overlaps it with the other nanobatch's kernels.
"""

from __future__ import annotations

import dataclasses

from kareus.ir.costs import CollectiveCost, Estimate, Knobs, OpCost, PartitionWork


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """What a CPU host does per second, for the split decision (all modelled).

    The defaults were read off the project's 2-core machines (2026-12-07, torch 2.13, two
    threads): ``torch.mm`` in fp32 ran at 119-142 GFLOP/s over the per-rank shapes of a TP 8
    layer; an Inductor pointwise kernel moved 3.3-3.9 GB/s; a compiled chain of small
    matmul and ReLU kernels took 9.7 us a pair.

    Attributes:
        name: what the spec stands for.
        gemm_flops: matmul floating-point operations per second (all cores).
        memory_bytes_per_s: bytes a memory-bound kernel moves per second.
        kernel_overhead_s: fixed cost of one kernel (its call from the compiled wrapper,
            thread fork and join).
        collective_latency_s, collective_bytes_per_s: a collective over loopback (gloo):
            a fixed cost and the rate its bytes move at (all-reduce traffic as a ring's).
    """

    name: str = "this CPU (host model: 2 cores, fp32)"
    gemm_flops: float = 120e9
    memory_bytes_per_s: float = 3.5e9
    kernel_overhead_s: float = 5e-6
    collective_latency_s: float = 100e-6
    collective_bytes_per_s: float = 2e9


class HostModel:
    """Time of work on a CPU host (energy is not modelled: reported as 0 J)."""

    source = "modelled"

    def __init__(self, spec: HostSpec | None = None) -> None:
        self.spec = spec or HostSpec()

    def op_time(self, op: OpCost) -> float:
        """Return one kernel's time: the roofline of its FLOPs and bytes, plus its overhead."""
        if op.op_class in ("view", "collective_issue", "collective_wait"):
            return 0.0
        spec = self.spec
        compute = op.flops / spec.gemm_flops if op.op_class in ("gemm", "attention") else 0.0
        return max(compute, op.bytes / spec.memory_bytes_per_s) + spec.kernel_overhead_s

    def collective_time(self, coll: CollectiveCost, knobs: Knobs | None = None) -> float:
        """Return a collective's time over loopback; it runs on the compute's cores."""
        if coll.world_size <= 1:
            return 0.0
        traffic = coll.bytes * (2 if coll.kind == "all_reduce" else 1)
        return self.spec.collective_latency_s + traffic / self.spec.collective_bytes_per_s

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Estimate ops run back to back (the clock does not apply)."""
        t = sum(self.op_time(op) for op in ops)
        return Estimate(t, 0.0, 0.0, "modelled")

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Estimate a partition: its collective shares the cores, so it adds to the compute."""
        t = sum(self.op_time(op) for op in work.ops)
        if work.collective is not None:
            t += self.collective_time(work.collective)
        return Estimate(t, 0.0, 0.0, "modelled")

"""Weights all-gathered in the graph (SimpleFSDP): what overlapping them with the layer
before gains, modelled on an emulated GPU.

A ``kareus.models`` preset without tensor parallelism has each decoder layer's linear
weights sharded over a data-parallel group and all-gathered in the graph, as SimpleFSDP
writes it (a parametrization: ``all_gather_tensor_autograd`` forward, its reduce-scatter
backward). It is traced once under fake tensors in a fake process group of ``--dp`` ranks
(nothing runs: the graphs have the real shapes) and planned for one GPU of the group:
``--microbatches`` forward and backward passes (gradient accumulation, each gathering the
weights again), each layer's gathers and reduce-scatters priced on the GPU's NVLink.
(``kareus plan --dp-mode simplefsdp`` plans a whole configuration so: every parameter
gathered, pipelined, and a group across nodes priced on the network.)

No layer splits (its only collectives are on its weights); kareus overlaps each gather
with the layer before and each reduce-scatter with the layer after
(``cut_partitions``'s windows) and plans their clock, launch slot and SM share.
Megatron-LM and Perseus run the same graphs with every collective alone, as captured. It
prints the partition types, then per method its fastest plan and its least energy no
slower than Megatron-LM's, and kareus's iso-time saving. All times and energies are
modelled (the hardware model); the wall time of tracing and planning is measured.

Run: python benchmarks/simple_fsdp.py [--model llama3.2-1b] [--dp 8] [--layers 16]
     [--microbatch-size 2] [--seq-len 4096] [--microbatches 4] [--gpu a100-40gb]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import parametrize

from kareus.ir.partitions import PartitionSet
from kareus.ir.plan_file import FrontierPoint
from kareus.models.parallel import GatheredInGraph


def shard_layers(layers: Iterable[torch.nn.Module], group: dist.ProcessGroup) -> int:
    """Gather every linear weight of ``layers`` in the graph; return how many."""
    count = 0
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                gathered = GatheredInGraph(group)
                parametrize.register_parametrization(module, "weight", gathered, unsafe=True)
                count += 1
    return count


def trace(args: argparse.Namespace) -> PartitionSet:
    """Trace one forward and backward; return the region's partition set."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import kareus
    from kareus.compiler.backend import find_backend
    from kareus.models import Llama
    from kareus.models.config import preset

    cfg = dataclasses.replace(preset(args.model), num_layers=args.layers)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.dp)
    try:
        torch._dynamo.reset()
        with FakeTensorMode(), torch.device("cpu"):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = Llama(cfg)
            finally:
                torch.set_default_dtype(default)
            world = dist.group.WORLD
            assert world is not None  # (initialised above)
            gathered = shard_layers(model.layers, world)
            ids = torch.zeros((args.microbatch_size, args.seq_len), dtype=torch.long)
            compiled = kareus.compile(
                model,
                disable_passes=("schedule_overlap", "insert_clock_switches"),
                split_when="communicates",  # unpriced: the planner prices it
            )
            compiled(ids, ids).backward()
    finally:
        dist.destroy_process_group()
    backend = find_backend(compiled)
    assert backend is not None
    (region,) = [r for r in backend.regions if r.findings.partitions is not None]
    print(f"{gathered} weights gathered in the graph per pass ({args.layers} layers)")
    pset: PartitionSet = region.findings.partitions
    return pset


def points(front: Sequence[FrontierPoint]) -> list[tuple[float, float]]:
    """(time, energy) of each point of a frontier."""
    return [(p.time_s, p.energy_j) for p in front]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel (sharding) degree")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers traced")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--gpu", default="a100-40gb")
    args = parser.parse_args()

    from kareus.hardware import gpu
    from kareus.planner import Parallelism, plan_for_gpu
    from kareus.planner.pareto import iso_time_energy_reduction

    start = time.perf_counter()
    pset = trace(args)
    traced = time.perf_counter() - start
    print(pset.to_text())
    spec = gpu(args.gpu)
    start = time.perf_counter()
    result = plan_for_gpu(pset, spec, parallel=Parallelism(microbatches=args.microbatches))
    planned = time.perf_counter() - start
    plan = result.plan
    fronts = {"kareus": plan.frontier, **plan.baselines}
    megatron = min(p.time_s for p in plan.baselines["megatron"])
    print(f"\n{args.model}, {args.layers} layers, DP {args.dp} on {spec.name}, micro-batches of "
          f"{args.microbatch_size} x {args.seq_len}, {args.microbatches} per iteration "
          "(modelled)")  # fmt: skip
    print(f"{'method':<20} {'fastest s':>10} {'its J':>10} {'least J within Megatron-LM s':>30}")
    for name, pts in fronts.items():
        fast = min(pts, key=lambda p: p.time_s)
        within = [p.energy_j for p in pts if p.time_s <= megatron * (1 + 1e-9)]
        least = f"{min(within):.1f}" if within else "-"
        print(f"{name:<20} {fast.time_s:>10.4f} {fast.energy_j:>10.1f} {least:>30}")
    for base in ("megatron", "perseus"):
        saving = iso_time_energy_reduction(points(plan.frontier), points(plan.baselines[base]))
        shown = "-" if saving is None else f"{saving:.1%}"
        print(f"kareus's iso-time saving over {base}: {shown} (modelled)")
    print(f"tracing {traced:.0f} s, planning {planned:.0f} s (measured)")


if __name__ == "__main__":
    main()

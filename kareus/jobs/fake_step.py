"""One step of a pipeline stage under fake tensors: the model built, compiled and run.

What :func:`kareus.jobs.trace.trace_stage` runs for each stage it traces: a preset of
:mod:`kareus.models` (SimpleFSDP-gathered over a DP group when there is one), or a model
source's own build (:mod:`kareus.models.sources`), compiled with the analysis passes only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kareus.compiler.config import GRAPHS
from kareus.jobs.workload_spec import DTYPES, Workload
from kareus.models.llama import Llama
from kareus.models.moe import set_planned_load
from kareus.models.parallel import gather_in_graph
from kareus.models.sources import FactoryModel, HFModel, StepInputs, step_loss
from kareus.passes.blocks import BlockSet


def run_stage(
    work: Workload,
    stage: int,
    layers: int,
    groups: tuple[Any, ...],
    mesh: Any,
    device: str,
    nanobatches: int,
    extract: bool,
) -> Any:
    """Build the stage under fake tensors and run one compiled step; return the compiled."""
    import kareus
    from kareus._torch_internals import fake_tensor_mode_type

    dp_group = groups[2] if len(groups) > 2 else None
    with fake_tensor_mode_type()(), torch.device(device):
        model, inputs = _build_stage(work, stage, layers, groups, mesh)
        compiled = kareus.compile(
            model,
            disable_passes=("schedule_overlap", "insert_clock_switches"),
            # 2: what is planned, collectives or not; under SimpleFSDP compile's own choice
            # (a block whose only collectives gather its weights stays whole, and the
            # gathers overlap the compute before them)
            nanobatches=None if nanobatches == 2 and dp_group is not None else nanobatches,
            split_when="communicates",  # unpriced: the planner prices split and whole itself
            extract_partitions=extract,
            gpus_per_node=work.gpus_per_node,
            # Fake tensors: the analysis passes run, Inductor generates nothing. The
            # kernels priced are the fused ones kareus.compile's default codegen runs.
            codegen="python",
            fuse_memory_ops=True,
            **GRAPHS[work.graphs],  # recorded in the plan: applying it runs the same
        )
        out = step_loss(compiled(*inputs.args, **inputs.kwargs))
        out.backward(torch.ones_like(out))
    return compiled


def _build_stage(
    work: Workload, stage: int, layers: int, groups: tuple[Any, ...], mesh: Any
) -> tuple[torch.nn.Module, StepInputs]:
    """Build ``layers`` layers of the stage and one step's inputs (under fake tensors)."""
    dtype = DTYPES[work.dtype]
    tp_group, cp_group, *rest = groups
    dp_group = rest[0] if rest else None
    ep_group = rest[1] if len(rest) > 1 else None
    local_seq = work.seq_len // work.cp
    if isinstance(work.model, (HFModel, FactoryModel)):
        return work.model.build(
            layers=layers,
            tp_mesh=mesh,
            microbatch_size=work.microbatch_size,
            seq_len=local_seq,
            dtype=dtype,
        )
    cfg = dataclasses.replace(work.config, num_layers=layers * work.stages)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Llama(cfg, tp_group, cp_group, stage=(stage, work.stages), ep_group=ep_group)
    finally:
        torch.set_default_dtype(default)
    # Fake tensors carry no routing. Under expert parallelism the all-to-alls' sizes are the
    # expected load's (planned); with every expert on each rank the layer keeps its counts as
    # tensors (its grouped GEMMs' FLOPs are the copies', whatever the load), and its routing
    # can be proven per token, so its blocks can be split as the run would split them.
    if work.ep > 1:
        set_planned_load(model, work.microbatch_size * local_seq, work.expert_skew)
    if dp_group is not None:
        gather_in_graph(model, dp_group)
    shape = (work.microbatch_size, local_seq)
    ids = torch.zeros(shape, dtype=torch.long)
    x = ids if model.first else torch.zeros(*shape, cfg.hidden_size, dtype=dtype)
    x.requires_grad_(x.is_floating_point())
    return model, StepInputs(args=(x, ids if model.last else None))


def block_notes(blocks: BlockSet, work: Workload, stage: int) -> list[str]:
    """Say what a stage's blocks were not split for, and which were split along the sequence."""
    notes = []
    if blocks.skipped:
        why = next(iter(blocks.skipped.values()))
        if work.shape is not None and work.shape.num_experts and work.ep > 1:
            why = (
                "mixture-of-experts blocks under expert parallelism are planned whole (the "
                "all-to-alls' sizes are the planned load's constants; proving a routing "
                "across an all-to-all is not built): clocks and each all-to-all are planned, "
                "as Perseus would"
            )
        notes.append(
            f"stage {stage}: {len(blocks.skipped)} of {len(blocks.blocks)} blocks left whole: {why}"
        )
    along = [b for b, a in blocks.split_along.items() if a == "sequence"]
    if along:
        notes.append(
            f"stage {stage}: {len(along)} of {len(blocks.blocks)} blocks split along the "
            f"sequence (micro-batches of {work.microbatch_size} cannot be halved): the later "
            "half's attention reads the earlier half's keys and values"
        )
    return notes

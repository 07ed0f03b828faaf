"""Pipeline x tensor-parallel training with torch.distributed.pipelining, compiled by kareus.

The job is laid out the way torchtitan lays it out: a device mesh (pp, tp), each pipeline
stage a slice of the model's layers whose linear layers are split across its TP group. Each
stage module is compiled by kareus with a plan made for this very configuration by
`kareus plan` (run by rank 0 first if no --plan is given); `ScheduleGPipe`,
`Schedule1F1B` or `ScheduleInterleaved1F1B`... runs the micro-batches, and kareus gives every
instruction (stage, micro-batch, forward or backward) the clock the plan chose for it,
overlapping each TP collective with the other nanobatch's compute where the plan splits the
layers (for this tiny model it finds that splitting does not pay: its plan runs the layers
whole, clocks only; a plan for a larger model splits them).

On CPU it runs over gloo with the emulated GPU (clocks recorded, energy modelled); on GPUs
over NCCL, with Zeus controlling the clocks where the process may, and measuring energy.

Run: torchrun --nproc-per-node 4 examples/train_pipeline.py [--tp 2] [--steps N]
"""

import argparse
import os
import pathlib
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import kareus
from kareus.models import PRESETS, Llama
from kareus.models.parallel import vocab_parallel_cross_entropy

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
parser.add_argument("--gpu", default="a100-40gb", help="GPU type the plan is made for")
parser.add_argument("--plan", help="a plan.json for this configuration (else planned now)")
parser.add_argument("--out", default="kareus-pipeline", help="where the plan is written")
parser.add_argument(
    "--solver-work", default="1.0", help="kareus plan's CP-SAT work per solve (less: sooner)"
)
parser.add_argument(
    "--clocks", help="kareus plan's clocks, MHz, comma-separated (default: its own)"
)
args = parser.parse_args()

MICROBATCHES, MB_SIZE, SEQ = 4, 4, 32
world = int(os.environ["WORLD_SIZE"])
pp = world // args.tp
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank
device = torch.device("cuda") if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
try:
    mesh = init_device_mesh(device.type, (pp, args.tp), mesh_dim_names=("pp", "tp"))
    stage_index = mesh.get_local_rank("pp")
    tp_group = mesh.get_group("tp") if args.tp > 1 else None

    # The plan: made once, by rank 0, for exactly this model, shape and layout.
    plan_path = args.plan
    if plan_path is None:
        out = pathlib.Path(args.out)
        plan_path = str(out / "plan.json")
        if rank == 0:
            command = [sys.executable, "-m", "kareus.cli", "plan", "--model", "tiny-4l"]
            command += ["--gpu", args.gpu, "--tp", str(args.tp), "--pp", str(pp)]
            command += ["--microbatches", str(MICROBATCHES), "--microbatch-size", str(MB_SIZE)]
            command += ["--seq-len", str(SEQ), "--dtype", "fp32", "--out", str(out), "--quiet"]
            command += ["--solver-work", args.solver_work]
            command += ["--clocks", args.clocks] if args.clocks else []
            subprocess.run(
                command,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        dist.barrier()

    torch.manual_seed(0)  # the same initial weights on every rank of a TP group
    stage_model = Llama(PRESETS["tiny-4l"], tp_group=tp_group, stage=(stage_index, pp)).to(device)
    stage_model = kareus.compile(stage_model, plan=plan_path, stage=stage_index, schedule="1F1B")
    stage = PipelineStage(stage_model, stage_index, pp, device, group=mesh.get_group("pp"))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if tp_group is None:
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        start = mesh.get_local_rank("tp") * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, labels, start, tp_group).mean()

    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_model.parameters(), lr=1e-2)
    data = torch.randint(0, 128, (args.steps, MICROBATCHES * MB_SIZE, SEQ + 1))
    data = data.to(device)
    for step in range(args.steps):
        ids, labels = data[step, :, :-1], data[step, :, 1:]
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(ids, target=labels, losses=losses)
        else:
            schedule.step(target=labels, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            mean = torch.stack([v.detach() for v in losses]).mean()
            print(f"[rank {rank}] step {step}: loss {mean.item():.4f}", flush=True)

    runtime = kareus.compiler.backend.find_backend(stage_model).runtime
    applied = [(s, k, m, f) for it, s, k, m, f in runtime.applied if it == 0]
    for turn in range(world):  # one rank at a time, so that lines never interleave
        if turn == rank:
            print(
                f"[rank {rank}] stage {stage_index}, TP rank {mesh.get_local_rank('tp')}: "
                "instructions of iteration 0 (stage, kind, micro-batch, MHz): "
                + ", ".join(f"{s}/{k[0].upper()}{m}@{f:g}" for s, k, m, f in applied),
                flush=True,
            )
            if rank == world - 1:
                print(kareus.explain(stage_model).summary(), flush=True)
        dist.barrier()
finally:
    dist.destroy_process_group()

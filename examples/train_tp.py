"""Tensor-parallel training over gloo on CPU, compiled by kareus.

Each rank holds half of every layer (Megatron-style); kareus splits the layers into
nanobatches, overlaps each all-reduce with the other nanobatch's compute, and plans clocks
and overlap for the named GPU type with its hardware model (figures modelled).

Run: torchrun --nproc-per-node 2 examples/train_tp.py [--steps N] [--layers N] [--gpu a100-40gb]
"""

import argparse
import dataclasses

import torch
import torch.distributed as dist

import kareus
from kareus.models import PRESETS, Llama

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--layers", type=int, default=4, help="decoder layers (tiny Llama)")
parser.add_argument("--gpu", default="a100-40gb", help="GPU type to plan for")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
try:
    torch.manual_seed(0)  # the same initial weights on every rank
    config = dataclasses.replace(PRESETS["tiny-4l"], num_layers=args.layers)
    model = Llama(config, tp_group=dist.group.WORLD)
    energy = []
    # On a GPU leave split_when at its default ("pays": split where the cost model predicts a
    # faster step); over gloo on a CPU the split never pays, and this example shows it made.
    model = kareus.compile(
        model, gpu=args.gpu, on_iteration=energy.append, split_when="communicates"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 128, (2, 8, 33), generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        ids = data[step % 2]
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(kareus.explain(model).summary())
        for it in energy:
            print(f"iteration {it.iteration}: {it.energy_j:.4f} J per GPU ({it.source})")
finally:
    dist.destroy_process_group()

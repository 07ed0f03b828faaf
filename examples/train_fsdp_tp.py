"""FSDP2 + tensor parallelism on a (dp, tp) mesh, compiled block by block: torchtitan's layout.

Each transformer block is tensor-parallel over the mesh's "tp" dimension (DTensor's
ColwiseParallel / RowwiseParallel), compiled on its own with ``kareus.compile`` (where
torchtitan calls ``torch.compile``), then sharded over "dp" with ``fully_shard``. kareus takes
each block's region as one block: it splits it into two nanobatches and overlaps each TP
all-reduce with the other nanobatch's compute. Clocks are planned per block for the named
GPU type with the hardware model (figures modelled) and, as always unless asked, not
applied (dry run).

Run (4 processes, gloo on CPU): torchrun --nproc-per-node 4 examples/train_fsdp_tp.py
    [--steps N] [--layers N] [--tp N] [--gpu a100-40gb]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import kareus


class Block(nn.Module):
    """A pre-norm transformer block: causal attention, then a SwiGLU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attn_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: under TP each rank holds heads / tp of them
        q, k, v = (
            w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


TP_PLAN = {
    **{w: ColwiseParallel() for w in ("wq", "wk", "wv", "w1", "w3")},
    **{w: RowwiseParallel() for w in ("wo", "w2")},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (dp = world / tp)")
    parser.add_argument("--gpu", default="a100-40gb", help="GPU type kareus plans for")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = Model(vocab=128, dim=32, heads=4, layers=args.layers)
        for i, block in enumerate(model.layers):
            parallelize_module(block, mesh["tp"], TP_PLAN)
            # where torch.compile goes; on a GPU leave split_when at its default ("pays"):
            # over gloo on a CPU the split never pays, and this example shows it made
            model.layers[i] = kareus.compile(block, gpu=args.gpu, split_when="communicates")
            fully_shard(model.layers[i], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # each data-parallel rank reads its own batches; the ranks of one TP group the same
        gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
        for step in range(args.steps):
            ids = torch.randint(0, 128, (4, 17), generator=gen)
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} step {step}: loss {loss.item():.4f}", flush=True)
        if rank == 0:
            for i, block in enumerate(model.layers):
                for region in kareus.explain(block).regions:
                    blocks = region.findings.blocks
                    pset = region.findings.partitions
                    print(
                        f"block {i}: split {blocks.split or 'none'}, "
                        f"{len(pset.partitions)} partitions (collective beside compute)"
                    )
            print(kareus.explain(model.layers[0]).summary())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

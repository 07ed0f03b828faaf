"""kareus on the process layouts real jobs use: TP × DP, TP × CP × DP, TP × PP × DP.

Every test runs real gloo processes (4 or 8), builds the layout the way jobs do (torchtitan's
``init_device_mesh``, or plain ``new_group`` calls), and checks losses and gradients against
the same job without kareus. A rank that hangs dumps its stack and fails the test.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus import Decision
from kareus.models import Llama, LlamaConfig
from kareus.testing import run_ranks, token_batches

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

CFG = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def layout(rank, sizes, how):
    """This rank's groups in a (pp, dp, cp, tp) layout, TP innermost (torchtitan's order).

    ``how`` is "mesh" (``init_device_mesh``) or "new_group" (every rank creates every group).
    """
    names = ("pp", "dp", "cp", "tp")
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
        return {n: mesh.get_group(n) for n in names}, mesh
    world = dist.get_world_size()
    grid = torch.arange(world).reshape(tuple(sizes[n] for n in names))
    groups = {}
    for axis, n in enumerate(names):
        lines = grid.movedim(axis, -1).reshape(-1, sizes[n])
        for line in lines.tolist():  # every rank creates every group, in the same order
            g = dist.new_group(line)
            if rank in line:
                groups[n] = g
    return groups, None


def _dp_step(model, opt, dp_group):
    for p in model.parameters():
        if p.grad is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dist.get_world_size(dp_group)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _grads(model):
    return {
        n.removeprefix("_orig_mod."): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _tp_dp_cp(rank, sizes, how, decisions):
    """Train eager and kareus-compiled copies of one TP (× CP) Llama per DP rank."""
    groups, _mesh = layout(rank, sizes, how)
    torch.manual_seed(0)
    eager = Llama(
        CFG,
        tp_group=groups["tp"],
        cp_group=groups["cp"] if sizes["cp"] > 1 else None,
    )
    compiled = kareus.compile(copy.deepcopy(eager), decisions=decisions, strict=True)
    dp_rank = dist.get_rank(groups["dp"])
    cp_rank = dist.get_rank(groups["cp"])
    seq = 16 // sizes["cp"]
    out = {"losses": ([], []), "grads": ([], [])}
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled)]
    for step in range(2):
        ids, labels = token_batches(1, 4, 16, 128, seed=10 * step + dp_rank)[0]
        ids = ids[:, cp_rank * seq : (cp_rank + 1) * seq]
        labels = labels[:, cp_rank * seq : (cp_rank + 1) * seq]
        for i, (model, opt) in enumerate(zip((eager, compiled), opts, strict=True)):
            loss = model(ids, labels)
            loss.backward()
            out["losses"][i].append(loss.detach().clone())
            out["grads"][i].append(_grads(model))
            _dp_step(model, opt, groups["dp"])
    report = kareus.explain(compiled)
    return out, report.summary(), report.regions[0].findings["find_blocks"].split


def _check_same(results):
    for rank, (out, summary, split) in enumerate(results):
        assert split, f"rank {rank}: no block was split\n{summary}"
        eager_losses, kareus_losses = out["losses"]
        for a, b in zip(eager_losses, kareus_losses, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank} loss")
        for ga, gb in zip(*out["grads"], strict=True):
            assert ga.keys() == gb.keys()
            for name in ga:
                torch.testing.assert_close(
                    gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}"
                )


TWO_SHARES = {"*": Decision(0, 4)}


@pytest.mark.parametrize("how", ["mesh", "new_group"])
def test_tp_dp_with_sm_share_trains_like_eager(how):
    # Two TP groups ({0,1} and {2,3}) create their SM-share communicators independently.
    sizes = {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    results = run_ranks(_tp_dp_cp, sizes, how, TWO_SHARES, world=4, timeout_s=150)
    _check_same(results)
    for rank, (_out, summary, _split) in enumerate(results):
        mine = [0, 1] if rank < 2 else [2, 3]
        assert f"ranks {mine}: SM share 4" in summary, summary

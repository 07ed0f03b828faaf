"""kareus on the process layouts real jobs use: TP × DP, TP × CP × DP, TP × PP × DP.

Every test runs real gloo processes (4 or 8), builds the layout the way jobs do (torchtitan's
``init_device_mesh``, or plain ``new_group`` calls), and checks losses and gradients against
the same job without kareus. A rank that hangs dumps its stack and fails the test.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus import Decision
from kareus.models import Llama, LlamaConfig
from kareus.testing import blocks_run, run_ranks, token_batches

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


class TPCPNet(torch.nn.Module):
    """Blocks that all-gather the sequence over the CP group (as attention gathers K and V)
    and run a Megatron MLP over the TP group: every collective kind of a TP x CP layer, at
    a fraction of a Llama's compile time."""

    def __init__(self, tp_group, cp_group, width=16, layers=2):
        super().__init__()
        from kareus.models.parallel import ColumnParallelLinear, RowParallelLinear, group_name

        torch.manual_seed(0)
        self.cp = group_name(cp_group)
        self.up = torch.nn.ModuleList(
            ColumnParallelLinear(width, 2 * width, tp_group) for _ in range(layers)
        )
        self.down = torch.nn.ModuleList(
            RowParallelLinear(2 * width, width, tp_group) for _ in range(layers)
        )

    def forward(self, x, labels):
        from kareus.models.parallel import gather_from_sp

        for up, down in zip(self.up, self.down, strict=True):
            mix = gather_from_sp(x, self.cp, dim=1).mean(dim=1, keepdim=True)
            x = x + down(torch.tanh(up(x + mix)))
        return ((x - labels) ** 2).mean()


def _tp_dp_cp(rank, sizes, how, decisions, net="llama"):
    """Train eager and kareus-compiled copies of one TP (x CP) model per DP rank."""
    groups, _mesh = layout(rank, sizes, how)
    torch.manual_seed(0)
    if net == "llama":
        eager = Llama(
            CFG,
            tp_group=groups["tp"],
            cp_group=groups["cp"] if sizes["cp"] > 1 else None,
        )
    else:
        eager = TPCPNet(groups["tp"], groups["cp"])
    compiled = kareus.compile(copy.deepcopy(eager), decisions=decisions, strict=True)
    dp_rank = dist.get_rank(groups["dp"])
    cp_rank = dist.get_rank(groups["cp"])
    seq = 16 // sizes["cp"]
    out = {"losses": ([], []), "grads": ([], [])}
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled)]
    for step in range(2):
        ids, labels = token_batches(1, 4, 16, 128, seed=10 * step + dp_rank)[0]
        if net != "llama":
            gen = torch.Generator().manual_seed(10 * step + dp_rank)
            ids, labels = torch.randn(4, 16, 16, generator=gen), torch.randn(4, 16, 16)
        ids = ids[:, cp_rank * seq : (cp_rank + 1) * seq]
        labels = labels[:, cp_rank * seq : (cp_rank + 1) * seq]
        for i, (model, opt) in enumerate(zip((eager, compiled), opts, strict=True)):
            loss = model(ids, labels)
            loss.backward()
            out["losses"][i].append(loss.detach().clone())
            out["grads"][i].append(_grads(model))
            _dp_step(model, opt, groups["dp"])
    report = kareus.explain(compiled)
    return out, report.summary(), blocks_run(report.regions[0]).split


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


@pytest.mark.parametrize(("how", "net"), [("mesh", "mlp")])
def test_tp_dp_with_sm_share_trains_like_eager(how, net):
    # Two TP groups ({0,1} and {2,3}) create their SM-share communicators independently.
    # (The new_group layout, four TP groups, runs in the TP x CP x DP test below.)
    sizes = {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    results = run_ranks(_tp_dp_cp, sizes, how, TWO_SHARES, net, world=4, timeout_s=150)
    _check_same(results)
    for rank, (_out, summary, _split) in enumerate(results):
        mine = [0, 1] if rank < 2 else [2, 3]
        assert f"ranks {mine}: SM share 4" in summary, summary


def _pool_in_compiler_state(rank, shares):
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kareus.runtime.comm_pool import CommunicatorPool

    seen = []
    gather = dist.all_gather_object

    def recording(*args, **kwargs):
        key = torch._C.DispatchKey.PythonDispatcher
        seen.append(torch._C._dispatch_tls_is_dispatch_key_included(key))
        return gather(*args, **kwargs)

    dist.all_gather_object = recording
    pool = CommunicatorPool()
    try:
        # The state a compiler pass runs in: AOTAutograd's fake mode and Python dispatcher.
        with FakeTensorMode(), enable_python_dispatcher():
            names = [pool.group_name(dist.group.WORLD.group_name, s) for s in range(1, shares)]
    finally:
        dist.all_gather_object = gather
    return names, seen


def test_share_groups_are_created_outside_the_compilers_python_dispatcher():
    # Under the Python dispatcher a gloo collective deadlocks at random (the caller holds the
    # GIL waiting for gloo's queue; gloo's worker holds the queue freeing tensors, which needs
    # the GIL): examples/train_tp.py hung in CI so. A dozen groups, and the state checked.
    results = run_ranks(_pool_in_compiler_state, 13, world=2, timeout_s=60)
    (names, seen), (other, _) = results
    assert names == other and len(set(names)) == 12
    assert len(seen) == 12 and not any(seen)


@pytest.mark.slow  # CI's sample leaves it out: 8 ranks; the TP x PP x DP one stays in CI
def test_tp_cp_dp_on_eight_ranks_trains_like_eager():
    sizes = {"pp": 1, "dp": 2, "cp": 2, "tp": 2}
    results = run_ranks(_tp_dp_cp, sizes, "new_group", TWO_SHARES, "mlp", world=8, timeout_s=300)
    _check_same(results)
    for rank, (_out, summary, _split) in enumerate(results):
        tp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert f"ranks {tp_ranks}: SM share 4" in summary, summary


class TPStage(torch.nn.Module):
    """A pipeline stage of two Megatron MLP blocks split over a TP group (cheap to compile)."""

    def __init__(self, tp_group, seed, width=16):
        super().__init__()
        from kareus.models.parallel import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "up": ColumnParallelLinear(width, 2 * width, tp_group),
                    "down": RowParallelLinear(2 * width, width, tp_group),
                }
            )
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block["down"](torch.tanh(block["up"](x)))
        return x


def _tp_pp_dp(rank, how):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction
    from kareus.runtime.clocks import EmulatedClocks

    sizes = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    groups, _mesh = layout(rank, sizes, how)
    pp_rank, dp_rank = dist.get_rank(groups["pp"]), dist.get_rank(groups["dp"])
    micro = 4
    order = {  # 1F1B on two stages
        0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    }
    kinds = {"F": "forward", "B": "backward"}

    def clock(s, k, m):
        return 1410 - 15 * (8 * s + 4 * (k == "backward") + m)

    sched = tuple(
        ScheduledInstruction(s, kinds[a[0]], int(a[1:]), clock(s, kinds[a[0]], int(a[1:])))
        for s in (0, 1)
        for a in order[s]
    )
    plan = Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 2, "cp": 1, "pp": 2, "microbatches": micro},
        frontier=(FrontierPoint(1.0, 1.0),),
        chosen=FrontierPoint(1.0, 1.0),
        schedule=sched,
        decisions={},
        baselines={},
    )
    clocks = EmulatedClocks()
    results = {}
    for label in ("eager", "kareus"):
        mod = TPStage(groups["tp"], seed=pp_rank)
        if label == "kareus":
            mod = kareus.compile(
                mod, plan=plan, stage=pp_rank, clocks=clocks, decisions=TWO_SHARES, strict=True
            )
        stage = PipelineStage(mod, pp_rank, 2, torch.device("cpu"), group=groups["pp"])
        schedule = Schedule1F1B(
            stage, n_microbatches=micro, loss_fn=lambda out, t: ((out - t) ** 2).mean()
        )
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        losses, grads = [], []
        for step in range(2):
            gen = torch.Generator().manual_seed(10 * step + dp_rank)
            x, target = torch.randn(micro * 4, 16, generator=gen), torch.randn(micro * 4, 16)
            out = []
            if pp_rank == 0:
                schedule.step(x, target=target, losses=out)
            else:
                schedule.step(target=target, losses=out)
            losses.append([v.detach() for v in out])
            grads.append(_grads(mod))
            _dp_step(mod, opt, groups["dp"])
        results[label] = (losses, grads)
    runtime = kareus.compiler.backend.find_backend(mod).runtime
    applied = [(s, k, m, f) for _it, s, k, m, f in runtime.applied]
    runtime.close()
    return results, applied, [clock(s, k, m) for _it, s, k, m, _f in runtime.applied]


def test_tp_pp_dp_on_eight_ranks_with_pipelining():
    for rank, (results, applied, planned) in enumerate(
        run_ranks(_tp_pp_dp, "mesh", world=8, timeout_s=300)
    ):
        (el, eg), (kl, kg) = results["eager"], results["kareus"]
        for a, b in zip(el, kl, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses")
        for ga, gb in zip(eg, kg, strict=True):
            for name in ga:
                torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6)
        assert len(applied) == 2 * 8  # two iterations of 4 forwards and 4 backwards
        assert [f for *_x, f in applied] == planned


def _wrong_tp_plan(rank):
    from kareus.errors import PlanMismatchError
    from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction
    from kareus.runtime.clocks import EmulatedClocks

    plan = Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 4, "cp": 1, "pp": 1, "microbatches": 1},
        frontier=(FrontierPoint(1.0, 1.0),),
        chosen=FrontierPoint(1.0, 1.0),
        schedule=(
            ScheduledInstruction(0, "forward", 0, 1410),
            ScheduledInstruction(0, "backward", 0, 1410),
        ),
        decisions={},
        baselines={},
    )
    model = kareus.compile(TPStage(dist.group.WORLD, seed=0), plan=plan, clocks=EmulatedClocks())
    try:
        model(torch.randn(4, 16)).sum().backward()
    except PlanMismatchError as err:  # raised as is, not wrapped in Dynamo's error
        return str(err)
    return None


def test_a_plan_for_another_tp_size_is_refused_naming_both():
    for message in run_ranks(_wrong_tp_plan, world=2):
        assert message is not None, "the TP 4 plan was applied to a TP 2 model"
        assert "made for TP 4 x CP 1" in message and "sizes 2 (ranks 0,1)" in message
        assert "--tp 2" in message


def _environment(rank):
    return os.environ.get("KAREUS_TEST_MARK"), os.getcwd(), os.environ["RANK"]


def test_ranks_see_the_callers_environment_and_directory(monkeypatch, tmp_path):
    # Ranks fork from a server started at the first run: each run must still give them the
    # caller's environment and directory of the moment, as spawned processes would have.
    monkeypatch.chdir(tmp_path)
    for mark in ("first", "second"):
        monkeypatch.setenv("KAREUS_TEST_MARK", mark)
        got = run_ranks(_environment, world=2)
        assert got == [(mark, str(tmp_path), "0"), (mark, str(tmp_path), "1")]
    monkeypatch.delenv("KAREUS_TEST_MARK")
    assert [m for m, _, _ in run_ranks(_environment, world=2)] == [None, None]

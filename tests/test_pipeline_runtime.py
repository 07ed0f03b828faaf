"""Each instruction gets its own planned clock under torch.distributed.pipelining.

Stage modules compiled by kareus run under ``Schedule1F1B``, ``ScheduleGPipe`` and
``ScheduleInterleaved1F1B`` on gloo. Which micro-batch a stage is working on is read from the
data, not from kareus: every input row carries its micro-batch index, and every stage has a
probe parameter whose gradient is non-zero only at that index. Hooks record the clock in
effect when each forward finishes and when each backward's gradients arrive; every record
must hold the plan's clock for (stage, kind, micro-batch).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kareus
from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction
from kareus.runtime.clocks import EmulatedClocks
from kareus.testing import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WIDTH, MICRO, ROWS = 8, 4, 2


class ProbeStage(nn.Module):
    """Two residual tanh layers; the last input column is the micro-batch index, kept."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.probe = nn.Parameter(torch.zeros(MICRO))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mb = x[:, :-1], x[:, -1:]
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        onehot = (mb == torch.arange(MICRO, dtype=x.dtype)).to(x.dtype)
        h = h + (onehot * self.probe).sum(-1, keepdim=True)
        return torch.cat([h, mb], dim=-1)


def freq_of(stage, kind, mb):
    """A distinct clock for every instruction."""
    return 1410 - 15 * (stage * 2 * MICRO + (kind == "backward") * MICRO + mb)


def stage_order(name, stage, stages):
    """Per-stage (kind, micro-batch) order of torch's schedule ``name``."""
    if name == "GPipe":
        return [("forward", m) for m in range(MICRO)] + [("backward", m) for m in range(MICRO)]
    if name == "1F1B":
        warm = min(stages - stage - 1, MICRO)
        seq, f = [("forward", m) for m in range(warm)], warm
        for b in range(MICRO):
            if f < MICRO:
                seq.append(("forward", f))
                f += 1
            seq.append(("backward", b))
        return seq
    return None  # interleaved: taken from torch's own pipeline order


def make_plan(name, stages, orders=None):
    sched = []
    for s in range(stages):
        order = orders[s] if orders else stage_order(name, s, stages)
        sched += [
            ScheduledInstruction(s, k, m, freq_of(s, k, m), time_s=0.01, dynamic_energy_j=1.0)
            for k, m in order
        ]
    return Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 1, "pp": stages, "microbatches": MICRO},
        frontier=(FrontierPoint(1.0, 100.0),),
        chosen=FrontierPoint(1.0, 100.0),
        schedule=tuple(sched),
        decisions={},
        baselines={},
        static_power_w=80.0,
        pipeline_schedule=name,
    )


def _run_pipeline(rank, run_name, plan_name, virtual):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    world = dist.get_world_size()
    stages_total = world * virtual
    mine = [rank + world * v for v in range(virtual)]
    clocks = EmulatedClocks()
    records = []
    eager_mods = {s: ProbeStage(seed=s) for s in mine}

    def build(plan):
        mods, pipes = {}, []
        for s in mine:
            mod = ProbeStage(seed=s)
            mod.load_state_dict(eager_mods[s].state_dict())
            if plan is not None:
                mod = kareus.compile(mod, plan=plan, stage=s, clocks=clocks, nanobatches=1)

                def after_forward(_m, args, _out, s=s):
                    if not _shape_run():
                        records.append((s, "forward", int(args[0][0, -1]), clocks.current))

                def probe_grad(grad, s=s):
                    if not _shape_run():
                        mb = int(torch.nonzero(grad)[0, 0])
                        records.append((s, "backward", mb, clocks.current))

                mod.register_forward_hook(after_forward)
                mod._orig_mod.probe.register_hook(probe_grad)
            mods[s] = mod
            pipes.append(PipelineStage(mod, s, stages_total, torch.device("cpu")))
        return mods, pipes

    def loss_fn(out, target):
        return ((out[:, :-1] - target) ** 2).mean()

    kinds = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": None}
    results = {}
    orders = None
    for label in ("eager", "kareus"):
        plan = None
        if label == "kareus":
            plan = make_plan(plan_name, stages_total, orders)
        mods, pipes = build(plan)
        if virtual > 1:
            schedule = ScheduleInterleaved1F1B(pipes, n_microbatches=MICRO, loss_fn=loss_fn)
            if orders is None:  # every stage's (kind, micro-batch) order in torch's schedule
                orders = _torch_orders(schedule, stages_total)
        else:
            schedule = kinds[run_name](pipes[0], n_microbatches=MICRO, loss_fn=loss_fn)
        losses = []
        for step in range(2):
            torch.manual_seed(100 + step)
            x = torch.randn(MICRO * ROWS, WIDTH)
            x = torch.cat([x, torch.arange(MICRO).repeat_interleave(ROWS)[:, None].float()], -1)
            target = torch.randn(MICRO * ROWS, WIDTH)
            step_losses = []
            if 0 in mine:
                schedule.step(x, target=target, losses=step_losses)
            elif stages_total - 1 in mine:
                schedule.step(target=target, losses=step_losses)
            else:
                schedule.step()
            losses.append([float(v.detach()) for v in step_losses])
        grads = {
            s: {
                n.removeprefix("_orig_mod."): p.grad.clone()
                for n, p in m.named_parameters()
                if p.grad is not None
            }
            for s, m in mods.items()
        }
        results[label] = (losses, grads)
    runtime = kareus.compiler.backend.find_backend(mods[mine[0]]).runtime
    for s in mine[1:]:
        assert (
            kareus.compiler.backend.find_backend(mods[s]).runtime is runtime
        )  # one runtime per GPU
    applied, notes = list(runtime.applied), list(runtime.notes)
    text = kareus.explain(mods[mine[0]]).summary()
    runtime.close()
    return records, results, applied, notes, text, orders


def _shape_run():
    """Whether torch's pipeline stage is running its module for shapes only (CPU: one thread)."""
    import inspect

    return any("metadata_inference" in f.function for f in inspect.stack(context=0))


def _torch_orders(schedule, stages):
    orders = {s: [] for s in range(stages)}
    for actions in schedule.pipeline_order.values():
        for a in actions:
            if a is None:
                continue
            kind = {"F": "forward", "B": "backward"}.get(a.computation_type.value)
            if kind is not None:
                orders[a.stage_index].append((kind, a.microbatch_index))
    return orders


def _check(results_per_rank, expect_warning):
    for rank, (records, results, applied, notes, text, _orders) in enumerate(results_per_rank):
        # Every instruction of both iterations ran once, at its planned clock (read from the
        # emulated GPU as each ran); a run that recorded nothing proves nothing.
        assert {k for _s, k, _m, _f in records} == {"forward", "backward"}, records
        assert len(records) == len({(s, k, m) for s, k, m, _f in records}) * 2, records
        for s, k, m, f in records:
            assert f == freq_of(s, k, m), f"rank {rank}: stage {s} {k} {m} ran at {f}"
        assert [a[1:4] for a in applied[: len(applied) // 2]] == [
            a[1:4] for a in applied[len(applied) // 2 :]
        ]
        # kareus changes clocks, not results.
        (el, eg), (kl, kg) = results["eager"], results["kareus"]
        assert el == kl, f"rank {rank} losses"
        for s in eg:
            for n in eg[s]:
                assert torch.equal(eg[s][n], kg[s][n]), f"rank {rank} stage {s} grad {n}"
        assert bool([n for n in notes if "order" in n]) == expect_warning, notes
        assert "per iteration (MHz)" in text


@pytest.mark.parametrize(
    ("run_name", "plan_name", "warns"),
    [("1F1B", "1F1B", False), ("GPipe", "GPipe", False), ("GPipe", "1F1B", True)],
)
def test_pipeline_schedules_get_each_instruction_its_clock(run_name, plan_name, warns):
    _check(run_ranks(_run_pipeline, run_name, plan_name, 1, world=2), warns)


def test_interleaved_1f1b_two_stages_per_rank_share_one_runtime():
    from kareus.planner.dag import interleaved_one_f_one_b

    results = run_ranks(_run_pipeline, "Interleaved1F1B", "Interleaved1F1B", 2, world=2)
    _check(results, False)
    # The composer's DAG orders each stage's instructions as the schedule torch ran did.
    composed = {s: [] for s in range(4)}
    for i in interleaved_one_f_one_b(2, MICRO, 2).instructions:
        composed[i.stage].append((i.kind, i.microbatch))
    assert composed == results[0][5]

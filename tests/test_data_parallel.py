"""Data parallelism in the plan: DDP, FSDP2 and HSDP traffic priced where hooks issue it."""

import json

import pytest

from kareus.cli import EXIT_BAD_INPUT, EXIT_OK, main
from kareus.compiler.apply_plan import check_data_parallel
from kareus.errors import KareusError, PlanMismatchError
from kareus.hardware import Emulator, gpu
from kareus.ir.costs import CollectiveCost
from kareus.ir.plan_file import Plan
from kareus.jobs.trace import Workload
from kareus.planner.data_parallel import (
    DataParallel,
    Pricing,
    StageWeights,
    instruction_ops,
    per_instruction_cost,
    traffic,
)
from kareus.planner.iteration import Parallelism, PlannerSettings, plan_for_gpu
from kareus.testing import megatron_partition_set

SPEC = gpu("a100-40gb")
WEIGHTS = StageWeights(layers=4, per_layer=25e6, other=10e6)


def test_each_mode_carries_what_its_hooks_issue():
    assert traffic(DataParallel(1), WEIGHTS).per_iteration == ()
    ddp = traffic(DataParallel(4, "ddp", stride=8), WEIGHTS)
    assert ddp.per_forward == ddp.per_backward == ()
    [(reduce, across)] = ddp.per_iteration
    assert reduce == CollectiveCost("all_reduce", 110e6 * 2, 4, "dp gradients") and across
    fsdp = traffic(DataParallel(4, "fsdp", stride=2), WEIGHTS)  # 4 x 2 GPUs: one node
    assert [c.kind for c, _x in fsdp.per_forward] == ["all_gather"]
    assert [c.kind for c, _x in fsdp.per_backward] == ["all_gather", "reduce_scatter"]
    assert not any(x for _c, x in fsdp.per_forward + fsdp.per_backward)
    assert fsdp.optimizer_params == pytest.approx(110e6 / 4)  # each rank updates its shard
    hsdp = traffic(DataParallel(8, "hsdp", stride=2), WEIGHTS)  # shards of 4 in a node
    *_local, (replicate, across) = hsdp.per_backward
    assert replicate == CollectiveCost("all_reduce", 110e6 * 2 / 4, 2, "dp gradient shards")
    assert across and not any(x for _c, x in hsdp.per_backward[:2])


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(degree=4, mode="hsdp", stride=8), "no shard group within a node"),
        (dict(degree=6, mode="hsdp", stride=2), "must be a multiple of 4"),
        (dict(degree=2, mode="zero3"), "kareus plans ddp, fsdp, hsdp"),
        (dict(degree=0), "must all be at least 1"),
    ],
)
def test_layouts_kareus_cannot_plan_are_refused_by_name(layout, message):
    with pytest.raises(KareusError, match=message):
        DataParallel(**layout)


def _pricing():
    emulator = Emulator(SPEC)
    return Pricing(emulator, Emulator(SPEC.across_nodes()), SPEC.calibration.static_power_w, 32)


def test_traffic_across_nodes_costs_more_and_compute_hides_more_at_lower_clocks():
    pset = megatron_partition_set(
        hidden=4096, ffn=14336, heads=32, seq=4096, microbatch=4, layers=4, tp=8
    )
    ops = instruction_ops(pset, "backward")
    pricing = _pricing()

    def added(weights, freq):
        tr = traffic(DataParallel(4, "fsdp", stride=8), weights)
        return per_instruction_cost(tr.per_backward, ops, tr.units, pricing, freq)[0]

    # Traffic the compute outlasts adds only what it takes from the compute (its SMs)...
    light = added(WEIGHTS, 1410)
    heavy = StageWeights(layers=4, per_layer=400e6)
    assert 0 < light < 0.1 * added(heavy, 1410)
    # ...and where it is exposed, a slower clock stretches the compute it hides behind.
    assert 0 < added(heavy, 1050) < added(heavy, 1410)
    coll = CollectiveCost("all_reduce", 2**30, 4)
    assert pricing.alone(coll, True, 1410)[0] > 5 * pricing.alone(coll, False, 1410)[0]


def _plan(dp):
    pset = megatron_partition_set(
        hidden=2048, ffn=8192, heads=16, seq=2048, microbatch=4, layers=2, tp=8
    )
    return plan_for_gpu(
        [pset, pset],
        SPEC,
        parallel=Parallelism(tp=8, pp=2, microbatches=4),
        settings=PlannerSettings(sweep_points=3, clocks_mhz=(1410, 1050)),
        data_parallel=dp,
        weights=[WEIGHTS, WEIGHTS] if dp else None,
    ).plan


@pytest.fixture(scope="module")
def plans():
    return {
        "none": _plan(None),
        1: _plan(DataParallel(1, stride=8)),
        4: _plan(DataParallel(4, "ddp", stride=8)),
        "fsdp": _plan(DataParallel(4, "fsdp", stride=8)),
    }


def test_the_data_parallel_iteration_is_slower_by_its_exposed_communication(plans):
    megatron = {k: p.baselines["megatron"][0].time_s for k, p in plans.items()}
    assert megatron["none"] < megatron[1] < megatron[4] < megatron["fsdp"]
    record = plans[4].data_parallel
    assert record["degree"] == 4 and record["mode"] == "ddp"
    for stage in record["stages"]:
        assert 0 < stage["added_s"] < stage["alone_s"]  # part hidden behind the backward
    # Each rank's step has a clock in the schedule (the runtime sets it after its last
    # backward); without data parallelism there is none.
    steps = [s for s in plans[4].schedule if s.kind == "step"]
    assert sorted(s.stage for s in steps) == [0, 1] and {s.microbatch for s in steps} == {0}
    assert len(plans[4].schedule) == len(plans["none"].schedule) + 2
    assert not plans["none"].data_parallel
    assert "step" not in {s.kind for s in plans["none"].schedule}


def test_only_kareus_clocks_the_step_and_a_lower_clock_pays_there():
    """The step's exposed all-reduce waits on the network and its optimizer on memory: a
    lower clock takes about as long for less energy. The baselines leave it at the maximum
    clock (their plans cover the pipeline's compute); kareus chooses it."""
    pset = megatron_partition_set(
        hidden=2048, ffn=8192, heads=16, seq=2048, microbatch=4, layers=2, tp=8
    )
    result = plan_for_gpu(
        [pset, pset],
        SPEC,
        parallel=Parallelism(tp=8, pp=2, microbatches=4),
        settings=PlannerSettings(sweep_points=3, clocks_mhz=(1410, 1200, 1050)),
        data_parallel=DataParallel(4, "ddp", stride=8),
        weights=[WEIGHTS, WEIGHTS],
    )
    step_clocks = {
        method: {o.freq_mhz for s in sols for o in s.choices[-2:]}
        for method, sols in result.frontiers.items()
    }
    for method in ("megatron", "perseus", "nanobatch+perseus"):
        assert step_clocks[method] == {1410}, method
    # what planning with the traffic in view saved over a plan blind to it, run with it
    blind = result.plan.data_parallel["blind"]
    assert blind["aware_energy_j"] <= blind["energy_j"] and blind["saving"] >= 0
    assert blind["aware_bound_j"] <= blind["aware_energy_j"] + 1e-9
    chosen = [s for s in result.plan.schedule if s.kind == "step"]
    assert {s.freq_mhz for s in chosen} < {1410, 1200, 1050}
    assert min(s.freq_mhz for s in chosen) < 1410  # a lower clock pays at the step


def test_kareus_is_never_above_the_baselines_on_the_same_iteration(plans):
    for plan in plans.values():
        for method in ("megatron", "perseus", "nanobatch+perseus"):
            for point in plan.baselines[method]:
                ours = [p.energy_j for p in plan.frontier if p.time_s <= point.time_s + 1e-9]
                assert ours and min(ours) <= point.energy_j * (1 + 1e-9), (method, point)


def test_a_plan_for_another_degree_is_refused_naming_both(plans):
    plan = plans[4]
    check_data_parallel(plan, world_size=64)  # 64 GPUs / (TP 8 x PP 2) = 4 replicas
    with pytest.raises(PlanMismatchError, match=r"degree 4 .* give 2"):
        check_data_parallel(plan, world_size=32)
    with pytest.raises(PlanMismatchError, match=r"degree 1 .* give 4"):
        check_data_parallel(plans[1], world_size=64)
    check_data_parallel(plans["none"], world_size=64)  # priced no data parallelism


def test_stage_weights_count_a_llama_by_its_shapes():
    work = Workload(model="llama3.2-3b", tp=8, pp=2, dp=4)
    first, last = work.stage_weights()
    cfg = work.config
    assert first.layers == last.layers == cfg.num_layers // 2
    # 3.2 B parameters over 8 tensor-parallel ranks (norms replicated), the tied embedding
    # held by both ends of the pipeline.
    total = sum(w.total for w in (first, last))
    assert 3.2e9 / 8 < total < 3.7e9 / 8
    assert first.other == pytest.approx(cfg.vocab_size * cfg.hidden_size / 8)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "60"], "--world-size 60 is not a multiple of the GPUs of one replica"),
        (["--dp", "2", "--world-size", "64"], "make 4 replicas, not 2"),
        (["--dp", "2", "--dp-mode", "hsdp"], "no shard group within a node"),
        (["--dp", "2", "--gpus-per-node", "4"], "do not fit in a node of 4 GPUs"),
    ],
)
def test_bad_data_parallel_input_is_a_clear_error(args, message, capsys, tmp_path):
    base = ["plan", "--model", "llama3.2-1b", "--tp", "8", "--pp", "2", "--out", str(tmp_path)]
    assert main([*base, *args, "--quiet"]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_plan_with_dp_records_it_and_reports_it(tmp_path, capsys):
    args = ["plan", "--model", "tiny-4l", "--tp", "2", "--microbatch-size", "4"]
    args += ["--seq-len", "32", "--world-size", "8", "--dp-mode", "fsdp", "--clocks", "1410,1050"]
    args += ["--out", str(tmp_path)]
    assert main([*args, "--quiet"]) == EXIT_OK
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.data_parallel["degree"] == 4 and plan.workload["dp"] == 4
    assert json.loads((tmp_path / "plan.json").read_text())["data_parallel"]["mode"] == "fsdp"
    report = (tmp_path / "report.md").read_text()
    assert "## Data parallelism" in report and "FSDP over 4 replica(s) (within a node)" in report
    # what planning with the traffic in view saved over a plan blind to it, run with it
    # (the tiny model's split graphs are slower than its original ones: no blind plan meets
    # Megatron-LM's time, and the report says so)
    assert "not priced: kareus's split graphs cannot meet" in plan.data_parallel["blind"]["note"]
    assert "What seeing the data-parallel traffic gained: not priced" in report
    assert "step@" in report

"""Partition programs and `kareus profile`: extraction, measurement over real ranks, replay."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from kareus.cli import EXIT_BAD_INPUT, EXIT_OK, main
from kareus.ir.costs import PartitionWork
from kareus.ir.partitions import Decision
from kareus.ir.plan_file import Plan
from kareus.jobs.trace import Workload, fake_world, trace_stage
from kareus.passes.extract_partitions import scheduled, unnamed
from kareus.testing import free_port

WORK = Workload(model="tiny", tp=2, microbatch_size=4, seq_len=64)
SMALL = ["--model", "tiny", "--tp", "2", "--microbatch-size", "4", "--seq-len", "64"]


@pytest.fixture(scope="module")
def traced():
    with fake_world(2, 1) as groups:
        return trace_stage(WORK, 0, layers=2, groups=groups, extract=True)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_every_type_has_a_program_that_costs_what_the_type_costs(traced):
    pset, programs = traced.pset, traced.programs
    assert set(pset.types) < set(programs)
    for key, ptype in pset.types.items():
        program = programs[key]
        # The emulator costs the type; the profiler runs the program: the same work.
        assert unnamed(program.work) == unnamed(PartitionWork(ptype.compute, ptype.collective))
        assert (program.group_name == "tp") == (ptype.collective is not None)
        # Fake tensors do not outlive tracing: the inputs are described by layout.
        assert all("val" not in n.meta for n in program.gm.graph.nodes)
        placeholders = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(program.inputs) > 0


def test_work_outside_partitions_has_programs_that_add_up_to_it(traced, one_rank):
    pset, programs = traced.pset, traced.programs
    for kind in ("forward", "backward"):
        pieces = [programs[f"{kind}/outside"]] if pset.other[kind] else []
        pieces += [programs[f"{kind}/block/{b}"] for b in pset.block_other[kind]]
        got = tuple(o for p in pieces for o in p.work.ops)
        assert unnamed(PartitionWork(got)) == unnamed(PartitionWork(pset.outside(kind)))
        assert any(o.op_class == "gemm" for o in got)  # the head; the weight gradients
        for coll in pset.exposed[kind]:
            assert programs[f"{kind}/exposed/{coll.name}"].work.collective == coll
        for program in pieces:  # they run (random inputs: values may be anything)
            outputs = scheduled(program, Decision(None, None), one_rank)(
                *program.make_inputs("cpu")
            )
            assert len(outputs) > 0


def test_programs_run_in_every_order_with_the_same_results(traced, one_rank):
    for key, program in traced.programs.items():
        part = program.partition
        if part is None:
            continue
        inputs = program.make_inputs("cpu")
        assert [tuple(t.shape) for t in inputs] == [s.shape for s in program.inputs]
        slots = [None, *range(len(part.slots))] if part.collective else [None]
        results = []
        for slot in slots:
            gm = scheduled(program, Decision(slot, None), one_rank)
            order = [n.name for n in gm.graph.nodes]
            if part.collective and slot is not None:
                issue = order.index(part.collective[0])
                # Issued right before its slot's first node, waited for after the compute.
                assert order.index(part.slots[slot].first) > issue
                if slot > 0:
                    before = [o.name for o in part.slots[slot - 1].ops if o.op_class != "view"]
                    assert all(order.index(n) < issue for n in before if n in order), key
                assert order.index(part.collective[1]) > max(order.index(n) for n in part.compute)
            results.append(gm(*inputs))
        for got in results[1:]:  # reordering changes no value
            assert all(torch.equal(a, b) for a, b in zip(results[0], got, strict=True)), key
        if part.collective:
            # One rank: the all-reduce returns its input, which the program's output shows.
            alone = scheduled(program, Decision(0, None), None)
            assert not any("c10d" in str(n.target) for n in alone.graph.nodes)
            assert len(alone(*inputs)) == len(results[0]) - 1


# 16 layers, 4 traced: the other 12 layers' work outside partitions runs an ordinary layer's;
# under full recompute each backward re-runs its forward, measured from the forward's programs.
PROFILED = [
    *("--model", "tiny-16l", "--tp", "2", "--microbatch-size", "4", "--seq-len", "64"),
    *("--recompute", "full"),
]


@pytest.mark.slow  # CI's sample leaves it out: two profiling ranks; one rank's profile stays in CI
def test_profile_and_plan_from_it_across_two_ranks(tmp_path):
    out = tmp_path / "profile"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "kareus",
            "profile",
            *PROFILED,
            "--clocks",
            "1410,1005",
            "--sm-shares",
            "4,16",
            "--window",
            "0.01",
            "--warmup",
            "1",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan from it" in run.stdout
    rows = [json.loads(line) for line in (out / "profiles.jsonl").read_text().splitlines()]
    types = json.loads((out / "partitions.json").read_text())["sets"][0]["types"]
    measured = [r for r in rows if r["time_source"] == "measured"]
    # Every partition type ran as a program, at both clocks; on a CPU the time is measured
    # and the energy modelled, so the rows say modelled.
    assert {f"0/{k}" for k in types} <= {r["type"] for r in measured}
    assert {r["knobs"]["freq_mhz"] for r in measured} == {1410, 1005}
    assert all(r["energy_source"] == "modelled" and r["source"] == "modelled" for r in rows)
    assert all(r["ranks"] == 2 and r["device"] == "cpu" and r["time_s"] > 0 for r in rows)
    slots = {r["knobs"]["launch_slot"] for r in measured}
    assert None in slots and len(slots) > 2  # overlapped at several slots, and alone
    # The work outside partitions ran as programs too: nothing is left to the model.
    assert not [r for r in rows if r["time_source"] == "modelled"]
    outside = {r["type"] for r in rows if "outside" in r["type"]}
    assert outside == {"0/forward outside partitions", "0/backward outside partitions"}
    assert "0/backward recompute" in {r["type"] for r in measured}
    assert any(r["type"].endswith(" collective") for r in measured)  # re-run collectives
    assert "| 0/forward.1 |" in (out / "profile.md").read_text()
    # Plan from the measurements: the partitions beside the file, its clocks.
    rc = main(
        [
            "plan",
            *PROFILED,
            "--sm-shares",
            "4,16",
            "--evaluator",
            "replay",
            "--replay",
            str(out / "profiles.jsonl"),
            "--quiet",
            "--out",
            str(tmp_path / "plan"),
        ]
    )
    assert rc == EXIT_OK
    plan = Plan.load(tmp_path / "plan" / "plan.json")
    assert {s.freq_mhz for s in plan.schedule} <= {1410, 1005}
    assert plan.source == "modelled" and plan.evaluations["search"] > 0


def test_profile_bad_input_says_what_to_fix(capsys):
    # Not launched by torchrun: one process for a group of two.
    assert main(["profile", *SMALL, "--quiet"]) == EXIT_BAD_INPUT
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(["profile", *SMALL[:2], "--quiet"]) == EXIT_BAD_INPUT  # TP 1: no collective
    assert "no collective" in capsys.readouterr().err
    bad = ["profile", "--model", "no_such_module:CONFIG", "--tp", "2", "--quiet"]
    assert main(bad) == EXIT_BAD_INPUT
    assert "cannot import module 'no_such_module'" in capsys.readouterr().err
    assert main(["profile", *SMALL, "--window", "-1"]) == EXIT_BAD_INPUT


def test_model_path_names_a_config_module(tmp_path, monkeypatch):
    from kareus.models import LlamaConfig, preset

    (tmp_path / "my_models.py").write_text(
        "from kareus.models import LlamaConfig\n"
        "SMALL = LlamaConfig(num_layers=4, hidden_size=64, intermediate_size=128)\n"
        "def small():\n    return SMALL\n"
        "NOT_A_CONFIG = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        preset("my_models:SMALL")
        == preset("my_models:small")
        == LlamaConfig(num_layers=4, hidden_size=64, intermediate_size=128)
    )
    with pytest.raises(ValueError, match="has no attribute 'LARGE'"):
        preset("my_models:LARGE")
    with pytest.raises(ValueError, match="is of type int, not a kareus.models.LlamaConfig"):
        preset("my_models:NOT_A_CONFIG")


def test_no_permission_to_lock_clocks_measures_at_the_clock_as_found():
    from kareus.jobs.profile import _can_lock
    from kareus.runtime.clocks import EmulatedClocks

    notes = []
    assert not _can_lock(EmulatedClocks(refuse=True), True, notes)
    assert "measured at the clock as found" in notes[0]
    assert _can_lock(EmulatedClocks(), True, []) and not _can_lock(EmulatedClocks(), False, [])


@pytest.mark.parametrize(
    "stage",
    [0, pytest.param(1, marks=pytest.mark.slow)],  # CI's sample: the first stage
)
def test_a_traced_backward_does_each_forward_gemm_twice_and_no_more(stage):
    # Every forward GEMM has two in the backward (input and weight gradient). Work copied
    # from the forward that nothing reads -- the head's logits GEMM feeding a copy of the
    # vocab-parallel loss's max all-reduce -- would run on the GPU and be costed.
    work = Workload(model="tiny", tp=2, pp=2, microbatch_size=4, seq_len=64)
    with fake_world(2, 1) as groups:
        pset = trace_stage(work, stage, layers=2, groups=groups).pset

    def gemm_flops(kind):
        inside = [
            o for p in pset.partitions if p.instruction == kind for s in p.slots for o in s.ops
        ]
        return sum(o.flops for o in (*inside, *pset.outside(kind)) if o.op_class == "gemm")

    assert gemm_flops("forward") > 0
    assert gemm_flops("backward") == pytest.approx(2 * gemm_flops("forward"), rel=1e-9)


def test_a_partition_runs_with_inductors_kernels_and_computes_what_its_ops_do(traced, one_rank):
    """On a GPU, ``kareus profile`` runs each partition as Inductor compiles it (the kernels
    training runs, not one per aten op); compiled or op by op, it computes the same."""
    from kareus.hardware import Emulator, gpu
    from kareus.ir.costs import Knobs
    from kareus.jobs.program_device import Piece, ProgramDevice
    from kareus.planner.knobs import _digest

    key = next(k for k, t in traced.pset.types.items() if t.collective is not None)
    program = traced.programs[key]
    ptype = traced.pset.types[key]
    work = PartitionWork(ptype.compute, ptype.collective)
    outputs = {}
    for codegen in ("python", "inductor"):
        device = ProgramDevice(
            {_digest(work): [Piece(program)]},
            {"tp": None},
            torch.device("cpu"),
            model=Emulator(gpu("a100-40gb")),
            static_power_w=80.0,
            codegen=codegen,
        )
        device.run(work, Knobs(1410, 0, launch_slot=None))
        ((_piece, runs),) = next(iter(device._graphs.values()))
        outputs[codegen] = runs(*device._inputs_of(program))
        assert isinstance(runs, torch.fx.GraphModule) == (codegen == "python")
    assert ProgramDevice({}, {}, torch.device("cpu"), model=None, static_power_w=0).codegen == (
        "python"
    )
    # bf16 on random inputs: Inductor rounds once per fused kernel, eager once per op, so a
    # few attention outputs (softmax over random, unnormalised scores) differ more
    for a, b in zip(outputs["python"], outputs["inductor"], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        close = (a.float() - b.float()).abs() <= 0.05 * b.float().abs().max() + 1e-6
        assert close.float().mean() >= 0.95, close.float().mean()
    with pytest.raises(ValueError, match="'inductor' or 'python'"):
        ProgramDevice({}, {}, torch.device("cpu"), model=None, static_power_w=0, codegen="x")

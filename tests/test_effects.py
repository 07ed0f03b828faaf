"""The effects kareus claims, read from what runs, and a kareus broken on purpose caught.

A tensor-parallel Llama over a gloo group of one (every layer holds its all-reduces, so every
layer is split, as at TP 8) with a clock plan on an emulated GPU: its blocks are split in the
graph that runs (two nanobatch copies of their ops), its collectives fly over the other
nanobatch's compute in that graph's order, and the plan's clocks are set on the device (its
own history). ``KAREUS_BREAK`` (tests/conftest.py) breaks kareus one way at a time, keeping
its own records: the test must fail each time, for the effect that went missing.
``python benchmarks/break_kareus.py`` runs the suite's effect tests under every break.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus.compiler.backend import find_backend
from kareus.models import Llama, LlamaConfig
from kareus.passes.schedule_overlap import decision_for
from kareus.runtime.clocks import EmulatedClocks
from kareus.testing import (
    blocks_run,
    clocks_on_device,
    flying_when_run,
    overlapped_collectives,
    token_batches,
)

CFG = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128)


def _clock_plan():
    """One forward and one backward per iteration, each at its own clock."""
    from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction

    schedule = tuple(
        ScheduledInstruction(0, kind, 0, f, time_s=0.01, dynamic_energy_j=1.0)
        for kind, f in (("forward", 1410.0), ("backward", 1200.0))
    )
    point = FrontierPoint(1.0, 1.0)
    return Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 1, "pp": 1, "microbatches": 1},
        frontier=(point,),
        chosen=point,
        schedule=schedule,
        decisions={},
        baselines={},
        static_power_w=80.0,
    )


def test_split_overlap_and_clocks_are_there_in_what_runs():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        clocks = EmulatedClocks()
        model = kareus.compile(
            Llama(CFG, tp_group=dist.group.WORLD), plan=_clock_plan(), clocks=clocks
        )
        ids, labels = token_batches(1, 8, 32, CFG.vocab_size)[0]
        for _ in range(2):
            model(ids, labels).backward()
        region = kareus.explain(model).regions[0]
        # split: both layers run as two nanobatch copies (read from the graph)
        assert blocks_run(region).split == ["layers.0", "layers.1"]
        # overlap: the plan's overlapped partitions' collectives fly over the other copy
        pset, decisions = region.findings.partitions, region.inputs.decisions
        planned = {}
        for kind in ("forward", "backward"):
            wanted = sum(
                1
                for p in pset.partitions
                if p.instruction == kind
                and p.collective
                and decision_for(decisions, p.type_key).launch_slot is not None
            )
            planned[kind] = wanted
            flying = overlapped_collectives(region, kind)
            assert wanted and len(flying) >= wanted, (
                f"{kind}: {len(flying)} collectives fly over the other nanobatch, {wanted} planned"
            )
        # and as it runs: ops between each launch and its wait, in the order the ops ran
        # (a runner that waited at once would run the same graph with nothing in flight)
        ran = {}
        ran["forward"] = flying_when_run(lambda: ran.setdefault("loss", model(ids, labels)))
        ran["backward"] = flying_when_run(lambda: ran["loss"].backward())
        for kind in ("forward", "backward"):
            assert len(ran[kind]) >= planned[kind], (
                f"{kind}: {len(ran[kind])} collectives fly over other ops as run, "
                f"{planned[kind]} planned"
            )
        # clocks: set on the device, as the runtime says
        runtime = find_backend(model).runtime
        on_device = clocks_on_device(runtime)
        assert on_device and on_device == runtime.switches, (
            f"clocks set on the device {on_device}, recorded {runtime.switches}"
        )
        runtime.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("how", "caught"),
    [
        # CI's sample breaks the overlap; the split, clock and serial breaks run in the full
        # set (the run-order check the serial break fails runs in CI, here and at TP 2)
        pytest.param("split", "the graph that runs splits", marks=pytest.mark.slow),
        ("overlap", "collectives fly over the other nanobatch"),
        pytest.param("serial", "collectives fly over other ops as run", marks=pytest.mark.slow),
        pytest.param("clocks", "clocks set on the device", marks=pytest.mark.slow),
    ],
)
def test_a_kareus_broken_on_purpose_fails_for_the_effect_it_lost(how, caught):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-p", "no:logging",
         f"{__file__}::test_split_overlap_and_clocks_are_there_in_what_runs"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KAREUS_BREAK": how},
    )  # fmt: skip
    assert run.returncode != 0, f"KAREUS_BREAK={how}: the test passed\n{run.stdout[-2000:]}"
    assert caught in run.stdout, run.stdout[-3000:]

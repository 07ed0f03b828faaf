"""The prepared GPU check: its dry run exercises every step on the CPU."""

import csv
import subprocess
import sys

import pytest
import torch

SCRIPT = "benchmarks/gpu_check.py"


def _dry_run(out, *options: str) -> str:
    """Run the GPU check dry into ``out``; return its summary."""
    run = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out", str(out), *options],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return (out / "summary.md").read_text()


def test_a_dry_run_of_the_quick_steps_writes_summary_and_data(tmp_path):
    """CI's sample of the GPU check: the steps that need no compile, dry."""
    steps = ("devices", "energy", "ops", "sizes", "nccl")
    summary = _dry_run(tmp_path, "--steps", ",".join(steps))
    assert "No clock, power limit or other setting was changed" in summary
    for step in steps:
        assert f"| {step} | passed |" in summary, summary
        assert list(csv.DictReader((tmp_path / "data" / "dry-run" / f"{step}.csv").open()))
    assert "| compile |" not in summary  # the steps not asked for do not run


@pytest.mark.slow  # every step (about a minute): before a GPU session, and in the full set
def test_dry_run_runs_every_step_and_writes_summary_and_data(tmp_path):
    summary = _dry_run(tmp_path)
    assert "dry run: no figure here measures a GPU" in summary
    assert "No clock, power limit or other setting was changed" in summary
    assert "KAREUS_CLOCKS=off" in summary
    steps = (
        "devices", "compile", "train_step", "emulated_tp", "switches", "energy", "ops", "sizes",
        "profile", "nccl",
    )  # fmt: skip
    for step in steps:
        assert f"| {step} | passed |" in summary, summary
        rows = list(csv.DictReader((tmp_path / "data" / "dry-run" / f"{step}.csv").open()))
        assert rows, step
    data = tmp_path / "data" / "dry-run"
    waits = {
        r["blocking"]: float(r["cpu_s"]) for r in csv.DictReader((data / "devices.csv").open())
    }
    assert waits["True"] < waits["False"]  # a blocking wait spends less CPU than spinning
    compiled = list(csv.DictReader((data / "compile.csv").open()))
    assert {(r["codegen"], r["plan"]) for r in compiled} == {
        ("python", "False"),
        ("python", "True"),
    }
    trained = list(csv.DictReader((data / "train_step.csv").open()))
    assert {r["variant"] for r in trained} == {"eager", "kareus python"}
    assert all(float(r["step_ms_median"]) > 0 for r in trained)
    emulated = list(csv.DictReader((data / "emulated_tp.csv").open()))
    assert {r["variant"] for r in emulated} == {"eager", "kareus python"}
    # each collective in flight was seen for a part of its emulated duration
    assert all(float(r["overlapped_ms"]) >= 0 for r in emulated)
    switches = [float(r["freq_mhz"]) for r in csv.DictReader((data / "switches.csv").open())]
    assert len(switches) == 4 and len(set(switches)) == 4  # the plan's four clocks, in order
    ops = list(csv.DictReader((data / "ops.csv").open()))
    assert {r["class"] for r in ops} == {"gemm", "attention", "memory"}
    assert all(float(r["measured_s"]) > 0 and float(r["modelled_s"]) > 0 for r in ops)
    sizes = list(csv.DictReader((data / "sizes.csv").open()))
    assert {r["class"] for r in sizes} == {"gemm", "attention", "memory"}
    assert len({r["op"] for r in sizes}) == len(sizes) == 26  # every size its own row
    # each matmul row carries the model's share of SMs its tiles fill, the others none
    assert all((r["modelled_fill"] != "") == (r["class"] == "gemm") for r in sizes)
    assert {r["family"] for r in sizes if r["op"].startswith("one wave")} == {"wave"}
    assert all(float(r["fraction_of_peak"]) > 0 and float(r["modelled_s"]) > 0 for r in sizes)
    assert "README" not in summary and (data / "README.md").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_without_a_gpu_it_says_to_use_the_dry_run(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert run.returncode != 0 and "--dry-run" in run.stderr
    assert not (tmp_path / "summary.md").exists()


@pytest.mark.slow  # CI's sample leaves it out: the dry run of every step stays in CI
def test_each_step_prices_the_clock_its_kernels_ran_at_not_the_idle_one(tmp_path, monkeypatch):
    """A fake GPU history: 345 MHz (idle) read before any work, 1455 MHz (the power cap)
    while kernels run. Every timed row reports and is priced at 1455 MHz."""
    import importlib.util
    import pathlib

    from kareus.hardware import Emulator, gpu
    from kareus.jobs.gpu_watch import fixed_reader

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # (its dataclasses look it up)
    spec.loader.exec_module(gpu_check)
    h200 = gpu("h200")
    ctx = gpu_check.Context(
        dry_run=True,
        device=torch.device("cpu"),
        spec=h200,
        clock_mhz=345.0,  # read before the run: the idle clock
        clock_source="read from NVML (fake)",
        out=tmp_path,
        data=pathlib.Path(tmp_path),
        reader=fixed_reader(1455.0, 665.0),  # what NVML says while the kernels run
    )
    emu = Emulator(h200)
    results = {}
    for step in (gpu_check.step_ops, gpu_check.step_sizes, gpu_check.step_profile):
        results[step] = result = step(ctx)
        assert result.rows and "1455 MHz" in result.summary, result.summary
        for row in result.rows:
            assert float(row["clock_mhz"]) == 1455.0, (step.__name__, row)
    ops = results[gpu_check.step_ops]
    gemm = next(r for r in ops.rows if r["class"] == "gemm")
    case = next(c for c in gpu_check._op_cases(ctx) if c[1] == gemm["op"] and c[0] == gemm["model"])
    costs = gpu_check._costs(case[3], case[4])
    assert gemm["modelled_s"] == emu.ops(costs, 1455.0).time_s != emu.ops(costs, 345.0).time_s
    assert gemm["power_w"] == 665.0

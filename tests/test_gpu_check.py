"""The prepared GPU check: its dry run exercises every step on the CPU."""

import csv
import subprocess
import sys

import pytest
import torch

SCRIPT = "benchmarks/gpu_check.py"


def test_dry_run_runs_every_step_and_writes_summary_and_data(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "dry run: no figure here measures a GPU" in summary
    assert "No clock, power limit or other setting was changed" in summary
    steps = (
        "devices", "compile", "train_step", "switches", "energy", "ops", "sizes", "profile",
        "nccl",
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

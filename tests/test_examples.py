"""The CPU examples run as a user runs them, and say what they should."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, tmp_path, timeout_s=240):
    """Run a command as a user would; on a hang, kill all its processes and show its output.

    The command gets its own session so torchrun's workers die with it (killing torchrun
    alone leaves them running), and its output so far is part of the failure.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout_s} s:\n{stdout[-2000:]}{stderr[-4000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return stdout


def _losses(out):
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]


@pytest.mark.timeout(300)
def test_train_tiny_prints_explain_and_modelled_energy(tmp_path):
    out = _run(sys.executable, ROOT / "examples/train_tiny.py", "--steps", "3", tmp_path=tmp_path)
    assert len(_losses(out)) == 3
    assert "planned at compile time for A100-SXM4-40GB" in out
    assert re.search(r"iteration 0: [0-9.]+ ms, [0-9.]+ J \(modelled\)", out)
    assert (tmp_path / "kareus-out/explain.txt").exists()


@pytest.mark.distributed
@pytest.mark.slow  # (TP in process: test_tensor_parallel.py, test_topologies.py)
@pytest.mark.timeout(300)
def test_tensor_parallel_example_under_torchrun(tmp_path):
    out = _torchrun(2, "examples/train_tp.py", "--steps", "2", "--layers", "2", tmp_path=tmp_path)
    assert len(_losses(out)) == 2
    assert "all_reduce" in out and "(modelled)" in out


@pytest.mark.slow  # (TP x PP x DP under pipelining with a plan, in process: test_topologies.py)
@pytest.mark.timeout(300)
def test_pipeline_example_applies_a_kareus_plan_under_tp_and_pp(tmp_path):
    """TP 2 x PP 2 under torch.distributed.pipelining with the plan `kareus plan` makes for
    it: the loss runs outside the compiled stages, which the plan's trace held inside, and
    the plan (which leaves this tiny model unsplit) is still recognised as this model's."""
    # the plan's clocks are checked, not gaps: less CP-SAT work, five clocks
    args = ["--steps", "2", "--solver-work", "0.2", "--clocks", "1410,1260,1095,945,780"]
    out = _torchrun(4, "examples/train_pipeline.py", *args, tmp_path=tmp_path)
    losses = _losses(out)
    assert len(losses) == 4 and losses[0] == losses[1]  # two TP ranks of the last stage
    # (the steps alone: another rank's print can land on the same line of the shared pipe)
    step = r"\d+/[FB]\d+@[\d.]+"
    applied = re.findall(
        rf"stage (\d), TP rank \d: instructions of iteration 0[^:]*: ({step}(?:, {step})*)", out
    )
    assert sorted(s for s, _ in applied) == ["0", "0", "1", "1"]
    plan = json.loads((tmp_path / "kareus-pipeline" / "plan.json").read_text())
    for stage, steps in applied:  # each rank ran its stage's planned clocks
        planned = [s for s in plan["schedule"] if s["stage"] == int(stage)]
        want = [
            f"{s['stage']}/{s['kind'][0].upper()}{s['microbatch']}@{s['freq_mhz']:g}"
            for s in planned
        ]
        assert steps.split(", ") == want


def _torchrun(nproc, script, *args, tmp_path):
    """Run ``script`` as ``torchrun --nproc-per-node nproc`` does, on a free port."""
    return _run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_port()),
        ROOT / script,
        *args,
        tmp_path=tmp_path,
    )


def _port():
    from kareus.testing import free_port

    return free_port()


@pytest.mark.distributed
@pytest.mark.slow  # (the same layout, in process: test_stacks.py's FSDP2 + TP tests)
@pytest.mark.timeout(300)
def test_fsdp_tp_example_splits_every_block_compiled_on_its_own(tmp_path):
    """torchtitan's layout (TP on "tp", compile per block, FSDP2 on "dp"; 4 ranks): the two
    ranks of a TP group see the same loss, and every block's region is split and its TP
    all-reduces partitioned."""
    out = _torchrun(4, "examples/train_fsdp_tp.py", "--steps", "2", tmp_path=tmp_path)
    losses = {int(r): {} for r in re.findall(r"rank (\d) step 0", out)}
    for rank, step, loss in re.findall(r"rank (\d) step (\d): loss ([0-9.]+)", out):
        losses[int(rank)][int(step)] = float(loss)
    assert sorted(losses) == [0, 1, 2, 3] and all(len(v) == 2 for v in losses.values())
    assert losses[0] == losses[1] and losses[2] == losses[3]  # TP pairs (ranks 0,1 and 2,3)
    blocks = re.findall(r"block (\d): split \['Block\.0'\], (\d+) partitions", out)
    assert [b for b, _n in blocks] == ["0", "1"] and all(int(n) > 0 for _b, n in blocks)
    assert "one call of Block.forward" in out

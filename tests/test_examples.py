"""The CPU examples run as a user runs them, and say what they should."""

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
@pytest.mark.timeout(300)
def test_tensor_parallel_example_under_torchrun(tmp_path):
    out = _torchrun(2, "examples/train_tp.py", "--steps", "2", "--layers", "2", tmp_path=tmp_path)
    assert len(_losses(out)) == 2
    assert "all_reduce" in out and "(modelled)" in out


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

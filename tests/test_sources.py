"""Plan a model kareus has no preset for: `kareus plan --hf-config` and `--factory`.

Each case plans the model with the CLI (traced on fake tensors), then trains it as a user
would, built as it was traced (Hugging Face: from its config, TP by its own plan; a factory:
by its function) in as many gloo ranks as its TP degree, with and without
`kareus.compile(model, plan=...)`: the losses agree, and the plan was applied (clocks
planned below the maximum and switched on the emulated GPU; the fit check passed at the
first call).

The CI sample: Phi-3 at TP 2, and a torchtitan-style factory at TP 2 with sequence parallelism
whose loss follows a graph break (as Hugging Face's GPT-2's does: the plan covers the graph
holding the layers and decides nothing in the other). `benchmarks/own_models.py` runs all
five Hugging Face architectures and the factory.
"""

import json
import re

import pytest

import kareus
from kareus.cli import EXIT_BAD_INPUT, EXIT_OK, main
from kareus.hardware import gpu
from kareus.ir.plan_file import Plan
from kareus.models.sources import FactoryModel, HFModel
from kareus.passes.check_plan import _plan_command
from kareus.planner.knobs import default_clocks
from kareus.testing import assert_same_history, hf_config_file, run_ranks, source_training

FAST = ["--microbatch-size", "4", "--seq-len", "16", "--dtype", "fp32", "--microbatches", "1"]
FAST += [
    "--select",
    "min_energy",  # clocks below the maximum: applying the plan switches them
    "--solver-work",
    "0.2",
    "--clocks",
    ",".join(map(str, default_clocks(gpu("a100-40gb").clocks_mhz(), 6))),
]


def _plan(option: list[str], tp: int, out) -> dict:
    assert (
        main(["plan", *option, "--tp", str(tp), *FAST, "--out", str(out), "--quiet", "--no-cache"])
        == EXIT_OK
    )
    return json.loads((out / "plan.json").read_text())


def _train(rank, source, tp, plan):
    ref, _ = source_training(source, tp, None)
    got, model = source_training(source, tp, plan)
    return ref, got, kareus.explain(model).verdict()


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("kind", "tp"),
    [("phi3", 2), ("factory", 2)],
    ids=["phi3-tp2", "factory-tp2"],
)
def test_a_model_of_your_own_is_planned_and_its_plan_applied(kind, tp, tmp_path):
    if kind == "factory":
        option, source = ["--factory", "titan_style:factory"], FactoryModel("titan_style:factory")
    else:
        path = str(hf_config_file(kind, tmp_path))
        option, source = ["--hf-config", path], HFModel(path)
    plan = _plan(option, tp, tmp_path / "out")
    assert plan["workload"]["tp"] == tp
    if kind == "factory":  # its loss follows a graph break: said, and not priced
        assert any("traced into 2 training graphs" in r for r in plan["skip_reasons"])
    else:  # the plan names the config, its shape, and the command that remakes it
        assert plan["workload"]["model"]["hf_config"] == path
        assert plan["workload"]["shape"] == {"hidden_size": 64, "num_layers": 4}
        remake = _plan_command(Plan.load(tmp_path / "out" / "plan.json"), {})
        assert f"--hf-config {path}" in remake
    for ref, got, verdict in run_ranks(
        _train, source, tp, str(tmp_path / "out" / "plan.json"), world=tp, timeout_s=300
    ):
        assert_same_history(ref, got, bitwise_loss=False)
        # the plan was applied: the fit check passed and its clocks ran on the emulated GPU
        assert verdict[2].startswith("clocks: planned"), verdict
        switched = re.search(r"applied by the emulated controller \((\d+) switches\)", verdict[2])
        assert switched and int(switched.group(1)) >= 1, verdict


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--hf-config", "/nonexistent/config.json"], "cannot read"),
        (["--factory", "no_such_module:make"], "cannot import 'no_such_module'"),
        (["--factory", "titan_style"], "MODULE:FUNCTION"),
        (["--factory", "titan_style:nothing"], "has no function 'nothing'"),
    ],
)
def test_a_bad_model_option_is_one_clear_line(option, message, capsys):
    assert main(["plan", *option, *FAST, "--out", "/tmp/never"]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_tensor_parallel_without_a_plan_in_the_model_says_so(tmp_path, capsys):
    path = str(hf_config_file("gpt2", tmp_path))
    assert (
        main(["plan", "--hf-config", path, "--tp", "2", *FAST, "--out", str(tmp_path / "o")])
        == EXIT_BAD_INPUT
    )
    err = capsys.readouterr().err
    assert "no tensor-parallel plan" in err and "--tp 1" in err


def test_pipeline_stages_of_your_own_model_are_refused_with_the_fix(tmp_path, capsys):
    path = str(hf_config_file("phi3", tmp_path))
    assert (
        main(["plan", "--hf-config", path, "--pp", "2", *FAST, "--out", str(tmp_path / "o")])
        == EXIT_BAD_INPUT
    )
    assert "--pp 1 --cp 1" in capsys.readouterr().err


def test_the_model_options_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--factory", "titan_style:factory"])
    assert "not allowed with" in capsys.readouterr().err

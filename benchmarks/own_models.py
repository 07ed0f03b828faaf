"""Plan models kareus has no preset for, apply each plan, and compare with a plan-free run.

For each of five Hugging Face architectures (tiny configs written by
``kareus.testing.hf_config_file``) and a torchtitan-style ``--factory`` model: ``kareus plan``
(fake tensors, emulated A100, ``--select min_energy``: clocks below the maximum), then 3
AdamW steps in as many gloo ranks as the TP degree, with and without
``kareus.compile(model, plan=...)``. Prints plan seconds, the largest loss difference and
kareus's verdict lines. The tests run a sample of these (tests/test_sources.py).

TP 2 where the model runs sharded: Phi-3 and OLMo by transformers' own tensor-parallel
plan, BERT by one written into its config (``kareus.testing.HF_TP_PLANS``, as a user adds
one). GPT-2 and StableLM run at TP 1: transformers' TP styles shard ``nn.Linear`` and
GPT-2's layers are ``Conv1D``; StableLM's attention reshapes by the config's head count, so
a plan sharding its heads fails (``kareus plan`` says so in one line).

    python benchmarks/own_models.py [--kinds phi3,olmo,...] [--graphs inductor|aot]
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the factory lives beside the tests (titan_style)

from kareus.cli import EXIT_OK, main  # noqa: E402
from kareus.models.sources import FactoryModel, HFModel  # noqa: E402
from kareus.testing import HF_CONFIG_KINDS, HF_TP_PLANS, hf_config_file, run_ranks  # noqa: E402

TP = {"phi3": 2, "olmo": 2, "stablelm": 1, "gpt2": 1, "bert": 2, "factory": 2}


def _train(rank, source, tp, plan):
    import kareus
    from kareus.testing import source_training

    ref, _ = source_training(source, tp, None)
    got, model = source_training(source, tp, plan)
    return ref.losses, got.losses, kareus.explain(model).verdict()


def run(kind: str, tmp: pathlib.Path, graphs: str = "inductor") -> dict:
    if kind == "factory":
        option, source = ["--factory", "titan_style:factory"], FactoryModel("titan_style:factory")
    else:
        path = str(hf_config_file(kind, tmp, tp_plan=kind in HF_TP_PLANS and TP[kind] > 1))
        option, source = ["--hf-config", path], HFModel(path)
    out = tmp / kind
    args = ["plan", *option, "--tp", str(TP[kind]), "--microbatch-size", "4", "--seq-len", "16"]
    args += ["--dtype", "fp32", "--microbatches", "1", "--select", "min_energy"]
    args += ["--graphs", graphs, "--out", str(out), "--quiet", "--no-cache"]
    start = time.perf_counter()
    assert main(args) == EXIT_OK, kind
    plan_s = time.perf_counter() - start
    plan = json.loads((out / "plan.json").read_text())
    results = run_ranks(_train, source, TP[kind], str(out / "plan.json"), world=TP[kind])
    diff = max(
        float((a - b).abs().max() / a.abs().max())
        for ref, got, _ in results
        for a, b in zip(torch.stack(ref), torch.stack(got), strict=True)
    )
    return {
        "kind": kind,
        "tp": TP[kind],
        "plan_s": plan_s,
        "nanobatches": plan["chosen"]["nanobatches"],
        "loss_rel_diff": diff,
        "verdict": results[0][2],
    }


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join([*HF_CONFIG_KINDS, "factory"]))
    parser.add_argument(
        "--graphs",
        choices=("inductor", "aot"),
        default="inductor",
        help="kareus plan --graphs: the graphs traced (the run is on Inductor either way)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for kind in args.kinds.split(","):
            try:
                rows.append(run(kind, pathlib.Path(tmp), args.graphs))
            except Exception as err:  # one model failing is a row of the table, not the end
                last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                rows.append({"kind": kind, "tp": TP[kind], "failed": last})
    print(f"{'model':10} {'TP':>2} {'plan s (measured)':>18} {'nb':>3} {'loss rel diff':>14}")
    for r in rows:
        if "failed" in r:
            print(f"{r['kind']:10} {r['tp']:>2} FAILED: {r['failed']}")
            continue
        print(
            f"{r['kind']:10} {r['tp']:>2} {r['plan_s']:>18.1f} {r['nanobatches']:>3} "
            f"{r['loss_rel_diff']:>14.1e}"
        )
        for line in r["verdict"]:
            print(f"    {line}")


if __name__ == "__main__":
    main_()

"""Inductor, the default codegen: the split, the overlap and the clock plan on its kernels.

A tensor-parallel Llama over a gloo group of one (every layer holds its all-reduces, so
every layer is split, as at TP 8) is compiled with the default codegen as it is, then
planned at compile time for an H100 (clocks in a dry run), then with that plan saved and
passed as ``plan=``. The tests read Inductor's own generated code: each overlapped
collective is launched before the other nanobatch's kernels and waited after them, the
clock switches open each graph and close the backward, and no size symbol reaches
Inductor (the per-batch-size lowering is static).
"""

import copy
import re

import pytest
import torch

import kareus
from kareus.compiler.backend import find_backend
from kareus.models import Llama, LlamaConfig
from kareus.passes.schedule_overlap import decision_for
from kareus.runtime.clocks import EmulatedClocks
from kareus.testing import blocks_run, inductor_buffers, inductor_windows, token_batches

CFG = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128)


def _train(model, batches, *, codes=False):
    """Two SGD steps; return the losses, the gradients, and Inductor's code and buffers."""
    from torch._inductor.utils import run_and_get_code

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, code, made = [], [], [], []
    for i, (ids, labels) in enumerate(batches):
        opt.zero_grad()

        def step(ids=ids, labels=labels):
            loss = model(ids, labels)
            loss.backward()
            return loss

        if codes and i == 0:
            with inductor_buffers() as made:
                loss, code = run_and_get_code(step)
        else:
            loss = step()
        losses.append(loss.detach())
        named = model.named_parameters()
        grads.append({n.replace("_orig_mod.", ""): p.grad.clone() for n, p in named})
        opt.step()
    return losses, grads, code, made


@pytest.fixture(scope="module")
def split(one_rank):
    """The default codegen (no GPU here: nothing planned), trained beside eager."""
    torch.manual_seed(0)
    base = Llama(CFG, tp_group=one_rank)
    batches = token_batches(2, 8, 32, CFG.vocab_size)
    eager = _train(copy.deepcopy(base), batches)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KAREUS_CODEGEN", raising=False)  # the tests' conftest picks python
        # the split unpriced: with a group of one it would not pay (nothing to hide), and
        # Inductor's code for the split graphs is what is checked
        compiled = kareus.compile(copy.deepcopy(base), split_when="communicates")
        got = _train(compiled, batches, codes=True)
    return base, batches, eager, got, compiled


@pytest.fixture(scope="module")
def planned(split):
    """The default codegen planned at compile time for an H100 (clocks in a dry run)."""
    base, batches, (ref_losses, *_), *_ = split
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KAREUS_CODEGEN", raising=False)
        compiled = kareus.compile(copy.deepcopy(base), gpu="h100", split_when="communicates")
        losses, _grads, codes, _made = _train(compiled, batches, codes=True)
    for a, b in zip(ref_losses, losses, strict=True):
        torch.testing.assert_close(b, a)
    return base, batches, ref_losses, codes, compiled


def test_the_default_codegen_is_inductor_and_trains_as_eager(split):
    _base, _batches, (ref_losses, ref_grads, _, _), (losses, grads, codes, _), compiled = split
    region = kareus.explain(compiled).regions[0]
    assert region.codegen == "inductor"
    assert len(codes) == 2  # Inductor compiled the forward and the backward
    assert set(blocks_run(region).split) == {"layers.0", "layers.1"}
    for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        torch.testing.assert_close(b, a, msg=f"loss at step {step}")
    for ref, got in zip(ref_grads, grads, strict=True):
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, msg=name)


@pytest.mark.parametrize("codegen", [pytest.param("inductor", marks=pytest.mark.slow), "python"])
def test_an_odd_batch_and_dynamic_true(one_rank, codegen):
    """``dynamic=True`` and an odd batch of 5 (halves of 2 and 3): two steps train as eager,
    and the graph that runs holds every block split.
    Dynamo passes the norms' ``eps`` as 0-d tensors read by ``.item()`` then: such a region
    is lowered symbolically (it crashed lowered per batch size). CI runs the python
    codegen; Inductor's (two minutes of compiles here) is in the slow set."""
    torch.manual_seed(0)
    base = Llama(CFG, tp_group=one_rank)
    batches = token_batches(2, 5, 16, CFG.vocab_size)
    ref_losses, ref_grads, _, _ = _train(copy.deepcopy(base), batches)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KAREUS_CODEGEN", raising=False)
        compiled = kareus.compile(
            copy.deepcopy(base), split_when="communicates", dynamic=True, codegen=codegen
        )
        losses, grads, _, _ = _train(compiled, batches)
    for a, b in zip(ref_losses, losses, strict=True):
        torch.testing.assert_close(b, a)
    for ref, got in zip(ref_grads, grads, strict=True):
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, msg=name)
    regions = kareus.explain(compiled).regions
    assert {r.codegen for r in regions} == {codegen}
    # (dynamic=True: Dynamo breaks the graph before the layers)
    split = [set(blocks_run(r).split) for r in regions]
    assert split.count({"layers.0", "layers.1"}) == 1, split


def test_each_overlapped_collective_flies_over_the_other_nanobatchs_kernels(split):
    *_, (_l, _g, codes, made), compiled = split
    region = kareus.explain(compiled).regions[0]
    pset, decisions = region.findings.partitions, region.inputs.decisions
    for kind, code, buffers in zip(("forward", "backward"), codes, made, strict=True):
        overlapping = [
            p
            for p in pset.partitions
            if p.instruction == kind
            and p.collective
            and decision_for(decisions, p.type_key).launch_slot is not None
        ]
        assert overlapping, kind  # the check is not vacuous
        windows = inductor_windows(code, buffers)
        assert all(w.waited for w in windows), kind
        flying = [w for w in windows if w.overlapped]
        # Each overlapped partition's collective has kernels of the other nanobatch (its
        # partition's compute) between its launch and its wait in Inductor's code.
        assert len(flying) >= len(overlapping), (kind, [w.issue for w in windows])


# CI's sample leaves it out (and the saved plan below): a plan applied on Inductor with its
# clock switches in place stays in CI (test_runtime.py), and plan files are read in test_cli.py
@pytest.mark.slow
def test_the_clock_switches_open_each_graph_and_close_the_backward(planned):
    *_, codes, compiled = planned
    region = kareus.explain(compiled).regions[0]
    assert region.inputs.planned  # planned at compile time, with Inductor
    assert any("dry run" in n for n in region.notes)  # planned clocks recorded, not applied
    for kind, code in zip(("forward", "backward"), codes, strict=True):
        body = code[code.index("def call(") :]
        switch = body.index("torch.ops.kareus.switch_clock.default(")
        kernels = [m.start() for m in re.finditer(r"extern_kernels\.\w+\(|cpp_fused_\w+\(", body)]
        assert kernels and switch < min(kernels), kind
        if kind == "backward":
            step = body.index("torch.ops.kareus.switch_clock_after.default(")
            assert step > max(kernels)


def test_no_size_symbol_reaches_inductor(split):
    """A region lowered per batch size is static: the batch is no symbol in Inductor's code
    (it was on the H200, where the second nanobatch's size s - s//2 broke a kernel)."""
    *_, (_l, _g, codes, _m), _compiled = split
    for code in codes:
        body = code[code.index("def call(") :]
        # Dynamo's batch-size argument is still passed (bound to a name), never used.
        bound = re.findall(r"^\s*(s\d+) = \w+$", body, flags=re.M)
        used = re.findall(r"\bk?s\d+\b", body)
        assert sorted(used) == sorted(bound), [u for u in used if u not in bound]


@pytest.mark.slow  # 59 s of CI (Inductor compiles it twice): siblings above
def test_a_saved_plan_applies_with_the_default_codegen(planned, tmp_path, monkeypatch):
    base, batches, ref_losses, _codes, compiled = planned
    plan = kareus.explain(compiled).regions[0].inputs.plan
    path = tmp_path / "plan.json"
    plan.save(path)
    monkeypatch.delenv("KAREUS_CODEGEN", raising=False)
    clocks = EmulatedClocks()
    model = kareus.compile(copy.deepcopy(base), plan=path, clocks=clocks)
    losses, *_ = _train(model, batches)
    for a, b in zip(ref_losses, losses, strict=True):
        torch.testing.assert_close(b, a)
    backend = find_backend(model)
    assert backend.config.codegen == "inductor"
    region = kareus.explain(model).regions[0]
    assert dict(region.inputs.decisions) == dict(plan.decisions_for(0))
    # The plan's clocks were applied through the runtime, forward and backward.
    kinds = {a[2] for a in backend.runtime.applied}
    assert {"forward", "backward"} <= kinds
    backend.runtime.close()


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu().sum()


def test_torch_compile_modes_configure_inductor():
    from kareus import ConfigError, KareusBackend

    assert KareusBackend().inductor_options == {}
    tuned = KareusBackend(mode="max-autotune-no-cudagraphs", codegen="inductor")
    assert tuned.inductor_options["max_autotune"] is True
    assert "triton.cudagraphs" not in tuned.inductor_options
    opts = KareusBackend(options={"epilogue_fusion": False, "nanobatches": 1}, codegen="inductor")
    assert opts.inductor_options == {"epilogue_fusion": False}
    assert opts.config.nanobatches == 1  # Config fields are taken from options= too
    with pytest.raises(ConfigError, match="torch.compile's modes"):
        KareusBackend(mode="fastest")
    with pytest.raises(ConfigError, match="not both"):
        KareusBackend(mode="max-autotune", options={"epilogue_fusion": False}, codegen="inductor")
    with pytest.raises(ConfigError, match="codegen='python'"):
        KareusBackend(mode="max-autotune", codegen="python")
    with pytest.raises(ConfigError, match="Inductor config options"):
        KareusBackend(options={"no_such_option": 1}, codegen="inductor")


def test_cuda_graphs_refused_where_a_plan_switches_clocks():
    """reduce-overhead replays CUDA graphs, which would skip the switches between kernels."""
    from kareus import ConfigError, KareusBackend
    from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction

    plan = Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 1, "pp": 1, "microbatches": 1},
        frontier=(FrontierPoint(1.0, 100.0),),
        chosen=FrontierPoint(1.0, 100.0),
        schedule=tuple(
            ScheduledInstruction(0, kind, 0, 1200, time_s=0.1, dynamic_energy_j=10.0)
            for kind in ("forward", "backward")
        ),
        decisions={},
        baselines={},
        static_power_w=80.0,
    )
    KareusBackend(mode="reduce-overhead", codegen="inductor")  # no plan here: allowed
    with pytest.raises(ConfigError, match="CUDA graph replays its kernels without the clock"):
        KareusBackend(mode="reduce-overhead", codegen="inductor", plan=plan)
    with pytest.raises(ConfigError, match="compile-time planning for"):
        KareusBackend(mode="reduce-overhead", codegen="inductor", gpu="h100")


def test_disable_and_torch_compile_keywords_reach_kareus():
    model = _MLP()
    assert kareus.compile(model, disable=True) is model  # as torch.compile: a no-op
    compiled = torch.compile(
        _MLP(), backend="kareus", options={"codegen": "python", "nanobatches": 1}
    )
    compiled(torch.randn(4, 8)).backward()
    backend = find_backend(compiled)
    assert backend is not None and backend.config.nanobatches == 1
    assert backend.config.codegen == "python"
    assert kareus.explain(compiled).regions


def test_the_programs_tensors_keep_no_dynamic_mark():
    """kareus marks the batch dynamic for its own call only: left on the program's tensor,
    the mark made another torch.compile of the same code recompile with a dynamic batch."""
    x = torch.randn(4, 8)
    marked = torch.randn(4, 8)
    torch._dynamo.maybe_mark_dynamic(marked, 0)  # the program's own mark stays
    compiled = kareus.compile(_MLP(), codegen="python")
    compiled(x).backward()
    compiled(marked).backward()
    assert not hasattr(x, "_has_dynamo_dim_marking")
    assert marked._has_dynamo_dim_marking
    region = kareus.explain(compiled).regions[0]
    assert region.codegen == "python"

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import kareus
from kareus.compiler.backend import find_backend
from kareus.models import PRESETS, Llama
from kareus.testing import (
    assert_same_history,
    blocks_run,
    clocks_on_device,
    compare_training,
    hf_tiny,
    token_batches,
    train,
)

BATCHES = token_batches(3, batch=4, seq=16, vocab=128)


def test_unsplit_model_is_bitwise_equal_over_optimizer_steps():
    # With the split off, op order is unchanged: everything matches bitwise, step after step.
    ref, got = compare_training(
        lambda: Llama(PRESETS["tiny"]), lambda m: kareus.compile(m, nanobatches=1), BATCHES
    )
    for a, b in zip(ref.grads, got.grads, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_history(ref, got, rtol=0, atol=0)


def test_tiny_llama_trains_like_eager():
    ref, got = compare_training(
        lambda: Llama(PRESETS["tiny"]), kareus.compile, BATCHES, resync=True
    )
    assert len(ref.losses) == 3
    assert_same_history(ref, got)
    # The model actually learned something over the steps (the comparison is not vacuous).
    assert not torch.equal(ref.losses[0], ref.losses[-1])


@pytest.mark.slow  # CI's sibling: test_split_nanobatches.py splits HF Llama against eager
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_models_train_like_eager(kind):
    def hf_loss(out, batch):
        return out.loss

    def make():
        torch.manual_seed(1)
        return hf_tiny(kind)

    # The capture alone (the split of HF models is tested in test_split_nanobatches).
    batches = [{"input_ids": ids, "labels": lab} for ids, lab in BATCHES]
    ref, got = compare_training(
        make, lambda m: kareus.compile(m, nanobatches=1), batches, loss_fn=hf_loss
    )
    assert_same_history(ref, got)


def test_gradient_accumulation():
    ref, got = compare_training(
        lambda: Llama(PRESETS["tiny"]),
        kareus.compile,
        token_batches(4, 4, 16, 128),
        accumulate=2,
        resync=True,
    )
    assert len(ref.grads) == 2
    assert_same_history(ref, got)


def test_eval_mode_and_no_grad():
    model = Llama(PRESETS["tiny"])
    compiled = kareus.compile(copy.deepcopy(model))
    ids = BATCHES[0][0]
    model.eval()
    compiled.eval()
    assert not compiled.training and not compiled._orig_mod.training
    with torch.no_grad():
        assert torch.equal(compiled(ids), model(ids))
    assert "inference" in kareus.explain(compiled).regions[-1].graphs


class WithBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h).pow(2).mean()


def test_graph_break_runs_and_each_graph_is_captured():
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    ref, got = compare_training(WithBreak, kareus.compile, batches)
    assert_same_history(ref, got)
    compiled = kareus.compile(WithBreak())
    compiled(torch.randn(4, 8)).backward()
    report = kareus.explain(compiled)
    assert len(report.regions) == 2
    assert all({"dynamo", "forward", "backward"} <= r.graphs.keys() for r in report.regions)


def test_state_dict_is_interchangeable_with_the_original():
    model = Llama(PRESETS["tiny"])
    compiled = kareus.compile(model)
    assert compiled.state_dict().keys() == model.state_dict().keys()
    other = Llama(PRESETS["tiny"])
    compiled.load_state_dict(other.state_dict())
    assert torch.equal(model.embed.weight, other.embed.weight)
    # torch.compile's own "_orig_mod." checkpoints load too.
    third = torch.compile(Llama(PRESETS["tiny"]), backend="eager")
    compiled.load_state_dict(third.state_dict())
    assert torch.equal(model.embed.weight, third._orig_mod.embed.weight)
    # Parameters are shared with the original model.
    assert next(compiled.parameters()) is next(model.parameters())


@pytest.mark.parametrize("how", ["string", "object"])
def test_torch_compile_backend_forms(how):
    model = Llama(PRESETS["tiny"])
    backend = "kareus" if how == "string" else kareus.KareusBackend(kareus.Config(nanobatches=1))
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    ids, lab = BATCHES[0]
    assert torch.equal(compiled(ids, lab), model(ids, lab))
    report = kareus.explain(compiled)
    assert report.regions and "forward" in report.regions[-1].graphs
    if how == "object":
        assert report.config.nanobatches == 1


def test_compile_a_function():
    def f(x, w):
        return torch.tanh(x @ w).sum()

    g = kareus.compile(f)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(g(x, w), f(x, w))
    assert "dynamo" in kareus.explain(g).regions[0].graphs


def test_import_initialises_neither_cuda_nor_nvml():
    # torch itself imports pynvml when it is installed; kareus must add no heavy import and
    # must not load the NVML library (pynvml.nvmlLib stays None until nvmlInit).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import kareus\n"
        "added = set(sys.modules) - before\n"
        "assert not torch.cuda.is_initialized()\n"
        "heavy = ('pynvml', 'zeus', 'ortools', 'matplotlib', 'triton', 'transformers')\n"
        "bad = sorted(m for m in added if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
        "nvml = sys.modules.get('pynvml')\n"
        "assert nvml is None or nvml.nvmlLib is None, 'NVML loaded'\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


@pytest.mark.slow
def test_inductor_codegen_matches_eager():
    model = Llama(PRESETS["tiny"])
    compiled = kareus.compile(copy.deepcopy(model), codegen="inductor", nanobatches=1)
    ids, lab = BATCHES[0]
    torch.testing.assert_close(compiled(ids, lab), model(ids, lab), rtol=1e-5, atol=1e-5)
    assert "forward" in kareus.explain(compiled).regions[0].graphs


INDUCTOR_RUN = """
import json, torch, kareus
from torch._dynamo.utils import counters
from kareus.models import PRESETS, Llama
from kareus.testing import token_batches
torch.manual_seed(0)
model = kareus.compile(Llama(PRESETS["tiny"]), codegen="inductor", nanobatches=1)
ids, lab = token_batches(1, 4, 16, 128, seed=0)[0]
loss = model(ids, lab)
loss.backward()
region = kareus.explain(model).regions[0]
print(json.dumps({"loss": loss.item(), "passes": len(region.history), **counters["inductor"]}))
"""


@pytest.mark.slow  # CI: tests/test_inductor.py's test_no_size_symbol_reaches_inductor
def test_inductor_lowers_a_split_region_with_static_sizes(monkeypatch):
    # The shape environment Inductor's cache needs must not make the sizes symbolic: a
    # region is lowered once per batch size, with the sizes it runs at (symbolic, the
    # first call took 5x as long).
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"])
    ids = torch.randint(0, 128, (8, 16))
    compiled = kareus.compile(copy.deepcopy(model), codegen="inductor", nanobatches=2)
    loss = compiled(ids, ids)
    loss.backward()
    # Within fp32 rounding, not bitwise: Inductor's CPU kernels reduce in an order that
    # depends on the processor's vector width (bitwise on one machine, 5.0941 vs 5.0941
    # off by an ulp on another), which kareus does not control.
    torch.testing.assert_close(loss, model(ids, ids), rtol=1e-5, atol=1e-6)
    assert blocks_run(kareus.explain(compiled).regions[0]).split, "nothing split"
    report = kareus.explain(compiled)
    for kind in ("forward", "backward"):
        assert "sym_size" not in report.graph(kind, captured=True), kind


@pytest.mark.slow
def test_a_second_process_reuses_inductors_code_for_kareus_graphs(tmp_path):
    # Inductor's FX graph cache keys each graph after kareus's passes ran on it, so a
    # training script run again skips Inductor's code generation, not kareus's passes.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", INDUCTOR_RUN],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first.get("fxgraph_cache_miss", 0) >= 2 and not first.get("fxgraph_cache_bypass")
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"]
    assert second["passes"] == first["passes"] > 0 and second["loss"] == first["loss"]


def test_train_helper_records_each_step():
    hist = train(Llama(PRESETS["tiny"]), BATCHES)
    assert len(hist.losses) == len(hist.grads) == 3


IMPORT_WITH_FAKE_CUDA = """
import sys, traceback
import torch
import pynvml

touched = []


def fake(module, name, value=None):
    def call(*args, **kwargs):
        stack = [f for f in traceback.extract_stack() if "/kareus/" in f.filename]
        if stack:
            touched.append(f"{module.__name__}.{name} from {stack[-1].filename}:{stack[-1].lineno}")
        return value
    return call


# A CUDA-capable machine: every CUDA and NVML entry point answers, and says who called it.
for name in ("is_available", "is_initialized"):
    setattr(torch.cuda, name, fake(torch.cuda, name, True))
for name in ("init", "_lazy_init", "current_device", "get_device_name", "get_device_properties",
             "set_device", "device_count", "synchronize", "mem_get_info", "get_device_capability"):
    setattr(torch.cuda, name, fake(torch.cuda, name, 0))
for name in ("nvmlInit", "nvmlInit_v2", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"):
    setattr(pynvml, name, fake(pynvml, name, 0))

import kareus, kareus.cli, kareus.compiler.backend as backend, kareus.runtime.switcher
import kareus.jobs.workload, kareus.jobs.profile, kareus.planner.measured
assert not backend.default_backend._backends, "the default backend was made at import"
print("touched:", touched)
sys.exit(1 if touched else 0)
"""


def test_import_touches_neither_cuda_nor_nvml():
    # Under torchrun every rank imports kareus before torch.cuda.set_device: a CUDA call at
    # import would open a context on GPU 0 in every rank (and break CUDA in forked children).
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_WITH_FAKE_CUDA], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_the_default_backend_is_made_on_first_use():
    from kareus.compiler.backend import _DefaultBackend, find_backend

    default = _DefaultBackend()
    assert not default._backends and "unused" in repr(default)
    compiled = torch.compile(torch.nn.Linear(4, 4), backend=default)
    compiled(torch.randn(2, 4))
    assert len(default._backends) == 1
    assert find_backend(compiled) is default.backend and default.backend.regions


def test_compile_time_plans_record_clocks_but_change_none_unless_asked():
    from kareus.runtime.clocks import DryRunClocks

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))
    quiet = kareus.compile(Llama(PRESETS["tiny"]), gpu="a100-40gb")
    quiet(ids, ids).backward()
    runtime = find_backend(quiet).runtime
    assert isinstance(runtime.controller, DryRunClocks), runtime.controller
    assert runtime.switches, "the planned clocks are recorded"
    assert "clocks='auto'" in str(kareus.explain(quiet))
    asked = kareus.compile(Llama(PRESETS["tiny"]), gpu="a100-40gb", clocks="auto")
    asked(ids, ids).backward()
    controller = find_backend(asked).runtime.controller
    assert not isinstance(controller, DryRunClocks) and controller.name == "emulated"
    assert clocks_on_device(find_backend(asked).runtime), "asked: the clocks were set"
    find_backend(asked).runtime.close()
    runtime.close()
    with pytest.raises(ValueError, match="clocks='always'.*'auto'"):
        kareus.compile(Llama(PRESETS["tiny"]), clocks="always")

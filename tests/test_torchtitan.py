"""kareus on torchtitan itself (0.3.0): its llama3 ``debugmodel`` under its own tensor
parallelism (the ``spmd_types`` backend, its default), with and without sequence
parallelism, over 2 gloo ranks, compiled whole and block by block.

Not kareus's torchtitan-style model (``titan_style.py``): torchtitan's own modules, sharding
and collectives, which gather inside autograd functions into a buffer
(``dist.all_gather_into_tensor(out, x)``) and take the ranks' blocks apart with a chunk or a
view. Skipped where torchtitan cannot be imported (``scripts/setup.sh`` installs it:
``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3``).

Two settings a CPU needs: FlexAttention, torchtitan's attention for language models, has no
backward on a CPU (torch 2.13), so each layer's inner attention is the SDPA one torchtitan's
own graph-trainer tests swap in; and torchtitan imports Triton kernels for its CUDA
expert-parallel dispatch at import time, so without Triton that one module is replaced by
one whose kernels raise if called (a dense model never calls them). The model keeps 2 of
debugmodel's 6 layers (dim 256, 16 heads, vocabulary 2048) to keep the test short.
"""

import importlib.util
import sys
import types

import pytest

from kareus.testing import assert_same_history, blocks_run, overlapped_collectives, run_ranks, train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None
    or importlib.util.find_spec("spmd_types") is None,
    reason="torchtitan 0.3.0 and spmd_types 0.2.3 are not installed (scripts/setup.sh installs "
    "them with pip install --no-deps)",
)

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _without_triton() -> None:
    """Let torchtitan import where Triton is not installed (its CUDA EP kernels raise)."""
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return

    class _Kernels(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def needs_triton(*args, **kwargs):
                raise RuntimeError(f"torchtitan's {name} needs Triton and a CUDA GPU")

            return needs_triton

    sys.modules[_KERNELS] = _Kernels(_KERNELS)


def _titan_config(family: str, name: str):
    """torchtitan's ``family`` model ``name``'s config: 2 layers, SDPA, on a CPU."""
    import importlib

    _without_triton()
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"  # read from CUDA at import
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = importlib.import_module(f"torchtitan.models.{family}").model_registry(name).model
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _built(config):
    import torch

    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _llama3(sp: bool):
    """torchtitan's llama3 debugmodel (2 layers, SDPA) parallelized over TP 2; its context."""
    config = _titan_config("llama3", "debugmodel")  # first: it sets torchtitan's device
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    set_llama3_sharding_config(config, enable_sp=sp)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    model = _built(config)
    model.parallelize(dims)
    return model, dims, get_spmd_context(parallel_dims=dims)


def _batches(dims, count: int):
    """Token batches of 4 x 32 as torchtitan's trainer hands them over (typed for TP)."""
    import torch
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 2048, (4, 32), generator=gen)
        positions = torch.arange(32).expand(4, 32)
        tokens, _labels, kw = annotate_input_spmd_types(
            dims, tokens, tokens.clone(), {"positions": positions}
        )
        out.append((tokens, kw["positions"]))
    return out


def _loss(logits, batch):
    return logits.float().pow(2).mean()  # this rank's vocabulary shard: any scalar will do


def _work(modules) -> list:
    import kareus

    out = []
    for module in modules:
        for region in kareus.explain(module).regions:
            kinds = [
                sorted({c.rstrip("_0123456789") for c in overlapped_collectives(region, side)})
                for side in ("forward", "backward")
            ]
            out.append((blocks_run(region).split, *kinds, str(region.codegen)))
    return out


def _trained(rank, sp: bool, ways: tuple[str, ...] = ("whole", "blocks")):
    import torch

    import kareus

    unpriced = {"codegen": "inductor", "split_when": "communicates"}  # priced, gloo: whole
    out = {}
    for how in ways:
        model, dims, context = _llama3(sp)
        batches = _batches(dims, 2)
        with context():  # two micro-batches, one step: losses and gradients before any update
            ref = train(model, batches, accumulate=2, loss_fn=_loss)
        model, dims, context = _llama3(sp)
        if how == "whole":
            compiled = kareus.compile(model, **unpriced)
            regions = [compiled]
        elif how == "blocks":  # per block, each block replaced by its compiled self
            for name, block in list(model.layers.named_children()):
                model.layers.register_module(name, kareus.compile(block, **unpriced))
            compiled, regions = model, list(model.layers.values())
        else:  # torchtitan's apply_compile: block.compile(backend=..., fullgraph=True)
            for block in model.layers.values():
                block.compile(backend="kareus", fullgraph=True, options=unpriced)
            compiled, regions = model, list(model.layers.values())
        # (the backend string gives kareus no hook to mark the inputs: both are listed)
        sources = "L['x']:0,L['positions']:0" if how == "backend" else ""
        with context(), torch.compiler.config.patch(dynamic_sources=sources):
            got = train(compiled, batches, accumulate=2, loss_fn=_loss)
        out[how] = (ref, got, _work(regions))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torchtitan_llama3_under_its_own_tp_and_sequence_parallelism_is_split_and_overlapped():
    """TP 2 with sequence parallelism, torchtitan's spmd_types collectives (a gather into a
    buffer taken apart by a chunk per rank; a reduce-scatter along the sequence): the whole
    model compiled, every block split, its gathers and reduce-scatters flying over the other
    nanobatch's compute in the graph Inductor compiles; losses and gradients as eager's."""
    both = ["all_gather_into_tensor", "reduce_scatter_tensor"]
    for out in run_ranks(_trained, True, ("whole",), timeout_s=360):
        ref, got, work = out["whole"]
        assert_same_history(ref, got, bitwise_loss=False, rtol=1e-4, atol=1e-5)
        assert [w[0] for w in work] == [["layers.0", "layers.1"]], work
        assert work[0][1:3] == (both, both), work
        assert all("inductor" in w[-1].lower() for w in work), work


@pytest.mark.slow  # CI's sample: the whole model under sequence parallelism, above
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torchtitan_llama3_with_sequence_parallelism_compiled_per_block_is_split_and_overlapped():
    """As above, kareus.compile on each block: every block split, its gathers and
    reduce-scatters overlapped forward and backward. (torchtitan issues them inside autograd
    functions: each nanobatch's copy calls bodies of its own, so their ops carry the copy's
    tag into the graph that runs, where one copy's reduce-scatter is seen flying over the
    other's MLP.)"""
    both = ["all_gather_into_tensor", "reduce_scatter_tensor"]
    for out in run_ranks(_trained, True, ("blocks",), timeout_s=360):
        ref, got, blocks = out["blocks"]
        assert_same_history(ref, got, bitwise_loss=False, rtol=1e-4, atol=1e-5)
        assert [b[0] for b in blocks] == [["Llama3TransformerBlock.0"]] * 2, blocks
        for _split, forward, backward, codegen in blocks:
            assert forward == both and backward == both, blocks
            assert "inductor" in codegen.lower(), blocks


@pytest.mark.slow  # CI's sample: torchtitan with sequence parallelism, above
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchtitan_llama3_under_its_own_tp_without_sequence_parallelism_is_split():
    """TP 2 without sequence parallelism (all-reduces in autograd functions): every block
    split with its all-reduces overlapped; losses and gradients as eager's."""
    for out in run_ranks(_trained, False, ("whole",), timeout_s=240):
        ref, got, work = out["whole"]
        assert_same_history(ref, got, bitwise_loss=False, rtol=1e-4, atol=1e-5)
        assert [w[0] for w in work] == [["layers.0", "layers.1"]], work
        assert work[0][1:3] == (["all_reduce"], ["all_reduce"]), work


@pytest.mark.slow  # CI's sample: kareus.compile per block, above
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchtitans_own_per_block_compile_with_the_kareus_backend_is_split():
    """torchtitan's apply_compile way, ``block.compile(backend="kareus", fullgraph=True)``,
    with the block's inputs that carry the batch (``x`` and ``positions``) listed in
    ``dynamic_sources``: every block split, its gathers and reduce-scatters overlapped;
    losses and gradients as eager's. (Listing ``x`` alone fixes the batch where
    ``positions`` meets it: kareus then keeps the block whole and names both inputs to
    list.)"""
    for out in run_ranks(_trained, True, ("backend",), timeout_s=240):
        ref, got, blocks = out["backend"]
        assert_same_history(ref, got, bitwise_loss=False, rtol=1e-4, atol=1e-5)
        assert [b[0] for b in blocks] == [["Llama3TransformerBlock.0"]] * 2, blocks
        both = ["all_gather_into_tensor", "reduce_scatter_tensor"]
        assert all(b[1] == both for b in blocks), blocks


def _qwen3_moe():
    """torchtitan's Qwen3 MoE debugmodel (2 layers, SDPA, bf16), no parallelism."""
    import torch

    return _built(_titan_config("qwen3", "debugmodel_moe")).to(torch.bfloat16)


def test_torchtitan_qwen3_moe_layers_split_once_its_scatter_add_op_is_declared(monkeypatch):
    """torchtitan's own MoE (token-choice top-k router, argsort dispatch, grouped GEMMs whose
    offsets are a one-hot of the ids summed over the tokens, ``tokens_per_expert`` statistics
    accumulated in place, combine by ``torchtitan::deterministic_scatter_add``): whole, the
    custom op named with how to declare it; declared alike to ``scatter_add``, every MoE
    layer is split, each nanobatch routing its own tokens and adding its own counts to the
    statistics. Losses and gradients within bf16 rounding of eager; the statistics (what
    torchtitan's load-balancing hook updates the router's bias from) exactly equal."""
    import torch

    import kareus
    import kareus.passes.op_effects as op_effects
    from kareus.testing import compare_training

    monkeypatch.setattr(op_effects, "_ALIKE", dict(op_effects._ALIKE))
    monkeypatch.setattr(op_effects, "_ADAPT", dict(op_effects._ADAPT))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 2048, (4, 32), generator=gen),) for _ in range(2)]
    holder = {}

    def comp(m):
        holder["c"] = kareus.compile(m, nanobatches=2, codegen="python")
        return holder["c"]

    def loss(logits, _batch):
        return logits.float().pow(2).mean()

    def run():
        ref, got = compare_training(_qwen3_moe, comp, batches, loss_fn=loss, resync=True)
        return ref, got, blocks_run(kareus.explain(holder["c"]).regions[0])

    model = comp(_qwen3_moe())
    loss(model(batches[0][0]), None).backward()
    whole = blocks_run(kareus.explain(model).regions[0])
    assert whole.split == [] and all(
        "torchtitan::deterministic_scatter_add" in why and "declare_alike" in why
        for why in whole.skipped.values()
    ), whole.skipped

    op_effects.declare_alike(
        torch.ops.torchtitan.deterministic_scatter_add,
        torch.scatter_add,
        args=lambda out, index, src: ((out, 0, index, src), {}),
    )
    ref, got, split = run()
    assert_same_history(ref, got, bitwise_loss=False, rtol=2e-2, atol=2e-3)
    assert len(split.split) == 2, split.skipped
    compiled, eager = holder["c"], _qwen3_moe()
    eager.load_state_dict(compiled.state_dict())  # the same weights, statistics zeroed
    for module in (eager, compiled):
        for name, buffer in module.named_buffers():
            if "tokens_per_expert" in name:
                buffer.zero_()
        for (tokens,) in batches:
            module(tokens)
    stats, want = (
        {n.removeprefix("_orig_mod."): b for n, b in m.named_buffers() if "tokens_per" in n}
        for m in (compiled, eager)
    )
    assert stats.keys() == want.keys() and len(stats) == 2
    for name, buffer in stats.items():
        assert buffer.sum() > 0, name
        torch.testing.assert_close(buffer, want[name], rtol=0, atol=0, msg=name)

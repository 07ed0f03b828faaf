"""Mixture of experts: the layer against a per-token loop, expert parallelism over gloo against
one rank, and tracing at scale pricing the all-to-all and the grouped GEMMs at the planned load."""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kareus.hardware import gpu
from kareus.jobs.trace import Workload, trace
from kareus.jobs.traffic import stage_traffic, stage_work
from kareus.models import Llama, LlamaConfig, preset
from kareus.models.moe import MoE, planned_load
from kareus.testing import run_ranks

CFG = LlamaConfig(num_experts=4, experts_per_token=2, shared_expert_size=32)


def test_planned_load_is_uniform_or_skewed_and_adds_up_to_the_token_copies():
    assert planned_load(64, 4, 2) == (32, 32, 32, 32)
    skewed = planned_load(64, 4, 2, skew=1.5)
    assert skewed[0] == 48 and sum(skewed) == 128 and max(skewed[1:]) - min(skewed[1:]) <= 1
    assert sum(planned_load(1000, 128, 8, skew=3.0)) == 8000
    with pytest.raises(ValueError, match="between 1 .* and 2"):
        planned_load(64, 4, 2, skew=2.5)  # no expert gets a token twice
    with pytest.raises(ValueError, match="between 1"):
        planned_load(64, 4, 2, skew=0.5)


def _by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output, one token and one chosen expert at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = layer.router(tokens).float().softmax(-1)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        weights, chosen = probs[t].topk(layer.top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist(), strict=True):
            h = F.silu(tokens[t] @ layer.w_gate[e]) * (tokens[t] @ layer.w_up[e])
            out[t] += w * (h @ layer.w_down[e])
    assert layer.shared is not None
    gate, up, down = layer.shared
    return (out + down(F.silu(gate(tokens)) * up(tokens))).view(x.shape)


def test_the_layer_computes_each_tokens_chosen_experts_and_their_gradients():
    torch.manual_seed(0)
    layer = MoE(CFG)
    x = torch.randn(3, 8, CFG.hidden_size, requires_grad=True)
    got = layer(x)
    grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    want = _by_token(layer, x)
    ref = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_in_bf16_the_experts_run_as_grouped_gemms_equal_to_one_matmul_per_expert(monkeypatch):
    import kareus.models.moe as moe

    torch.manual_seed(0)
    layer = MoE(CFG).to(torch.bfloat16)
    x = torch.randn(2, 8, CFG.hidden_size, dtype=torch.bfloat16)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(moe, "grouped_mm", lambda: lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped = layer(x)
    assert len(calls) == 3  # gate, up, down: one grouped GEMM each
    monkeypatch.setattr(moe, "grouped_mm", lambda: None)
    torch.testing.assert_close(grouped, layer(x), rtol=2e-2, atol=2e-2)


def _expert_parallel(rank):
    """Rank r's tokens through experts split over 2 gloo ranks, and through all of them."""
    torch.manual_seed(0)
    full = Llama(CFG)
    model = Llama(CFG, ep_group=dist.group.WORLD)
    local = CFG.num_experts // 2
    with torch.no_grad():
        for key, param in model.state_dict().items():
            src = full.state_dict()[key]
            param.copy_(src[rank * local : (rank + 1) * local] if src.shape != param.shape else src)
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, m in (("ep", model), ("full", full)):
        loss = m(ids, ids)
        loss.backward()
        out[name] = (loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()})
    for key, g in out["full"][1].items():
        if ".mlp.w_" in key:  # a rank's experts learn from both ranks' tokens
            dist.all_reduce(g)
            out["full"][1][key] = g[rank * local : (rank + 1) * local]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_experts_split_over_two_gloo_ranks_train_as_all_experts_on_one():
    """Data-dependent counts (a bincount, and an all-to-all of the counts), the dispatch and
    combine all-to-alls with their backward: the loss and every gradient as one rank holding
    all experts computes them (each rank's experts summed over both ranks' tokens)."""
    for out in run_ranks(_expert_parallel):
        (loss, grads), (ref_loss, ref_grads) = out["ep"], out["full"]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for key, g in grads.items():
            torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-5, msg=key)


def _stage(work: Workload):
    stages, notes = trace(work)
    return stages[0], notes


def test_tracing_at_scale_prices_the_all_to_all_and_the_grouped_gemms_at_the_planned_load():
    work = Workload(model="tiny-moe", ep=2, microbatch_size=2, seq_len=16)
    pset, notes = _stage(work)
    ops, colls = stage_work(pset)
    # dispatch and combine forward, both again backward, in each of the 2 layers
    assert [c.kind for c in colls] == ["all_to_all"] * 8 and {c.nodes for c in colls} == {1}
    copies = 2 * 16 * 2  # tokens x experts per token, at the uniform load: as many received
    assert {c.bytes for c in colls} == {copies * CFG.hidden_size * 2}  # bf16
    grouped = [o for o in ops if o.name.startswith("_grouped_mm")]
    assert len(grouped) == 18  # gate, up, down in each layer; twice each in the backward
    assert {o.flops for o in grouped} == {2 * copies * CFG.hidden_size * CFG.intermediate_size}
    assert any("under expert parallelism are planned whole" in n for n in notes), notes
    traffic = stage_traffic(pset, gpu("h100"), 132)
    assert traffic.by_kind["all_to_all"][0] == 8 and traffic.by_kind["all_to_all"][1] > 0
    assert "all-to-all x8" in traffic.describe()

    # The busiest expert at 1.5 x the mean, on the traced rank; its group across two nodes.
    skewed = dataclasses.replace(work, expert_skew=1.5, gpus_per_node=1)
    pset, _notes = _stage(skewed)
    _ops, colls = stage_work(pset)
    load = planned_load(2 * 16, 4, 2, skew=1.5)
    assert load[0] == 24  # 1.5 x the mean
    received = 2 * (load[0] + load[1])  # experts 0 and 1, from each of the 2 ranks
    assert received > copies  # the traced rank receives more than it sends: priced so
    assert {c.nodes for c in colls} == {2}
    assert {c.bytes for c in colls} == {received * CFG.hidden_size * 2}


def test_without_expert_parallelism_tracing_splits_the_moe_layers_as_the_run_would():
    """Every expert on each rank (EP 1, TP 2): the layers keep their counts as tensors, their
    routing is proven per token, and the planner gets each layer split in both directions,
    each half's all-reduce beside the other half's experts (modelled at any load: a grouped
    GEMM's FLOPs are its copies')."""
    work = Workload(model="tiny-moe", tp=2, microbatch_size=4, seq_len=16)
    pset, notes = _stage(work)
    assert {(p.block, p.instruction) for p in pset.partitions} == {
        (f"layers.{i}", kind) for i in range(2) for kind in ("forward", "backward")
    }
    assert not any("planned whole" in n for n in notes), notes
    _ops, colls = stage_work(pset)
    assert colls and {c.kind for c in colls} == {"all_reduce"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": "tiny", "ep": 2}, "needs a mixture-of-experts model"),
        ({"model": "tiny-moe", "ep": 3}, "num_experts=4 is not divisible by the expert-parallel"),
        ({"model": "tiny-moe", "ep": 2, "dp": 3}, "dp=3 is not a multiple of ep=2"),
        ({"model": "tiny-moe", "expert_skew": 3.0}, "expert skew 3.0 must be between 1"),
        ({"model": "tiny", "expert_skew": 2.0}, "needs a mixture-of-experts model"),
    ],
)
def test_expert_layouts_kareus_cannot_trace_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        Workload(**{"microbatch_size": 2, "seq_len": 16, **fields})


def test_the_moe_presets_have_the_published_shapes():
    mixtral, qwen = preset("mixtral-8x7b"), preset("qwen3-30b-a3b")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_size) == (8, 2, 14336)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_size) == (128, 8, 768)
    assert (qwen.num_layers, qwen.hidden_size, qwen.num_kv_heads) == (48, 2048, 4) and qwen.qk_norm


def _compiled_expert_parallel(rank):
    """Eager and kareus.compile'd EP over 2 gloo ranks: losses, gradients, kareus's verdict."""
    import kareus

    torch.manual_seed(0)
    eager = Llama(CFG, ep_group=dist.group.WORLD)
    model = Llama(CFG, ep_group=dist.group.WORLD)
    model.load_state_dict(eager.state_dict())
    compiled = kareus.compile(model, split_when="communicates")
    ids = torch.randint(0, CFG.vocab_size, (4, 8), generator=torch.Generator().manual_seed(rank))
    out = []
    for m in (eager, compiled):
        loss = m(ids, ids)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    return out, kareus.explain(compiled).verdict()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_kareus_compile_runs_expert_parallelism_as_eager_and_says_it_split_nothing():
    """Real routing: the counts are data (a bincount read to Python, an all-to-all of them),
    where Dynamo breaks the graph; kareus compiles the pieces and trains as eager, and says
    that no block was split and its all-to-alls overlap nothing (docs/limits.md)."""
    for (ref, got), verdict in run_ranks(_compiled_expert_parallel):
        torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
        for g, r in zip(got[1], ref[1], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert verdict[0].startswith("split: no, 0 of"), verdict
        # the split sizes are read to Python (.tolist()): the verdict says where it broke
        assert "Dynamo broke the model's graph at moe.py:" in verdict[0], verdict
        # dispatch and combine, forward and backward, in each of the 2 layers
        assert (
            verdict[1]
            == "overlapped: no, 8 collectives overlap no compute (no block split around them)"
        ), verdict


class _Compiles:
    """``kareus.compile`` with ``options`` for compare_training; keeps what it compiled."""

    def __init__(self, **options):
        self.options, self.model = options, None

    def __call__(self, model):
        import kareus

        self.model = kareus.compile(model, **self.options)
        return self.model

    def blocks(self):
        import kareus
        from kareus.testing import blocks_run

        return blocks_run(kareus.explain(self.model).regions[0])


def _hf_moe(kind, experts=None, router_logits=False):
    """A tiny HF MoE model (seeded), with transformers' ``experts`` implementation."""
    from kareus.testing import hf_tiny

    torch.manual_seed(1)
    model = hf_tiny(kind)
    if experts is not None:
        model.set_experts_implementation(experts)
    model.config.output_router_logits = router_logits
    return model


def _hf_batches(count):
    from kareus.testing.training import token_batches

    return [{"input_ids": i, "labels": t} for i, t in token_batches(count, 4, 16, 128)]


def _same_router_statistics(make, compiled, batch):
    """The load-balancing loss and the router's logits of ``compiled``, as eager's."""
    eager = make()
    eager.load_state_dict(compiled.state_dict())
    want, out = eager(**batch), compiled(**batch)
    assert want.aux_loss is not None and want.aux_loss > 0
    torch.testing.assert_close(out.aux_loss, want.aux_loss, rtol=1e-6, atol=0)
    for a, b in zip(out.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hf_eager_experts_loop_over_the_experts_hit_and_stay_whole_naming_the_break():
    """Bad input: transformers' eager experts loop in Python over the experts the batch hit
    (``nonzero``), one shape per expert: Dynamo breaks the graph there; the model trains as
    eager and the verdict names the break, not a piece's reason alone."""
    import kareus
    from kareus.testing import assert_same_history, compare_training

    comp = _Compiles(nanobatches=2, codegen="python")
    make = functools.partial(_hf_moe, "mixtral", "eager")
    ref, got = compare_training(make, comp, _hf_batches(1), loss_fn=lambda o, b: o.loss)
    assert_same_history(ref, got)
    verdict = kareus.explain(comp.model).verdict()[0]
    assert verdict.startswith("split: no") and "modeling_mixtral.py:" in verdict, verdict


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_moe_layers_split_under_transformers_batched_experts(kind):
    """transformers' batched experts (``model.set_experts_implementation("batched_mm")``)
    copy each token once per expert it picks (``repeat_interleave`` by k), look up each
    copy's expert weights by its expert id, and sum each token's copies: no size depends on
    the routing, every op is per token, and kareus splits every MoE layer. Trained beside
    eager with the load-balancing loss in the loss (``output_router_logits``): losses,
    gradients and that loss's statistics (the router's logits) equal eager's."""
    from kareus.testing import assert_same_history, compare_training

    comp = _Compiles(nanobatches=2, strict=True, codegen="python")
    make = functools.partial(_hf_moe, kind, "batched_mm", router_logits=True)
    batches = _hf_batches(2)
    ref, got = compare_training(make, comp, batches, loss_fn=lambda o, b: o.loss, resync=True)
    assert_same_history(ref, got, bitwise_loss=False, rtol=1e-5, atol=1e-6)
    blocks = comp.blocks()
    assert [b.rsplit(".", 2)[-2:] for b in blocks.split] == [["layers", "0"], ["layers", "1"]], (
        blocks.skipped
    )
    _same_router_statistics(make, comp.model, batches[0])


def _moe_beside_eager(model, batches, **options):
    """Train ``model`` eager and kareus-compiled, each step from the same weights."""
    import copy

    import kareus
    from kareus.testing import compare_training

    comp = _Compiles(split_when="communicates", **options)
    ref, got = compare_training(lambda: copy.deepcopy(model), comp, batches, resync=True)
    return ref, got, kareus.explain(comp.model).regions[0]


@pytest.mark.parametrize(
    ("dtype", "codegen"),
    [(torch.float32, "python"), (torch.bfloat16, "inductor")],
    ids=["fp32-every-expert-python", "bf16-grouped-gemms-inductor"],
)
def test_moe_layers_split_each_nanobatch_routing_its_own_tokens(one_rank, dtype, codegen):
    """kareus's MoE under tensor parallelism (a group of one: every collective in the graph):
    each nanobatch sorts its own tokens' copies by expert, runs the experts on them and puts
    them back (kareus.passes.routing proves the sort, the gathers, the grouped GEMMs'
    offsets and the put-back per token), and one half's all-reduce flies over the other
    half's compute. Losses and gradients as eager's: within fp32 rounding (every expert on
    every row), within bf16's for the grouped GEMMs on Inductor (which fuses in bf16)."""
    from kareus.testing import assert_same_history, blocks_run, overlapped_collectives
    from kareus.testing.training import token_batches

    torch.manual_seed(0)
    model = Llama(CFG, tp_group=one_rank).to(dtype)
    batches = token_batches(2, 4, 16, CFG.vocab_size)
    ref, got, region = _moe_beside_eager(model, batches, codegen=codegen)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    assert_same_history(ref, got, bitwise_loss=False, **tol)
    assert blocks_run(region).split == ["layers.0", "layers.1"], blocks_run(region).skipped
    for side in ("forward", "backward"):
        flying = overlapped_collectives(region, side)
        assert flying and all("all_reduce" in c for c in flying), (side, flying)


class _CapacityMoE(torch.nn.Module):
    """Top-1 routing that drops the copies past each expert's capacity, counted in token
    order (a cumsum over the batch's tokens): which tokens an expert keeps depends on the
    whole batch."""

    def __init__(self, hidden=16, experts=4, capacity=3):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.capacity = capacity

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        _weights, chosen = self.router(tokens).topk(1, dim=-1)
        onehot = F.one_hot(chosen.squeeze(-1), self.w.shape[0])
        kept = ((onehot.cumsum(0) * onehot).sum(-1) <= self.capacity).unsqueeze(-1)
        out = torch.einsum("th,thk->tk", tokens, self.w[chosen.squeeze(-1)])
        return (tokens + torch.where(kept, out, 0.0)).view(x.shape)


class _SwappedMoE(torch.nn.Module):
    """A routing that swaps neighbouring rows in the experts' order before putting them back
    (a view of [copies, h] as [copies / 2, 2, h], flipped): fine in token order, where a
    sample's rows are neighbours; in the sort's order they are other tokens'."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        _weights, chosen = self.router(tokens).topk(2, dim=-1)
        order = chosen.flatten().argsort(stable=True)
        rows = tokens[order // 2] @ self.w
        swapped = rows.view(-1, 2, rows.shape[-1]).flip(1).reshape(rows.shape)
        return torch.zeros_like(tokens).index_add(0, order // 2, swapped).view(x.shape)


class _Stack(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layers = torch.nn.ModuleList([layer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize(
    ("layer", "named"),
    [(_CapacityMoE, "cumsum"), (_SwappedMoE, "regroups the rows")],
    ids=["capacity-dropping", "rows-swapped-in-expert-order"],
)
def test_routings_that_mix_tokens_stay_whole_and_say_why(layer, named):
    """Bad input: capacity-factor dropping (which copies an expert keeps depends on the whole
    batch) and a routing that mixes neighbouring copies in the experts' order: kept whole,
    the op named, and the numbers those of eager."""
    from kareus.testing import assert_same_history, compare_training

    comp = _Compiles(nanobatches=2, codegen="python")
    torch.manual_seed(0)
    batches = [(torch.randn(4, 8, 16),) for _ in range(2)]
    ref, got = compare_training(lambda: _Stack(layer), comp, batches)
    assert_same_history(ref, got)
    blocks = comp.blocks()
    assert blocks.split == [] and set(blocks.skipped) == {"layers.0", "layers.1"}
    assert all(named in why for why in blocks.skipped.values()), blocks.skipped


def test_hf_mixtral_grouped_experts_split_once_their_fallback_op_is_declared(monkeypatch):
    """transformers' default experts (``grouped_mm``) sort the copies by expert; in fp32
    under torch.compile they run ``transformers::grouped_mm_fallback``, a custom op kareus
    cannot read: the layers stay whole and say how to declare it. Declared alike to
    ``torch._grouped_mm`` (``kareus.passes.op_effects.declare_alike``), every layer is
    split, and the loss with its load-balancing term, the gradients and the router's logits
    equal eager's."""
    import kareus.passes.op_effects as op_effects
    from kareus.testing import assert_same_history, compare_training

    comp = _Compiles(nanobatches=2, codegen="python")
    make = functools.partial(_hf_moe, "mixtral", router_logits=True)
    batches = _hf_batches(2)
    monkeypatch.setattr(op_effects, "_ALIKE", dict(op_effects._ALIKE))
    ref, got = compare_training(make, comp, batches, loss_fn=lambda o, b: o.loss, resync=True)
    assert_same_history(ref, got)
    whole = comp.blocks()
    assert whole.split == [] and all("declare_alike" in why for why in whole.skipped.values()), (
        whole.skipped
    )

    op_effects.declare_alike(torch.ops.transformers.grouped_mm_fallback, torch._grouped_mm)
    ref, got = compare_training(make, comp, batches, loss_fn=lambda o, b: o.loss, resync=True)
    assert_same_history(ref, got, bitwise_loss=False, rtol=1e-5, atol=1e-6)
    split = comp.blocks()
    assert len(split.split) == 2, split.skipped
    _same_router_statistics(make, comp.model, batches[0])


def _tp2_moe(rank):
    """kareus's MoE Llama at TP 2 over gloo (expert TP = TP), compiled beside eager."""
    import kareus
    from kareus.testing import blocks_run, compare_training, overlapped_collectives
    from kareus.testing.training import token_batches

    torch.manual_seed(0)
    comp = _Compiles(codegen="python", split_when="communicates")

    ref, got = compare_training(
        lambda: Llama(CFG, tp_group=dist.group.WORLD),
        comp,
        token_batches(2, 4, 16, CFG.vocab_size, seed=rank),
        resync=True,
    )
    region = kareus.explain(comp.model).regions[0]
    flying = [overlapped_collectives(region, side) for side in ("forward", "backward")]
    return ref, got, blocks_run(region).split, flying


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_moe_layers_split_under_tensor_parallelism_over_two_gloo_ranks():
    """Two real ranks: each routes its nanobatches' tokens alike (the router is replicated),
    each expert's intermediate dimension is split over the ranks, and one nanobatch's
    all-reduce flies over the other's experts, forward and backward; both ranks train as
    eager within fp32 rounding."""
    from kareus.testing import assert_same_history

    for ref, got, split, flying in run_ranks(_tp2_moe, timeout_s=240):
        assert_same_history(ref, got, bitwise_loss=False, rtol=1e-5, atol=1e-6)
        assert split == ["layers.0", "layers.1"], split
        for side in flying:
            assert side and all("all_reduce" in c for c in side), flying

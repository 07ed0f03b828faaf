"""The reference model family: presets, parallel-size errors, and TP/CP equal to unsharded."""

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus.models import PRESETS, Llama, LlamaConfig, cp_shard, preset
from kareus.runtime.clocks import EmulatedClocks
from kareus.testing import blocks_run, run_ranks

CFG = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def test_presets_have_the_published_shapes():
    cfg = preset("llama3.2-3b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (28, 3072, 24, 8)
    assert cfg.intermediate_size == 8192 and cfg.vocab_size == 128256 and cfg.tie_embeddings
    assert preset("llama3.3-70b").num_layers == 80 and not preset("llama3.3-70b").tie_embeddings
    qwen = preset("qwen3-1.7b")
    assert qwen.qk_norm and qwen.dim_per_head == 128 and qwen.num_heads * 128 == qwen.hidden_size
    assert {"llama3.2-1b", "llama3.1-8b", "qwen3-8b", "tiny"} <= set(PRESETS)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'llama9'.*llama3.2-3b"):
        preset("llama9")


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"tp": 16}, "num_kv_heads=8 is not divisible by the tensor-parallel size 16"),
        ({"pp": 3}, "num_layers=28 is not divisible by the pipeline-parallel size 3"),
        (
            {"cp": 3, "seq_len": 4096},
            "seq_len=4096 is not divisible by the doubled context-parallel size",
        ),
        ({"tp": 0}, "must be at least 1"),
    ],
)
def test_parallel_sizes_that_do_not_divide_are_named(sizes, message):
    with pytest.raises(ValueError, match=message):
        preset("llama3.2-3b").check_parallel(**sizes)


def test_cp_shard_gives_each_rank_an_early_and_a_late_chunk():
    seq = torch.arange(8).view(1, 8)
    assert [cp_shard(seq, r, 2).tolist() for r in range(2)] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert cp_shard(seq, 0, 1) is seq
    with pytest.raises(ValueError, match="multiple of 6"):
        cp_shard(seq, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is not one of the 2"):
        cp_shard(seq, 2, 2)


def test_pipeline_stages_hold_their_layers_and_chain_to_the_full_model():
    torch.manual_seed(0)
    full = Llama(CFG)
    stages = [Llama(CFG, stage=(i, 2)) for i in range(2)]
    for s in stages:
        s.load_unsharded(full.state_dict())
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    assert len(stages[0].layers) == 1 and stages[0].lm_head is None and stages[1].embed is None
    torch.testing.assert_close(stages[1](stages[0](ids), ids), full(ids, ids), rtol=0, atol=0)


def _step(model, run, ids, labels):
    loss = run(ids, labels)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _unsharded(seq):
    """The unsharded model, a batch of 4 sequences of ``seq`` tokens, its loss and grads."""
    torch.manual_seed(0)
    full = Llama(CFG)
    ids = torch.randint(0, CFG.vocab_size, (4, seq))
    labels = torch.randint(0, CFG.vocab_size, (4, seq))
    return full, ids, labels, *_step(full, full, ids, labels)


def _sharded_vs_full(rank, mode):
    """Loss and gradients of the TP or CP model (eager and kareus) against the unsharded."""
    full, ids, labels, ref_loss, ref_grads = _unsharded(8)
    out = {}
    attention_flops: dict[str, float] = {}
    hows = ("eager", "kareus", "planned") if mode == "tp" else ("eager", "kareus")
    for how in hows:
        if mode == "tp":
            model = Llama(CFG, tp_group=dist.group.WORLD)
            x, y = ids, labels
        else:
            model = Llama(CFG, cp_group=dist.group.WORLD)
            x, y = cp_shard(ids, rank, 2), cp_shard(labels, rank, 2)
        model.load_unsharded(full.state_dict())
        run = model
        if how == "kareus":
            # the split unpriced (on these CPUs it does not pay; its numbers are checked)
            run = kareus.compile(model, strict=True, split_when="communicates")
        elif how == "planned":  # no plan given: compile plans for the named GPU type
            run = kareus.compile(
                model,
                strict=True,
                gpu="a100-40gb",
                clocks=EmulatedClocks(),
                split_when="communicates",
            )
            _step(model, run, x, y)  # the first step plans; the second runs the plan
            model.zero_grad()
        loss, grads = _step(model, run, x, y)
        if mode == "cp":  # each rank's loss is its chunk's mean: average as with DP
            dist.all_reduce(loss)
            loss /= 2
            for g in grads.values():
                dist.all_reduce(g)
                g /= 2
        diffs = {}
        for key, g in grads.items():
            want = ref_grads[model._unsharded_key(key)]
            dims = [d for d in range(want.dim()) if want.shape[d] != g.shape[d]]
            if dims:
                want = want.chunk(want.shape[dims[0]] // g.shape[dims[0]], dims[0])[rank]
            diffs[key] = (g, want)
        split = None
        if how != "eager":
            region = kareus.explain(run).regions[0]
            split = blocks_run(region).split
            pset = region.findings.partitions
            ops = list(pset.outside("forward"))
            for p in pset.partitions:
                if p.instruction == "forward":
                    ops += pset.types[p.type_key].compute
            attention_flops[how] = sum(o.flops for o in ops if o.op_class == "attention")
        if how == "planned":
            plan = region.inputs.plan
            split = (
                split,
                plan.gpu,
                plan.parallel["tp"],
                region.inputs.clock_runtime.switches,
            )
        out[how] = (loss, ref_loss, diffs, split)
    out["attention_flops"] = attention_flops["kareus"]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
# CI: CP (TP against eager is test_tensor_parallel.py's and test_sequence_split.py's)
@pytest.mark.parametrize("mode", [pytest.param("tp", marks=pytest.mark.slow), "cp"])
def test_tensor_and_context_parallel_match_the_unsharded_model(mode):
    results = run_ranks(_sharded_vs_full, mode)
    flops = [result.pop("attention_flops") for result in results]
    b, s, d, layers = 4, 8, CFG.dim_per_head, CFG.num_layers
    if mode == "cp":
        # Each rank's two chunks (c = s / 4 tokens) attend to their key prefixes, c and 4c
        # keys on rank 0, 2c and 3c on rank 1: the same (2 CP + 1) c^2 scores on both.
        c = s // 4
        assert flops == [layers * 4 * b * CFG.num_heads * d * 5 * c * c] * 2
    else:  # causal over the whole sequence, heads split over the two ranks
        assert flops == [layers * 4 * b * CFG.num_heads // 2 * d * s * (s + 1) / 2] * 2
    for rank, result in enumerate(results):
        for how, (loss, ref_loss, diffs, split) in result.items():
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"{how} loss")
            for key, (got, want) in diffs.items():
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, k=key, h=how, r=rank: f"{h} r{r} {k}: {m}",
                )
            if how == "kareus":
                assert split, f"kareus split no block of the {mode} model"
            if how == "planned":
                blocks, gpu, tp, switches = split
                assert blocks and gpu.lower() == "a100-sxm4-40gb" and tp == 2
                assert switches, "the planned clocks were never applied"


def _context_parallel_4(rank):
    """Loss and gradients of the model over 4 context-parallel ranks, eager and kareus."""
    full, ids, labels, ref_loss, ref_grads = _unsharded(16)
    out = {}
    for how in ("eager", "kareus"):
        model = Llama(CFG, cp_group=dist.group.WORLD)
        model.load_unsharded(full.state_dict())
        run = (
            kareus.compile(model, strict=True, split_when="communicates")
            if how == "kareus"
            else model
        )
        loss, grads = _step(model, run, cp_shard(ids, rank, 4), cp_shard(labels, rank, 4))
        dist.all_reduce(loss)  # each rank's loss is the mean over its chunks
        for g in grads.values():
            dist.all_reduce(g)
        out[how] = (loss / 4, {k: (g / 4, ref_grads[k]) for k, g in grads.items()})
    return ref_loss, out


# CI's sample leaves it out: CP at 4 ranks; CP at 2 stays in CI
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_four_context_parallel_ranks_match_the_unsharded_model():
    # Rank r holds chunks r and 7 - r of 8: the gathered chunks come back in sequence order
    # only if the second halves are reversed across the ranks, an order two ranks check
    # only as a swap.
    for rank, (ref_loss, out) in enumerate(run_ranks(_context_parallel_4, world=4)):
        for how, (loss, grads) in out.items():
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"{how} loss")
            for key, (got, want) in grads.items():
                torch.testing.assert_close(
                    got, want, rtol=1e-5, atol=1e-5, msg=f"{how} r{rank} {key}"
                )


def _tensor_parallel_with_plan(rank, plan_json):
    """One step of the TP model eager and compiled with a plan of the original graphs."""
    from kareus.ir.plan_file import Plan

    torch.manual_seed(0)
    full = Llama(CFG)
    ids = torch.randint(0, CFG.vocab_size, (4, 8))
    labels = torch.randint(0, CFG.vocab_size, (4, 8))
    out = {}
    for how in ("eager", "planned"):
        model = Llama(CFG, tp_group=dist.group.WORLD)
        model.load_unsharded(full.state_dict())
        clocks = EmulatedClocks()
        run = model
        if how == "planned":
            run = kareus.compile(model, strict=True, plan=Plan.from_json(plan_json), clocks=clocks)
        out[how] = _step(model, run, ids, labels)
        if how == "planned":
            region = kareus.explain(run).regions[0]
            backend = kareus.compiler.backend.find_backend(run)
            out["split"] = blocks_run(region).split
            out["switches"] = backend.runtime.switches
            backend.runtime.close()
    return out


# CI's sample leaves it out: plans under TP stay in CI: tests/test_inductor.py,
# tests/test_stacks.py
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_plan_that_runs_the_original_graphs_applies_under_tensor_parallelism():
    """`kareus plan` finds that splitting this small model does not pay: its plan runs the
    original graphs. Applied on two gloo ranks, the model's collectives and matmuls match
    the traced plan's fingerprint (a bf16 plan for this fp32 model is refused: its
    all-reduces are half the size), nothing is split, its clocks are switched, and the
    losses and gradients are those of the eager model bit for bit."""
    from kareus.jobs.trace import Workload
    from kareus.jobs.workload import plan_workload
    from kareus.planner import PlannerSettings

    work = Workload(model=CFG, tp=2, microbatch_size=4, seq_len=8, microbatches=1, dtype="fp32")
    settings = PlannerSettings(clocks_mhz=(1410, 1005), sweep_points=2)
    plan = plan_workload(work, "a100-40gb", settings=settings, cache=False).plan
    assert plan.nanobatches == 1
    assert "all_reduce" in plan.fingerprint["0/forward"]["whole"]
    for result in run_ranks(_tensor_parallel_with_plan, plan.to_json()):
        (loss, grads), (ref_loss, ref_grads) = result["planned"], result["eager"]
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
        assert not result["split"]
        # a switch is made where the clock changes
        clocks = [s.freq_mhz for s in plan.schedule]
        assert result["switches"] == [
            c for i, c in enumerate(clocks) if not i or c != clocks[i - 1]
        ]

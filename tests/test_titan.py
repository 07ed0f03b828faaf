"""kareus on jobs laid out as torchtitan lays out llama3: TP with sequence parallelism,
blocks compiled one by one, FSDP2 on a (dp, tp) mesh, blocks compiled after FSDP2 wrapped
them (the order of a user adding kareus to a running FSDP2 job).

Every test asserts both halves: losses and gradients as without kareus, and kareus at work
(every block split into nanobatches, its collectives flying over the other nanobatch's
compute in the graph that runs on Inductor, kareus's default path).
"""

import pytest
from titan_style import Args, apply_tp, build, compile_blocks

import kareus
from kareus.testing import (
    assert_same_history,
    blocks_run,
    compare_training,
    overlapped_collectives,
    run_ranks,
    token_batches,
    train,
)


def _on_inductor(module):
    """kareus.compile on its default path (the test suite's default is python codegen).

    The split unpriced: at these sizes on a CPU it does not pay, and whether each layout's
    blocks split and overlap right is what is checked.
    """
    return kareus.compile(module, codegen="inductor", split_when="communicates")


def _batches(count: int, seed: int = 0):
    return token_batches(count, 4, 8, Args().vocab_size, seed=seed)


def _work(modules) -> list:
    """(blocks split, collectives overlapped in the forward, codegen) of each region."""
    out = []
    for module in modules:
        for region in kareus.explain(module).regions:
            codegen = region.codegen
            out.append(
                (
                    blocks_run(region).split,
                    sorted({_kind(c) for c in overlapped_collectives(region, "forward")}),
                    getattr(codegen, "value", codegen),
                )
            )
    return out


def _kind(name: str) -> str:
    return name.rstrip("_0123456789")


def _sequence_parallel(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    holder = {}

    def whole(model):
        holder["whole"] = kareus.compile(model, codegen="inductor", split_when="communicates")
        return holder["whole"]

    def blocks(model):
        holder["blocks"] = compile_blocks(model, _on_inductor)
        return holder["blocks"]

    make = lambda: apply_tp(build(), mesh)  # noqa: E731
    out = {}
    for how, compile_fn in (("whole", whole), ("blocks", blocks)):
        ref, got = compare_training(make, compile_fn, _batches(2), resync=True)
        out[how] = (ref, got)
    out["whole work"] = _work([holder["whole"]])
    out["blocks work"] = _work(holder["blocks"].layers.values())
    return out


# CI's sample leaves it out: DTensor SP; in CI: torchtitan itself (tests/test_torchtitan.py) and
# funcol's forms (tests/test_per_sample.py)
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchtitan_tensor_parallel_with_sequence_parallel_splits_every_block():
    """torchtitan's llama3 TP plan with sequence parallelism (norms sequence-sharded, each
    block's input gathered along the sequence, its outputs reduce-scattered back; 2 gloo
    ranks), compiled whole and block by block: trains as without kareus; every block is
    split and its gathers and reduce-scatters fly over the other nanobatch's compute."""
    for out in run_ranks(_sequence_parallel):
        for how in ("whole", "blocks"):
            ref, got = out[how]
            assert_same_history(ref, got, bitwise_loss=False)
        whole, blocks = out["whole work"], out["blocks work"]
        assert [w[0] for w in whole] == [["layers.0", "layers.1"]], whole
        assert [b[0] for b in blocks] == [["TransformerBlock.0"]] * 2, blocks
        for _split, overlapped, codegen in whole + blocks:
            assert overlapped == ["all_gather_into_tensor", "reduce_scatter_tensor"], overlapped
            assert codegen == "inductor"


def _after_fsdp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def make(compiled: bool):
        model = apply_tp(build(), mesh["tp"])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        if compiled:  # after FSDP2: a user adding kareus to a running job
            compile_blocks(model, _on_inductor)
        return model

    # two micro-batches, one step: losses and gradients compared before any update
    data = _batches(2, seed=mesh["dp"].get_local_rank())
    ref = train(make(False), data, accumulate=2)
    model = make(True)
    got = train(model, data, accumulate=2)
    return ref, got, _work(model.layers.values())


# CI's sample leaves it out: 4 ranks; FSDP2 x TP blocks in CI: tests/test_stacks.py's 2-D mesh
# test
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_blocks_compiled_after_fsdp2_wrapped_them_are_split():
    """(dp 2, tp 2) on 4 gloo ranks: TP with sequence parallelism in each block, FSDP2 per
    block and at the root, then each block compiled by kareus. FSDP2's pre-forward hook
    hands the block new input tensors: the batch is still dynamic there, so 2 of 2 blocks
    are split with their collectives overlapped, and training is as without kareus."""
    for ref, got, work in run_ranks(_after_fsdp, world=4, timeout_s=360):
        assert_same_history(ref, got, bitwise_loss=False)
        assert [w[0] for w in work] == [["TransformerBlock.0"]] * 2, work
        for _split, overlapped, _codegen in work:
            assert "all_gather_into_tensor" in overlapped, overlapped

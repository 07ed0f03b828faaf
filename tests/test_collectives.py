"""Collectives are never lost: in-place ``dist`` calls inside autograd.Functions, the census
the pass runner keeps, and the fallback when a rewrite drops one."""

import collections

import pytest
import torch
import torch.distributed as dist

import kareus
import kareus.passes.pipeline
from kareus.errors import PassError
from kareus.ir.partitions import Decision, PartitionSet
from kareus.passes.base import GraphPass, PassResult
from kareus.passes.census import census, lost
from kareus.testing import (
    InplaceTPLayer,
    InplaceTPNet,
    assert_same_history,
    blocks_run,
    compare_training,
    node_lines,
    run_ranks,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class _Grab(GraphPass):
    name = "grab"
    graphs = frozenset({"forward", "backward"})

    def __init__(self):
        self.counts = {}

    def run(self, gm, ctx):
        self.counts[ctx.graph] = collections.Counter(
            {(k, g): n for (_s, k, g), n in census(gm).items()}
        )
        return PassResult(gm, False)


def _batches(sequence_parallel):
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 4, 16, generator=gen), torch.randn(8, 4, 16, generator=gen))
        for _ in range(2)
    ]
    if sequence_parallel:  # each rank holds its slice of the sequence
        w, r = dist.get_world_size(), dist.get_rank()
        batches = [
            (x.chunk(w, 1)[r].contiguous(), y.chunk(w, 1)[r].contiguous()) for x, y in batches
        ]
    return batches


def _trained(make, batches, **options):
    """Train ``make()`` eager and kareus-compiled side by side; return both histories, the
    collectives of the compiled graphs and the region's report."""
    grab = _Grab()
    saved = kareus.passes.pipeline.PIPELINE
    kareus.passes.pipeline.PIPELINE = (*saved, grab)
    holder = {}

    def comp(m):
        # every block meeting a collective is split, unpriced: on these CPUs with tiny
        # layers the split does not pay (tests/test_split_pricing.py), and the split's
        # handling of each collective is what is checked here
        holder["c"] = kareus.compile(m, **{"split_when": "communicates", **options})
        return holder["c"]

    try:
        torch._dynamo.reset()
        ref, got = compare_training(make, comp, batches, resync=True)
    finally:
        kareus.passes.pipeline.PIPELINE = saved
    return ref, got, grab.counts, kareus.explain(holder["c"]).regions[0]


def _train(sequence_parallel, **options):
    def make():
        torch.manual_seed(1)
        return InplaceTPNet(sequence_parallel=sequence_parallel)

    ref, got, counts, region = _trained(make, _batches(sequence_parallel), **options)
    pset = region.findings.partitions
    with_collective = sum(1 for p in pset.partitions if p.collective is not None)
    blocks = blocks_run(region)
    return ref, got, counts, blocks.split, with_collective, region.notes


def _inplace_runs(rank):
    out = {}
    for sp in (False, True):
        out[sp, 1] = _train(sp, strict=True, nanobatches=1)
        out[sp, 2] = _train(sp, strict=True)
    return out


@pytest.fixture(scope="module")
def inplace_runs():
    return run_ranks(_inplace_runs)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_inplace_dist_collectives_survive_the_split(inplace_runs, sequence_parallel):
    for per_rank in inplace_runs:
        ref, got, counts, split, with_collective, _notes = per_rank[sequence_parallel, 2]
        assert split == ["layers.0", "layers.1", "layers.2"]
        # Losses bitwise, gradients within fp32 rounding of the uncompiled model.
        assert_same_history(ref, got)
        # Every layer's collectives are in both AOT graphs, once per nanobatch.
        whole = per_rank[sequence_parallel, 1][2]
        for graph in ("forward", "backward"):
            # 3 layers x ("f" or "g"; all-gather and reduce-scatter with SP)
            assert sum(whole[graph].values()) == 3 * (1 + sequence_parallel), whole
            assert counts[graph] == collections.Counter({k: 2 * n for k, n in whole[graph].items()})
        kinds = {k for k, _g in counts["forward"]}
        assert kinds == (
            {"all_gather_into_tensor", "reduce_scatter_tensor"}
            if sequence_parallel
            else {"all_reduce"}
        )
        # ... and they are overlapped: partitions with a collective in both directions.
        assert with_collective >= 8


class _GatherParam(torch.autograd.Function):
    """SimpleFSDP's parameter gather: all-gather the shards forward, reduce-scatter back."""

    @staticmethod
    def forward(ctx, shard):
        out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
        dist.all_gather_into_tensor(out, shard.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


class _FSDPLayer(torch.nn.Module):
    """A layer whose weight is sharded and gathered in the graph, as SimpleFSDP writes it,
    then (with ``tp``) a tensor-parallel MLP."""

    def __init__(self, width, tp):
        super().__init__()
        self.shard = torch.nn.Parameter(torch.randn(width // 2, width) * 0.2)
        self.tp = InplaceTPLayer(width, sequence_parallel=False) if tp else None

    def forward(self, x):
        x = x + torch.tanh(x @ _GatherParam.apply(self.shard))
        return x if self.tp is None else self.tp(x)


class _FSDPNet(torch.nn.Module):
    def __init__(self, tp, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_FSDPLayer(16, tp) for _ in range(layers))

    def forward(self, x, target):
        for layer in self.layers:
            x = layer(x)
        return ((x - target) ** 2).mean()


def _fsdp_runs(rank):
    out = {}
    for tp in (False, True):

        def make(tp=tp):
            torch.manual_seed(1)
            return _FSDPNet(tp)

        ref, got, counts, region = _trained(make, _batches(False), strict=True)
        blocks = blocks_run(region)
        out[tp] = ref, got, counts, blocks.split, dict(blocks.skipped)
    return out


def test_a_parameter_gathered_in_the_graph_is_shared_by_both_nanobatches():
    """SimpleFSDP-style layers (the weight all-gathered in the graph, its gradient
    reduce-scattered): the gather reads nothing that carries the batch, so a split block
    runs it once for both nanobatches (twice would move the weights twice, and the
    collective census refused that split), while its tensor-parallel all-reduces run per
    nanobatch. A layer whose only collective is the gather is left whole, saying why."""
    for per_rank in run_ranks(_fsdp_runs):
        ref, got, counts, split, skipped = per_rank[True]
        assert split == ["layers.0", "layers.1"]
        assert_same_history(ref, got)
        forward = {k: n for (k, _g), n in counts["forward"].items()}
        backward = {k: n for (k, _g), n in counts["backward"].items()}
        # 2 layers: the gather and its reduce-scatter once each, the "g" and "f" all-reduces
        # once per nanobatch
        assert forward == {"all_gather_into_tensor": 2, "all_reduce": 4}
        assert backward == {"reduce_scatter_tensor": 2, "all_reduce": 4}
        ref, got, _counts, split, skipped = per_rank[False]
        assert split == [] and set(skipped) == {"layers.0", "layers.1"}
        assert all("act on nothing that carries the batch" in r for r in skipped.values())
        assert_same_history(ref, got)


def _gathered_whole_runs(rank):
    """Three SimpleFSDP-style layers planned at compile time for an A100 (without a plan,
    the default decisions: test_stacks.py's SimpleFSDP tests)."""

    def make():
        torch.manual_seed(1)
        return _FSDPNet(False, layers=3)

    ref, got, _counts, region = _trained(make, _batches(False), strict=True, gpu="a100-40gb")
    pset = region.findings.partitions
    codes = {kind: region.graphs[kind].final_code for kind in ("forward", "backward")}
    decisions = dict(region.inputs.decisions)
    split = blocks_run(region).split
    return ref, got, pset, codes, decisions, split, region.inputs.plan


def test_a_gather_in_the_graph_overlaps_the_layer_before_where_layers_stay_whole():
    """SimpleFSDP without tensor parallelism: no layer splits (its only collectives are on
    its weight), but each layer's weight all-gather reads nothing the layer before computes,
    and each weight gradient's reduce-scatter is read by nothing the layer after computes:
    cut_partitions overlaps them with those layers (partitions of a block left whole), the
    plan decides their clock, launch slot and SM share as for the split's, and the graphs
    issue the gather during the layer before and wait for the reduce-scatter after the
    layer after. Results are those of the model without kareus."""
    for ref, got, pset, codes, decisions, split, plan in run_ranks(_gathered_whole_runs):
        assert split == []
        assert_same_history(ref, got)
        whole = [p for p in pset.partitions if p.whole]
        assert whole == pset.partitions
        # 3 layers: the 2nd and 3rd layers' gathers during the layer before (forward),
        # the 3rd and 2nd layers' reduce-scatters during the layer after (backward).
        assert [(p.instruction, p.block) for p in whole] == [
            ("forward", "layers.0"),
            ("forward", "layers.1"),
            ("backward", "layers.1"),
            ("backward", "layers.0"),
        ]
        kinds = {p.instruction: pset.types[p.type_key].collective.kind for p in whole}
        assert kinds == {"forward": "all_gather", "backward": "reduce_scatter"}
        # One gather and one reduce-scatter, the first layer's, still overlap nothing.
        assert [c.kind for c in pset.exposed["forward"]] == ["all_gather"]
        assert [c.kind for c in pset.exposed["backward"]] == ["reduce_scatter"]
        assert "overlap compute of a block left whole" in pset.to_text()
        assert PartitionSet.from_json(pset.to_json()).partitions == pset.partitions
        for part in whole:
            at = node_lines(codes[part.instruction])
            issue, wait = part.collective
            slot = decisions.get(part.type_key, Decision()).launch_slot
            assert slot is not None, decisions
            first = part.slots[slot].first
            before = part.compute[: part.compute.index(first)]
            # issued at the decided slot, waited for after the window's compute
            assert all(at[n] < at[issue] for n in before), (part, codes[part.instruction])
            assert at[issue] < at[first] and at[wait] > max(at[n] for n in part.compute)
        # Planned at compile time: each of these types got a decision of its own, and
        # the overlap pays in the model: kareus's fastest plan beats Megatron-LM's
        # (every collective alone).
        keys = {p.type_key for p in whole}
        assert keys <= set(decisions) and plan is not None
        fastest = min(p.time_s for p in plan.frontier)
        assert fastest < min(p.time_s for p in plan.baselines["megatron"])


def _dropping_runs(rank):
    import kareus.passes.split_nanobatches as split

    keep = split._erase_unused
    # fx's dead-code elimination drops the copy_ that writes an in-place all-reduce back.
    split._erase_unused = lambda graph, made: graph.eliminate_dead_code()
    try:
        ref, got, _counts, split_blocks, _w, notes = _train(False)
        try:
            _train(False, strict=True)
            strict_error = ""
        except Exception as err:  # Dynamo wraps the PassError
            strict_error = str(err)
        return ref, got, split_blocks, notes, strict_error
    finally:
        split._erase_unused = keep


def test_a_pass_that_drops_a_collective_is_refused_and_the_region_runs_as_captured():
    for ref, got, split_blocks, notes, strict_error in run_ranks(_dropping_runs):
        assert split_blocks == []  # the split was refused...
        assert_same_history(ref, got)  # ...so results are exact: the bodies were not touched
        assert any("runs as captured" in n and "lost 6 backward all_reduce" in n for n in notes)
        assert "lost 6 backward all_reduce" in strict_error
        assert "6 forward all_reduce" in strict_error
        assert "split_nanobatches" in strict_error


def test_census_counts_bodies_per_call_and_ignores_dead_waits():
    import torch.fx as fx

    fc = torch.ops._c10d_functional

    def body_fn(x):
        w = fc.wait_tensor(fc.all_reduce(x, "sum", "g"))
        return x.add_(w)

    body = fx.symbolic_trace(body_fn)
    dead = fx.symbolic_trace(lambda x: (fc.wait_tensor(fc.all_reduce(x, "sum", "g")), x)[1])
    root = torch.nn.Module()
    root.body, root.dead = body, dead
    graph = fx.Graph()
    x = graph.placeholder("x")
    b = graph.get_attr("body")
    d = graph.get_attr("dead")
    wrap = torch.ops.higher_order.wrap
    first = graph.call_function(wrap, (b, x))
    second = graph.call_function(wrap, (b, first))
    third = graph.call_function(wrap, (d, second))
    graph.output(third)
    gm = fx.GraphModule(root, graph)
    counts = census(gm)
    assert counts == collections.Counter({("forward", "all_reduce", "g"): 2})
    assert census(gm, [first]) == collections.Counter({("forward", "all_reduce", "g"): 1})
    assert lost(counts, census(gm, [first])) == collections.Counter(
        {("forward", "all_reduce", "g"): 1}
    )


def test_runner_refuses_a_pass_that_loses_a_collective_unannounced():
    from kareus.compiler.config import Config
    from kareus.passes.base import PassContext, run_passes

    fc = torch.ops._c10d_functional

    class Drop(GraphPass):
        name = "drop"
        graphs = frozenset({"forward"})

        def run(self, gm, ctx):
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target is fc.wait_tensor.default:
                    node.replace_all_uses_with(node.args[0].args[0])
            gm.graph.eliminate_dead_code()
            return PassResult(gm, True)

    def fn(x):
        return fc.wait_tensor.default(fc.all_reduce.default(x, "sum", "g")) + 1

    gm = torch.fx.symbolic_trace(fn)
    ctx = PassContext(Config(), "forward", {})
    with pytest.raises(PassError, match="lost 1 forward all_reduce on 'g'"):
        run_passes(gm, [Drop()], ctx)


def _traced_all_reduce(symbolic):
    from torch.fx.experimental.proxy_tensor import make_fx

    fc = torch.ops._c10d_functional

    def fn(x, y):
        return fc.wait_tensor.default(fc.all_reduce.default(x, "sum", "g")) + y.sum()

    mode = "symbolic" if symbolic else "fake"
    return make_fx(fn, tracing_mode=mode)(torch.randn(4, 8), torch.randn(8, 8))


def test_runner_refuses_a_pass_that_resizes_or_swaps_a_collective():
    """The census weighs as well as counts: an all-reduce moved onto another tensor (of
    another size) is refused, though no collective was lost or added."""
    from kareus.compiler.config import Config
    from kareus.passes.base import PassContext, run_passes

    class Swap(GraphPass):
        name = "swap"
        graphs = frozenset({"forward"})

        def run(self, gm, ctx):
            _x, y = [n for n in gm.graph.nodes if n.op == "placeholder"]
            reduce = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
            reduce.args = (y, *reduce.args[1:])
            reduce.meta["val"] = y.meta["val"]
            return PassResult(gm, True)

    ctx = PassContext(Config(), "forward", {})
    with pytest.raises(
        PassError, match=r"all_reduce on 'g' \(torch.float32\): 32 elements before, 64"
    ):
        run_passes(_traced_all_reduce(False), [Swap()], ctx)


def test_a_split_collective_weighs_what_the_whole_did():
    """A collective split in two along a symbolic batch (s//2 and s - s//2 rows) moves what
    the whole did, so a split that announces the doubled count passes the runner's checks."""
    from kareus.compiler.config import Config
    from kareus.passes.base import PassContext, run_passes

    fc = torch.ops._c10d_functional

    class SplitReduce(GraphPass):
        name = "split_reduce"
        graphs = frozenset({"forward"})

        def run(self, gm, ctx):
            expected = census(gm) + census(gm)
            reduce = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
            wait = next(iter(reduce.users))
            x = reduce.args[0]
            rows = x.meta["val"].shape[0]
            half = rows // 2
            g = gm.graph
            with g.inserting_before(wait.next):
                parts = []
                for start, length in ((0, half), (half, rows - half)):
                    piece = g.call_function(torch.ops.aten.narrow.default, (x, 0, start, length))
                    piece.meta["val"] = x.meta["val"].narrow(0, start, length)
                    r = g.call_function(fc.all_reduce.default, (piece, "sum", "g"))
                    r.meta["val"] = piece.meta["val"]
                    w = g.call_function(fc.wait_tensor.default, (r,))
                    w.meta["val"] = piece.meta["val"]
                    parts.append(w)
                joined = g.call_function(torch.ops.aten.cat.default, (parts, 0))
                joined.meta["val"] = x.meta["val"]
            wait.replace_all_uses_with(joined)
            g.erase_node(wait)
            g.erase_node(reduce)
            return PassResult(gm, True, collectives=expected)

    gm = _traced_all_reduce(True)
    ctx = PassContext(Config(), "forward", {})
    out, _records = run_passes(gm, [SplitReduce()], ctx)
    assert census(out) == collections.Counter({("forward", "all_reduce", "g"): 2})


def test_one_classifier_names_a_collective_kareus_cannot_price():
    """Every pass asks kareus.passes.census what a node is; a functional collective with no
    cost kind is an error naming it, not an all-reduce's price (as it was)."""
    import torch.fx as fx

    from kareus.passes.census import (
        collective_kind,
        cost_kind,
        is_functional_collective,
        is_wait,
    )

    graph = fx.Graph()
    x = graph.placeholder("x")
    gather = graph.call_function(
        torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0")
    )
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (gather,))
    cast = graph.call_function(torch.ops._c10d_functional.broadcast.default, (x, 0, "0"))
    assert (collective_kind(gather), cost_kind(gather)) == ("all_gather_into_tensor", "all_gather")
    assert collective_kind(wait) is None and is_wait(wait) and is_functional_collective(wait)
    assert not is_functional_collective(x)
    with pytest.raises(ValueError, match="issues broadcast, a collective kareus has no cost"):
        cost_kind(cast)

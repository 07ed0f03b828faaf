import dataclasses

import pytest
import torch
import torch.fx as fx
from torch import nn

import kareus
import kareus.passes.names
import kareus.passes.pipeline
from kareus import Config, PassError
from kareus.errors import NodeError
from kareus.passes.base import GraphPass, PassContext, PassResult, run_passes


class ReluToGelu(GraphPass):
    """Rewrites relu into gelu in the AOT forward graph (changes values on purpose)."""

    name = "relu_to_gelu"
    graphs = frozenset({"forward", "inference"})

    def run(self, gm, ctx):
        changed = False
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.gelu.default
                changed = True
        return PassResult(gm, changed)


class Liar(GraphPass):
    name = "liar"
    graphs = frozenset({"forward"})

    def run(self, gm, ctx):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.gelu.default
        return PassResult(gm, False)


class Broken(GraphPass):
    name = "broken"
    graphs = frozenset({"forward"})

    def run(self, gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        raise NodeError(node, "cannot handle this op")


class NeedsMeta(GraphPass):
    name = "needs_meta"
    graphs = frozenset({"forward"})

    def requires(self, gm, ctx):
        raise ValueError("graph lacks 'val' metadata")

    def run(self, gm, ctx):  # pragma: no cover - never reached
        return PassResult(gm, False)


@pytest.fixture
def pipeline(monkeypatch):
    def use(*passes):
        monkeypatch.setattr(kareus.passes.pipeline, "PIPELINE", tuple(passes))
        monkeypatch.setattr(kareus.passes.names, "PASS_NAMES", tuple(p.name for p in passes))

    return use


def raised_pass_error(call):
    """Run ``call``; return the PassError it raised (Dynamo wraps backend errors)."""
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    while err is not None and not isinstance(err, PassError):
        err = getattr(err, "inner_exception", None) or err.__cause__
    assert isinstance(err, PassError), f"no PassError in {info.value!r}"
    assert str(err) in str(info.value)  # the user sees kareus's message
    return err


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def test_a_pass_rewrites_and_is_recorded(pipeline):
    pipeline(ReluToGelu())
    model = small()
    compiled = kareus.compile(model)
    x = torch.randn(3, 4)
    expected = model[2](torch.nn.functional.gelu(model[0](x)))
    torch.testing.assert_close(compiled(x), expected)
    report = kareus.explain(compiled)
    (rec,) = [r for r in report.regions[0].history if r.graph == "forward"]
    assert rec.name == "relu_to_gelu" and rec.status == "ran" and rec.modified
    assert rec.nodes_before == rec.nodes_after
    torch.testing.FileCheck().check("aten.gelu").check_not("aten.relu").run(report.graph("forward"))
    assert "aten.relu" in report.graph("forward", captured=True)
    assert "relu_to_gelu" in str(report)


def test_disabled_pass_is_recorded_and_not_run(pipeline):
    pipeline(ReluToGelu())
    model = small()
    compiled = kareus.compile(model, disable_passes=("relu_to_gelu",))
    x = torch.randn(3, 4)
    assert torch.equal(compiled(x), model(x))
    (rec,) = kareus.explain(compiled).regions[0].history
    assert rec.status == "disabled"


def test_dishonest_modified_flag_is_caught(pipeline):
    pipeline(Liar())
    err = raised_pass_error(lambda: kareus.compile(small(), strict=True)(torch.randn(3, 4)))
    assert "reported no change but changed the graph" in str(err)


def test_error_names_pass_graph_node_and_passes_run(pipeline):
    pipeline(ReluToGelu(), Broken())
    err = raised_pass_error(lambda: kareus.compile(small(), strict=True)(torch.randn(3, 4)))
    assert err.pass_name == "broken" and err.graph == "forward"
    assert err.node is not None and err.passes_run == ("relu_to_gelu",)
    assert "at node" in str(err) and "relu_to_gelu" in str(err)


def test_precondition_failure_names_the_pass(pipeline):
    pipeline(NeedsMeta())
    err = raised_pass_error(lambda: kareus.compile(small(), strict=True)(torch.randn(3, 4)))
    assert "'needs_meta' failed on the forward graph" in str(err) and "val" in str(err)


def test_failure_without_strict_runs_unchanged_and_says_why(pipeline):
    pipeline(ReluToGelu(), Broken())
    model = small()
    compiled = kareus.compile(model)
    x = torch.randn(3, 4, requires_grad=False)
    with pytest.warns(RuntimeWarning, match="runs as captured"):
        out = compiled(x)
    assert torch.equal(out, model(x))  # relu kept: the partial rewrite was dropped
    region = kareus.explain(compiled).regions[0]
    assert any("broken" in n for n in region.notes)
    assert [r.status for r in region.history] == ["ran", "failed"]


def test_run_passes_directly_on_a_traced_graph():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    ctx = PassContext(Config(), "forward", {})
    out, records = run_passes(gm, [ReluToGelu()], ctx)
    # symbolic_trace records torch.relu, not aten.relu: nothing to rewrite, honestly reported.
    assert records[0].modified is False and out is gm
    assert ctx.passes_run == ["relu_to_gelu"]


def test_memory_ops_outside_partitions_fuse_only_where_adjacent_in_the_graph():
    """Work outside partitions is a list in graph order but not contiguous: two memory ops
    of one block's list with another block's matmul (or a collective's wait) between them in
    the graph are two kernels, not one fused kernel across the matmul."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kareus.passes.annotate_costs import META_KEY, annotate_node
    from kareus.passes.cut_partitions import gaps, partition_costs, step_index

    def fn(x, w):
        a = x * 2.0  # this block
        b = a + 1.0  # this block, adjacent: one kernel with a
        m = b @ w  # another block's matmul
        c = x - 3.0  # this block again, after the matmul
        return m, c

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    gm = make_fx(fn, tracing_mode="fake")(x, w)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for n in calls:
        n.meta[META_KEY] = annotate_node(n)
    mine = [n for n in calls if n.meta[META_KEY].op_class == "memory"]
    assert len(mine) == 3
    index = step_index(gm.graph)
    assert gaps(index, mine) == {mine[2].name}
    fused = partition_costs(mine, fuse=True, breaks=gaps(index, mine))
    assert [o.op_class for o in fused] == ["memory", "memory"]
    assert fused[0].name.startswith("fused[") and fused[1].name == mine[2].name
    assert len(partition_costs(mine, fuse=True)) == 1  # what a list without breaks would say


def test_the_pass_names_config_accepts_are_the_pipeline_s_in_order():
    """``Config.disable_passes`` is checked against ``PASS_NAMES`` (which imports nothing);
    the passes run from ``PIPELINE``: the two lists are the same, so a name is accepted
    exactly when it disables a pass."""
    from kareus.passes.names import PASS_NAMES
    from kareus.passes.pipeline import PIPELINE

    assert tuple(p.name for p in PIPELINE) == PASS_NAMES
    with pytest.raises(kareus.ConfigError, match="disable_passes"):
        kareus.Config(disable_passes=("no_such_pass",))


def test_the_pipeline_keeps_the_order_its_passes_declare():
    from kareus.passes.base import check_order
    from kareus.passes.pipeline import PIPELINE

    check_order(PIPELINE)  # the real one (also checked at import)
    names = [p.name for p in PIPELINE]
    for p in PIPELINE:
        assert all(names.index(r) < names.index(p.name) for r in p.reads | p.after), p.name
    swapped = list(PIPELINE)
    i, j = names.index("cut_partitions"), names.index("check_plan")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="'check_plan' must run after cut_partitions"):
        check_order(swapped)
    with pytest.raises(ValueError, match="twice"):
        check_order([*PIPELINE, PIPELINE[0]])


class CountCollectives(GraphPass):
    """A toy analysis pass, added in one place (the pipeline): it declares that it reads
    the partitions, and returns its finding (the runner stores it by the pass's name)."""

    name = "count_collectives"
    graphs = frozenset({"forward", "backward"})
    reads = frozenset({"cut_partitions"})

    def run(self, gm, ctx):
        pset = ctx.findings.partitions
        return PassResult(gm, modified=False, found=len(pset.partitions) if pset else 0)


def test_a_toy_pass_is_added_in_one_place_and_its_finding_is_reported(pipeline):
    from kareus.passes.pipeline import PIPELINE

    pipeline(*PIPELINE, CountCollectives())
    model = kareus.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    model(torch.randn(2, 4)).sum().backward()
    region = kareus.explain(model).regions[0]
    assert region.findings.extra == {"count_collectives": 0}
    assert "-- count_collectives --" in kareus.explain(model).summary()
    assert [r.name for r in region.history if r.graph == "forward"][-1] == "count_collectives"


def test_the_compiler_s_inputs_are_typed_and_apart_from_the_findings():
    model = kareus.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    model(torch.randn(2, 4)).sum().backward()
    region = kareus.explain(model).regions[0]
    assert region.inputs.plan is None and region.inputs.clock_runtime is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        region.inputs.plan = "x"
    # the passes' typed findings: the blocks and partitions they found, nothing supplied
    found = dict(region.findings.items())
    assert set(found) == {"blocks", "partitions"} and not region.findings.extra, found

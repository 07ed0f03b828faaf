import pytest
import torch
import torch.distributed as dist

import kareus
import kareus.passes.pipeline
from kareus import Decision
from kareus._torch_internals import outlining_problem
from kareus.models import Llama, LlamaConfig
from kareus.passes.base import GraphPass, PassResult
from kareus.testing import (
    assert_same_history,
    blocks_run,
    compare_training,
    flying_when_run,
    run_ranks,
    token_batches,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

CFG = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


class Grab(GraphPass):
    name = "grab"
    graphs = frozenset({"forward", "backward"})

    def __init__(self):
        self.gms = {}

    def run(self, gm, ctx):
        self.gms[ctx.graph] = gm
        return PassResult(gm, False)


def _train_tp(rank, decisions):
    """Train the TP model eager and compiled; return histories, partitions and graph orders."""
    grab = Grab()
    kareus.passes.pipeline.PIPELINE = (
        *(p for p in kareus.passes.pipeline.PIPELINE if p.name != "grab"),
        grab,
    )
    holder = {}

    def make():
        torch.manual_seed(0)
        return Llama(CFG, tp_group=dist.group.WORLD)

    def comp(m):
        holder["c"] = kareus.compile(m, strict=True, decisions=decisions)
        return holder["c"]

    batches = token_batches(2, 6, 16, 128)
    ref, got = compare_training(make, comp, batches, resync=True)
    region = kareus.explain(holder["c"]).regions[0]
    pset = region.findings.partitions
    orders = {k: [n.name for n in gm.graph.nodes] for k, gm in grab.gms.items()}
    code = {k: gm.code for k, gm in grab.gms.items()}
    # one step more, read as it runs: which all-reduces flew over other ops
    ran: dict = {}
    ran["forward"] = flying_when_run(lambda: ran.setdefault("loss", holder["c"](*batches[0])))
    ran["backward"] = flying_when_run(lambda: ran.pop("loss").backward())
    summary = kareus.explain(holder["c"]).summary()
    return ref, got, pset.to_json(), orders, code, summary, ran


def _check_order(pset, orders, decisions):
    """Every partition's issue sits at its decided slot and its wait right after it.

    Return the kinds of decision checked: "default", "none" (no overlap), "slot", "clamped".
    """
    checked = set()
    for part in pset.partitions:
        if part.collective is None:
            continue
        order = orders[part.instruction]
        pos = {n: i for i, n in enumerate(order)}
        issue, wait = part.collective
        named = part.type_key in decisions
        dec = decisions.get(part.type_key, decisions.get("*", Decision()))
        compute = [pos[n] for n in part.compute]
        if dec.launch_slot is None:
            assert pos[wait] < min(compute), f"{issue}: no-overlap wait should precede compute"
            checked.add("none")
        else:
            slot = min(dec.launch_slot, len(part.slots) - 1)
            first = pos[part.slots[slot].first]
            before = [i for i in compute if i < first]
            after = [i for i in compute if i >= first]
            assert all(i < pos[issue] for i in before), f"{issue} issued before slot {slot}"
            assert all(pos[issue] < i for i in after), f"{issue} issued after slot {slot}"
            assert pos[wait] > max(compute), f"{wait} should wait at the end of the partition"
            clamped = dec.launch_slot >= len(part.slots)
            checked.add("default" if not named else "clamped" if clamped else "slot")
    return checked


# One compiled run (two ranks, eager and compiled) serves every test of this module. Types
# not named keep the default decision (issue at the partition's start); of the others one
# runs without overlap, one with its own SM share (a communicator from the pool), one at a
# slot past its last (clamped to the last) and one at slot 2.
DECISIONS = {
    "forward.1": Decision(launch_slot=None),
    "forward.2": Decision(launch_slot=1, sm_share=4),
    "backward.1": Decision(launch_slot=2),
    "backward.2": Decision(launch_slot=99),
}


@pytest.fixture(scope="module")
def tp_run():
    return run_ranks(_train_tp, DECISIONS)


def test_partition_types_and_counts(tp_run):
    from kareus.ir.partitions import PartitionSet

    _ref, _got, pset_json, _orders, _code, summary, _ran = tp_run[0]
    pset = PartitionSet.from_json(pset_json)
    for instr in ("forward", "backward"):
        parts = [p for p in pset.partitions if p.instruction == instr]
        assert len(parts) == 4 * CFG.num_layers  # attention and MLP, two nanobatches each
        with_attn = [p for p in parts if "attention" in pset.types[p.type_key].describe()]
        assert len(with_attn) == 2 * CFG.num_layers, instr
        assert {p.nanobatch for p in parts} == {0, 1}
        # Identical layers share types: far fewer types than partitions.
        assert len(pset.counts(instr)) <= 5
        for p in parts:
            assert p.slots and all(s.first in p.compute for s in p.slots)
    assert "partition types" in summary and "forward.0" in summary


def test_decisions_place_issue_and_wait_and_keep_results(tp_run):
    from kareus.ir.partitions import PartitionSet

    for ref, got, pset_json, orders, code, summary, ran in tp_run:
        pset = PartitionSet.from_json(pset_json)
        checked = _check_order(pset, orders, DECISIONS)
        # and as each rank ran it: every overlapped all-reduce had ops run while it flew
        for kind in ("forward", "backward"):
            overlapped = [
                p for p in pset.partitions
                if p.instruction == kind and p.collective
                and DECISIONS.get(p.type_key, Decision()).launch_slot is not None
            ]  # fmt: skip
            assert len(ran[kind]) >= len(overlapped) > 0, (kind, ran[kind], len(overlapped))
        assert checked == {"default", "none", "slot", "clamped"}
        assert_same_history(ref, got)
        # The SM share picked a group of the pool (gloo: recorded as having no effect).
        assert "SM share 4" in summary and "has no SM share" in summary
        group = summary.split("SM share 4 -> group ")[1].split("'")[1]
        assert f"'{group}'" in code["forward"]
    # Readable in the code: an issue, the other nanobatch's matmul, then the wait.
    torch.testing.FileCheck().check("all_reduce").check("mm").check("wait_tensor").run(
        code["forward"]
    )


def _tp_traced_once(rank):
    """Train the TP model with blocks traced once; the partitions of both lowerings."""
    psets, notes = {}, {}
    histories = []
    for once in (False, True):
        holder = {}

        def make():
            torch.manual_seed(0)
            return Llama(CFG, tp_group=dist.group.WORLD)

        def comp(m, once=once, holder=holder):
            holder["c"] = kareus.compile(
                m, strict=True, trace_blocks_once=once, split_when="communicates"
            )
            return holder["c"]

        ref, got = compare_training(make, comp, token_batches(2, 6, 16, 128), resync=True)
        region = kareus.explain(holder["c"]).regions[0]
        psets[once], notes[once] = region.findings.partitions.to_json(), region.notes
        histories.append((ref, got))
    return histories, psets, notes


def _partition_shapes(pset_json):
    from kareus.ir.partitions import PartitionSet

    pset = PartitionSet.from_json(pset_json)
    return sorted(
        (p.instruction, p.nanobatch, pset.types[p.type_key].describe(), len(p.compute))
        for p in pset.partitions
    )


@pytest.mark.slow  # (blocks traced once, in process: tests/test_outline.py)
@pytest.mark.skipif(
    outlining_problem() is not None, reason=f"no outlined lowering here: {outlining_problem()}"
)
def test_tp_blocks_traced_once_keep_every_collective_and_result():
    for histories, psets, notes in run_ranks(_tp_traced_once):
        for ref, got in histories:
            assert_same_history(ref, got)
        # The autograd.Function collectives inside the bodies survive: the same partitions
        # (of the same types, collectives and sizes; node names differ).
        assert _partition_shapes(psets[True]) == _partition_shapes(psets[False])
        assert any("block calls traced" in n for n in notes[True]), notes[True]
        assert not any("one by one" in n for n in notes[True]), notes[True]


def test_graph_without_collectives_has_no_partitions():
    model = Llama(CFG)
    compiled = kareus.compile(model, strict=True, split_when="communicates")
    ids, lab = token_batches(1, 6, 16, 128)[0]
    compiled(ids, lab).backward()
    region = kareus.explain(compiled).regions[0]
    pset = region.findings.partitions
    assert pset.partitions == [] and "frequency planning only" in pset.notes["forward"]
    sched = [r for r in region.history if r.name == "schedule_overlap"]
    assert sched and not any(r.modified for r in sched)


class _DTLayer(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        # Attention-shaped projections (column then row parallel), then an MLP.
        x = x + self.wo(torch.tanh(self.wq(x)))
        return x + self.down(torch.relu(self.up(x)))


class _MLPAttn(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(_DTLayer(dim) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _dtensor_run(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))

    def make():
        torch.manual_seed(0)
        model = _MLPAttn()
        for layer in model.layers:
            parallelize_module(
                layer,
                mesh,
                {
                    "wq": ColwiseParallel(),
                    "wo": RowwiseParallel(),
                    "up": ColwiseParallel(),
                    "down": RowwiseParallel(),
                },
            )
        return model

    holder = {}

    def comp(m):
        # unpriced: gloo on a CPU hides nothing (test_split_pricing.py); the split is checked
        holder["c"] = kareus.compile(m, split_when="communicates")
        return holder["c"]

    batches = [
        (torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(i)),) for i in range(2)
    ]
    ref, got = compare_training(make, comp, batches, resync=True)
    report = kareus.explain(holder["c"])
    region = report.regions[0]
    pset = region.findings.partitions
    return (
        ref,
        got,
        blocks_run(region).split,
        pset.counts("forward"),
        blocks_run(region).skipped,
    )


def test_dtensor_parallel_model_compiles_and_is_correct():
    for ref, got, split, forward_counts, skipped in run_ranks(_dtensor_run):
        assert_same_history(ref, got, bitwise_loss=False)
        # DTensor's collectives are functional collectives too: partitioned the same way.
        assert split == ["layers.0", "layers.1"], skipped
        assert sum(forward_counts.values()) == 8  # 2 layers x 2 sublayers x 2 nanobatches

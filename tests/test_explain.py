import gc
import re

import pytest
import torch
from torch import nn

import kareus
from kareus.models import PRESETS, Llama
from kareus.testing import token_batches


def test_explain_rejects_models_kareus_did_not_compile():
    with pytest.raises(kareus.NotCompiledError, match="compile it with kareus.compile"):
        kareus.explain(nn.Linear(2, 2))
    with pytest.raises(TypeError):
        kareus.explain(torch.compile(nn.Linear(2, 2), backend="eager"))


def test_explain_before_first_call():
    with pytest.raises(kareus.NotYetCapturedError, match="call it once") as info:
        kareus.explain(kareus.compile(nn.Linear(2, 2)))
    assert isinstance(info.value, RuntimeError)


def test_report_shows_each_graph_as_code():
    compiled = kareus.compile(Llama(PRESETS["tiny"]), nanobatches=2)
    ids, lab = token_batches(1, 4, 16, 128)[0]
    compiled(ids, lab).backward()
    report = kareus.explain(compiled)
    text = str(report)
    assert "region 0" in text and "config: Config(" in text
    for kind in ("dynamo", "forward", "backward"):
        assert f"-- {kind} graph" in text
        assert "def forward(" in report.graph(kind)
    assert "aten.mm" in report.graph("forward")
    assert "aten.mm" in report.graph("backward")
    short = report.summary()
    assert "-- forward graph" in short and "def forward(" not in short
    with pytest.raises(KeyError, match="inference graph"):
        report.graph("inference")
    # Every section says something: no empty table, no internal bookkeeping, and the
    # block table's node counts say what each number is.
    assert "no partitions: no split block holds a collective" in short
    assert "partition types (count" not in short  # no table without rows
    assert "-- region_index --" not in short and "-- clock_stage --" not in short
    assert re.search(r"│ \d+/\d+ \+\d+ shared", short) and "shared: nodes of both" in short


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _summary_head(**options) -> list[str]:
    torch.manual_seed(0)
    compiled = kareus.compile(_Stack(), **options)
    for _ in range(2):
        compiled(torch.randn(8, 8)).backward()
    return kareus.explain(compiled).summary().splitlines()[1:4]


def test_the_summary_starts_with_the_verdict_on_split_overlap_and_clocks():
    """The three lines after the title answer "split?", "overlapped?", "clocks?", with the
    count or the first reason; here on one process (no collective), left as it is, split
    anyway, and planned for a GPU type (recorded, not applied)."""
    split, overlapped, clocks = _summary_head()
    assert split.startswith("split: no, 0 of 2 blocks: it holds no collective"), split
    assert overlapped == "overlapped: no, the graphs hold no collective to overlap"
    assert clocks.startswith("clocks: not planned: no gpu= and no plan= given"), clocks
    split, _overlapped, clocks = _summary_head(nanobatches=2, gpu="a100-40gb")
    assert split == "split: yes, 2 of 2 blocks into nanobatches"
    assert clocks.startswith("clocks: planned for A100-SXM4-40GB (modelled"), clocks
    assert clocks.endswith(
        "dry run (clocks= not given: planned clocks are recorded only): NOT applied"
    )


def test_the_summary_keeps_internal_counters_out():
    torch.manual_seed(0)
    compiled = kareus.compile(_Stack())
    compiled(torch.randn(8, 8)).backward()
    text = kareus.explain(compiled).summary()
    assert "early_forward_runs" not in text and "region_index" not in text


def test_clocks_auto_without_a_known_gpu_says_why_nothing_was_planned():
    """clocks='auto' on a machine without a GPU kareus knows (this CPU one) plans nothing;
    the verdict says why instead of staying silent."""
    _split, _overlapped, clocks = _summary_head(clocks="auto")
    assert clocks.startswith("clocks: not planned (no clock plan: "), clocks
    assert "pass gpu=" in clocks
    if not torch.cuda.is_available():  # (on a GPU machine: the model is on the CPU, said so)
        assert "clocks='auto' asked for one, but this process has no GPU" in clocks


def test_models_sharing_the_kareus_backend_are_explained_apart():
    # torch.compile(..., backend="kareus") shares one backend: each model's report holds
    # only the graphs that take its parameters.
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ca, cb = torch.compile(a, backend="kareus"), torch.compile(b, backend="kareus")
    ca(torch.randn(2, 4)).sum().backward()
    cb(torch.randn(2, 4)).sum().backward()
    ra, rb = kareus.explain(ca).regions, kareus.explain(cb).regions
    assert len(ra) == len(rb) == 1 and ra[0] is not rb[0]
    own = {id(p) for p in b.parameters()}
    assert rb[0].parameters <= own and rb[0].parameters
    # The shared backend outlives its models: once a model is freed its region claims no
    # parameter, so a new model whose parameters reuse the freed ids is not given its graphs
    del ca, a
    gc.collect()
    assert not ra[0].parameters
    assert kareus.explain(cb).regions == rb


def test_a_compile_time_plan_of_whole_blocks_is_labelled_the_original_graphs():
    # One process, no collective: every block stays whole, so the graphs planned are the
    # original ones; the frontier says so instead of "split".
    model = kareus.compile(Llama(PRESETS["tiny-4l"]), gpu="a100-40gb")
    ((ids, labels),) = token_batches(1, 8, 16, PRESETS["tiny-4l"].vocab_size)
    model(ids, labels).backward()
    region = kareus.explain(model).regions[0]
    assert region.findings.blocks.blocks and not region.findings.blocks.split
    plan = region.inputs.plan
    assert plan is not None and {p.nanobatches for p in plan.frontier} == {1}
    rows = [line for line in plan.to_text().splitlines() if line.startswith("│")]
    assert rows and not any("│ split" in row for row in rows)
    assert any("│ original" in row for row in rows)

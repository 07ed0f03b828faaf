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

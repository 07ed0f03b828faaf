"""The partitions file (``partitions.json``): each pipeline stage's partition sets, as traced.

``kareus plan`` writes it beside the plan; ``kareus plan --partitions``, ``kareus evaluate`` and
the trace cache read it back, refusing a file traced for another workload.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from kareus._files import write_text
from kareus.errors import KareusError
from kareus.ir.partitions import PartitionSet
from kareus.jobs.trace import Workload, workload_record

TRACED_FIELDS = (
    "model",
    "config",
    "tp",
    "cp",
    "pp",
    "microbatch_size",
    "seq_len",
    "dtype",
    "layers_per_stage",
    "virtual_stages",
    "graph_dp",
    "graphs",
)
"""Workload fields the partition sets depend on (the micro-batch count does not; the
data-parallel layout only where its collectives are in the graphs, SimpleFSDP)."""


def save_stages(
    work: Workload,
    stages: Sequence[PartitionSet],
    path: str | pathlib.Path,
    originals: Sequence[PartitionSet] | None = None,
) -> None:
    """Write the stages' partition sets (each distinct set once) with their workload.

    ``originals``, the original graphs' sets, are written beside them when given.
    """
    data: dict[str, Any] = {"workload": workload_record(work), **_indexed(stages)}
    if originals is not None:
        data["original"] = _indexed(originals)
    write_text(path, json.dumps(data, indent=1) + "\n")


def _indexed(stages: Sequence[PartitionSet]) -> dict[str, Any]:
    """Each distinct set once, and per stage the index of its set."""
    sets = [pset for _, pset in distinct(stages)]
    return {
        "stages": [next(i for i, d in enumerate(sets) if d is p) for p in stages],
        "sets": [d.to_dict() for d in sets],
    }


@dataclasses.dataclass(frozen=True)
class _StageSets:
    """Per stage the index of its set, and the distinct sets."""

    stages: list[int]
    sets: list[PartitionSet]


@dataclasses.dataclass(frozen=True)
class _PartitionsFile:
    """What ``partitions.json`` holds (its schema)."""

    workload: dict[str, Any]
    stages: list[int]
    sets: list[PartitionSet]
    original: _StageSets | None = None  # the original graphs' (files before them lack it)


class PartitionsFileError(KareusError, ValueError):
    """A partitions.json that cannot be read, or was traced for another workload."""


def load_stages(work: Workload, path: str | pathlib.Path) -> list[PartitionSet]:
    """Read partition sets written by :func:`save_stages` for the same traced workload.

    Raises:
        PartitionsFileError: the file cannot be read or was traced for another workload.
    """
    return load_partitions(work, path)[0]


def load_originals(work: Workload, path: str | pathlib.Path) -> list[PartitionSet] | None:
    """Read the original graphs' sets of a :func:`save_stages` file (None if it has none).

    Raises:
        PartitionsFileError: as :func:`load_stages`.
    """
    return load_partitions(work, path)[1]


def load_partitions(
    work: Workload, path: str | pathlib.Path
) -> tuple[list[PartitionSet], list[PartitionSet] | None]:
    """Read a :func:`save_stages` file once: the split graphs' sets, and the original's.

    The original graphs' sets are None where the file has none.

    Raises:
        PartitionsFileError: as :func:`load_stages`.
    """
    from kareus.ir.schema import FileFormatError, parse, read_text

    try:
        data: _PartitionsFile = parse(
            _PartitionsFile, read_text(path, "partitions file"), str(path), "partitions file"
        )
    except FileFormatError as err:
        raise PartitionsFileError(str(err)) from None
    saved = data.workload
    groups = [("stages", _StageSets(data.stages, data.sets))]
    groups += [("original.stages", data.original)] if data.original is not None else []
    for name, group in groups:
        bad = [i for i in group.stages if not 0 <= i < len(group.sets)]
        if bad:
            raise PartitionsFileError(
                f"{path} is not a valid partitions file: {name} refers to set {bad[0]}, but "
                f"it holds {len(group.sets)} set(s)"
            )
    want = workload_record(work)
    # A field a file predates holds its default (virtual_stages came after the first files).
    defaults = {f.name: f.default for f in dataclasses.fields(Workload)}
    diff = [
        f"{k} {saved.get(k, defaults.get(k))!r} != {want.get(k)!r}"
        for k in TRACED_FIELDS
        if saved.get(k, defaults.get(k)) != want.get(k)
    ]
    if diff:
        raise PartitionsFileError(f"{path} was traced for another workload: {', '.join(diff)}")
    split, *original = [[g.sets[i] for i in g.stages] for _name, g in groups]
    return split, (original[0] if original else None)


def distinct(stages: Sequence[PartitionSet]) -> list[tuple[int, PartitionSet]]:
    """(first stage index, set) of each distinct set (identical stages share one object)."""
    seen: list[tuple[int, PartitionSet]] = []
    for i, pset in enumerate(stages):
        if all(pset is not other for _, other in seen):
            seen.append((i, pset))
    return seen

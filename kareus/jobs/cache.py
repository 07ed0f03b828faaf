"""The trace cache: traced partition sets kept between runs, keyed by what tracing reads.

The key holds the workload's traced fields, the layers traced, the nanobatch count, the torch
version and a digest of kareus's own source, so a changed pass is never served a stale trace.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Sequence

from kareus._files import write_text
from kareus.errors import KareusError
from kareus.ir.partitions import PartitionSet
from kareus.jobs.stages_file import TRACED_FIELDS, load_stages, save_stages
from kareus.jobs.trace import Workload, trace, workload_record

_log = logging.getLogger(__name__)


def traced_stages(
    work: Workload,
    *,
    layers: int = 4,
    cache: bool = True,
    progress: Callable[[str], None] | None = None,
    nanobatches: int = 2,
) -> tuple[list[PartitionSet], list[str], pathlib.Path | None]:
    """Return each pipeline stage's partition set, the passes' notes and the cache entry read.

    From the trace cache, else by tracing (and writing the cache); an earlier run's
    ``partitions.json`` is read by :func:`load_partitions` instead. The sets are as traced:
    activation recompute is not applied (:func:`with_recompute`). ``nanobatches``: 2 for
    the nanobatched graphs kareus plans, 1 for the original ones.
    """
    entry = trace_cache_dir() / cache_key(work, layers, nanobatches) if cache else None
    if entry is not None and (found := _read_cache(work, entry)) is not None:
        _log.info("partitions from the trace cache: %s", entry)
        return found[0], found[1], entry
    stages, notes = trace(work, layers=layers, progress=progress, nanobatches=nanobatches)
    if entry is not None:
        _write_cache(work, stages, notes, entry)
    return stages, notes, None


def trace_cache_dir() -> pathlib.Path:
    """Return where traced partition sets are kept.

    ``$KAREUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kareus``, else ``~/.cache/kareus``.
    """
    if os.environ.get("KAREUS_CACHE_DIR"):
        return pathlib.Path(os.environ["KAREUS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kareus"


@functools.cache
def _code_digest() -> str:
    """Return a digest of kareus's source and the torch version.

    Tracing's result depends on them besides the workload: a changed pass must not be
    served a stale trace.
    """
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    root = pathlib.Path(__file__).resolve().parents[1]  # the kareus package, all of it
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def cache_key(work: Workload, layers: int, nanobatches: int = 2) -> str:
    """Return the cache entry's name for ``work`` traced with ``layers`` and ``nanobatches``."""
    record = workload_record(work)
    fields = {k: record.get(k) for k in TRACED_FIELDS} | {"layers": layers, "code": _code_digest()}
    if nanobatches != 2:  # the nanobatched trace keeps the keys it always had
        fields["nanobatches"] = nanobatches
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _read_cache(work: Workload, entry: pathlib.Path) -> tuple[list[PartitionSet], list[str]] | None:
    """Return the cached stages and tracing notes, or None (absent or unreadable: re-trace)."""
    if not (entry / "partitions.json").is_file():
        return None
    try:
        stages = load_stages(work, entry / "partitions.json")
        notes = json.loads((entry / "notes.json").read_text())
    except (OSError, ValueError, KareusError) as err:
        _log.warning("trace cache entry %s unreadable (%s): tracing again", entry, err)
        return None
    return stages, [str(n) for n in notes]


def _write_cache(
    work: Workload, stages: Sequence[PartitionSet], notes: Sequence[str], entry: pathlib.Path
) -> None:
    """Keep the traced stages for the next run; a cache that cannot be written is skipped."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        write_text(entry / "notes.json", json.dumps(list(notes)) + "\n")
        save_stages(work, stages, entry / "partitions.json")  # last: it marks the entry whole
    except OSError as err:
        _log.warning("cannot write the trace cache at %s (%s); continuing without", entry, err)

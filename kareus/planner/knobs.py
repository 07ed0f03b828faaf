"""The knob space of a partition type, and evaluation with counting and recording."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from kareus.errors import KareusError
from kareus.ir.costs import Estimate, Evaluator, Knobs, OpCost, PartitionWork


@dataclasses.dataclass(frozen=True, order=True)
class Setting:
    """One knob setting of a partition type: clock, and (slot, SM share) or no overlap."""

    freq_mhz: float
    launch_slot: int | None = None  # None: no overlap
    sm_share: int | None = None

    @property
    def pair(self) -> tuple[int | None, int | None]:
        """The frequency-independent part: (launch slot, SM share)."""
        return self.launch_slot, self.sm_share


@dataclasses.dataclass(frozen=True)
class KnobSpace:
    """Clocks, SM shares and launch slots to search for one partition type.

    Attributes:
        freqs_mhz: candidate clocks, highest first.
        sm_shares: candidate SM shares of the collective.
        slots: number of launch slots of the type (0 when it overlaps no collective).
        no_overlap_sm_share: SMs of the collective when it runs alone (no overlap).
    """

    freqs_mhz: tuple[float, ...]
    sm_shares: tuple[int, ...]
    slots: int
    no_overlap_sm_share: int = 32

    def settings(self) -> list[Setting]:
        """Every setting of the grid, the no-overlap ones included."""
        out = [Setting(f) for f in self.freqs_mhz]
        out += [
            Setting(f, slot, share)
            for f in self.freqs_mhz
            for slot in range(self.slots)
            for share in self.sm_shares
        ]
        return out


DEFAULT_CLOCK_COUNT = 19
"""Clocks planned by default: 19 over the top half of the range (A100: every 30-45 MHz).

The clock grid's step sets how far whole plans stay from the relaxation's bound: an
instruction on a tight path that could afford a few per cent more time can only take the
next clock down, and the relaxation proves what a mix of the two would save. With 10 clocks
(75-90 MHz apart on an A100) the Llama 3.3 70B PP 8 x 16 plans stayed 0.56-0.73 % above
their bounds at nine solves; with 19 (the 10 and one between each two) every solve is
proven within 0.5 % and planning is faster (``python benchmarks/planner.py --scale 8x16``:
2.1 s against 6.0 s, 2026-12-03), for 31 % more evaluations in the search and 46 % more in
all on the README's main job. An iteration too large for the dive that 19 clocks leave loose
is planned again on all of them
(:meth:`~kareus.planner.settings.PlannerSettings.finer_clocks`).
"""


def default_clocks(
    clocks_mhz: Sequence[int], count: int = DEFAULT_CLOCK_COUNT, floor: float = 0.5
) -> tuple[int, ...]:
    """Return ``count`` well-spread clocks over the top of a GPU's range (down to ``floor``)."""
    top = [c for c in sorted(clocks_mhz, reverse=True) if c >= floor * max(clocks_mhz)]
    if len(top) <= count:
        return tuple(top)
    step = (len(top) - 1) / (count - 1)
    return tuple(top[round(i * step)] for i in range(count))


def knobs_of(setting: Setting, space: KnobSpace) -> Knobs:
    """Translate a setting into the evaluator's knobs."""
    if setting.launch_slot is None:
        return Knobs(setting.freq_mhz, space.no_overlap_sm_share, launch_slot=None)
    return Knobs(setting.freq_mhz, setting.sm_share or 1, launch_slot=setting.launch_slot)


class CountingEvaluator:
    """Wrap an evaluator: cache results and count distinct evaluations."""

    def __init__(self, inner: Evaluator) -> None:
        self.inner = inner
        self.evaluations = 0
        self._cache: dict[tuple[PartitionWork, Knobs], Estimate] = {}

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Evaluate once per (work, knobs); later calls hit the cache."""
        key = (work, knobs)
        if key not in self._cache:
            self._cache[key] = self.inner.partition(work, knobs)
            self.evaluations += 1
        return self._cache[key]

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Evaluate non-partition work (not counted: it has no knobs but the clock)."""
        return self.inner.ops(ops, freq_mhz)


def _digest(work: PartitionWork) -> str:
    return hashlib.sha1(json.dumps(dataclasses.asdict(work), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def _knobs_key(knobs: Knobs) -> str:
    data = dataclasses.asdict(knobs)
    data["freq_mhz"] = float(data["freq_mhz"])  # 1410 and 1410.0 are one clock
    return json.dumps(data, sort_keys=True)


class RecordingEvaluator:
    """Wrap an evaluator and append every result to a JSON-lines file for later replay.

    Each row holds the work's digest, the knobs and the estimate, plus what ``describe``
    returns for it (for example the GPU and the clock observed while measuring).
    """

    def __init__(
        self,
        inner: Evaluator,
        path: str | pathlib.Path,
        describe: Callable[[PartitionWork, Knobs, Estimate], dict[str, Any]] | None = None,
    ) -> None:
        self.inner = inner
        self.path = pathlib.Path(path)
        self.describe = describe

    @property
    def source(self) -> str:
        """The wrapped evaluator's source."""
        return str(getattr(self.inner, "source", "modelled"))

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Evaluate and record."""
        est = self.inner.partition(work, knobs)
        with self.path.open("a") as fh:
            row = {
                "work": _digest(work),
                "knobs": dataclasses.asdict(knobs),
                **dataclasses.asdict(est),
                **(self.describe(work, knobs, est) if self.describe else {}),
            }
            fh.write(json.dumps(row) + "\n")
        return est

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Evaluate and record non-partition work (as a partition without collective)."""
        return self.partition(PartitionWork(ops, None), Knobs(freq_mhz, 0, launch_slot=None))


_ESTIMATE_FIELDS = tuple(f.name for f in dataclasses.fields(Estimate))


class ReplayEvaluator:
    """Answer from recorded results (JSON lines); a missing entry is an error.

    Rows may carry more fields than the estimate (``kareus profile`` records the GPU, the
    clock observed and what was measured); they are kept in :attr:`rows` and not used.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._rows: dict[tuple[str, str], Estimate] = {}
        self.rows: list[dict[str, Any]] = []
        with self.path.open() as fh:
            for number, line in enumerate(fh, 1):
                try:
                    row = json.loads(line)
                    knobs = Knobs(**row["knobs"])
                    est = Estimate(**{k: row[k] for k in _ESTIMATE_FIELDS if k in row})
                    self._rows[(str(row["work"]), _knobs_key(knobs))] = est
                except (ValueError, KeyError, TypeError) as err:
                    raise KareusError(
                        f"{self.path}:{number} is not a recorded evaluation ({err!r}); record "
                        "with `kareus plan --record` or `kareus profile`"
                    ) from None
                self.rows.append(row)

    @property
    def source(self) -> str:
        """``measured`` when every row was, ``modelled`` when none was, else ``partly measured``."""
        kinds = {est.source for est in self._rows.values()}
        return kinds.pop() if len(kinds) == 1 else "partly measured"

    def clocks(self) -> tuple[float, ...]:
        """Return the clocks the recorded partitions were evaluated at, highest first."""
        return tuple(sorted({float(r["knobs"]["freq_mhz"]) for r in self.rows}, reverse=True))

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Return the recorded estimate."""
        try:
            return self._rows[(_digest(work), _knobs_key(knobs))]
        except KeyError:
            raise KareusError(
                f"no recorded result in {self.path} for knobs {knobs}: plan with the "
                "partitions, clocks, SM shares and search the file was recorded with (for a "
                "`kareus profile` directory: --partitions DIR/partitions.json), or with "
                "--evaluator emulator"
            ) from None

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Return the recorded estimate of non-partition work."""
        return self.partition(PartitionWork(ops, None), Knobs(freq_mhz, 0, launch_slot=None))

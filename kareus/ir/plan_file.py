"""The plan: what kareus decided, as versioned data that round-trips through JSON.

A plan holds the workload's fingerprint (per stage and direction, every partition type
with its op mix, collective and count: what ``kareus.compile(model, plan=...)`` checks the
model against), the iteration frontier of (time, energy) points, the chosen point and the
policy that chose it, the clock of every instruction of every pipeline stage, the launch
slot and SM share of every partition type, the baselines' frontiers computed the same way,
and where the numbers come from (``modelled`` by the hardware model or ``measured``).
Plans are data: never code to evaluate.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from kareus._table import fig, render_table
from kareus.ir.partitions import Decision

PLAN_VERSION = 1

PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")

ClockRange = Callable[[str], "tuple[float, float] | None"]
"""A GPU's name to the (min, max) MHz its clocks may be set to, or None where unknown."""


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """Iteration time and energy of all GPUs of one plan.

    ``lower_bound_j``: the solver's proof that no plan on the same options as fast as this
    one uses less energy (None where none was proven); the gap to ``energy_j`` is what the
    limited search may have left. ``nanobatches``: 2 for a plan of the graphs split in two
    nanobatches, 1 for one of the original graphs (no split, no overlap: clocks only).
    ``switches``: clock changes in one iteration, over the pipeline's ranks (a rank's change
    from its last instruction's clock to its first's included); None where not counted.
    """

    time_s: float
    energy_j: float
    lower_bound_j: float | None = None
    nanobatches: int = 2
    switches: int | None = None

    @property
    def gap(self) -> float | None:
        """Return the proven optimality gap, a fraction of the energy (None if unproven)."""
        if self.lower_bound_j is None or self.energy_j <= 0:
            return None
        return max(0.0, (self.energy_j - self.lower_bound_j) / self.energy_j)


@dataclasses.dataclass(frozen=True)
class ScheduledInstruction:
    """One instruction of a stage's per-iteration schedule and its clock."""

    stage: int
    kind: str
    microbatch: int
    freq_mhz: float
    time_s: float = 0.0  # of the instruction itself, on one GPU
    dynamic_energy_j: float = 0.0  # of the instruction, on one GPU, static power excluded


@dataclasses.dataclass(frozen=True)
class Plan:
    """A chosen plan with its frontier and baselines. See the module docstring."""

    gpu: str
    source: str
    policy: str
    parallel: dict[str, int]
    frontier: tuple[FrontierPoint, ...]
    chosen: FrontierPoint
    schedule: tuple[ScheduledInstruction, ...]
    decisions: dict[str, dict[str, Decision]]  # "stage/kind" -> type key -> decision
    baselines: dict[str, tuple[FrontierPoint, ...]]
    evaluations: dict[str, int] = dataclasses.field(default_factory=dict)
    skip_reasons: tuple[str, ...] = ()
    static_power_w: float = 0.0
    workload: dict[str, Any] = dataclasses.field(default_factory=dict)
    fingerprint: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    pipeline_schedule: str = "1F1B"  # "1F1B", "GPipe" or "Interleaved1F1B"
    clock_switch: dict[str, Any] = dataclasses.field(default_factory=dict)  # time_s, source
    # degree, mode, per-stage traffic (planner/data_parallel.py); empty: none modelled
    data_parallel: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def nanobatches(self) -> int:
        """Return the chosen plan's nanobatches: 1 leaves the graphs unsplit (clocks only)."""
        return self.chosen.nanobatches

    def stages(self) -> list[int]:
        """Return the pipeline stages the plan schedules."""
        return sorted({s.stage for s in self.schedule})

    def clocks(self, stage: int = 0) -> list[float]:
        """Return the clock of each instruction of ``stage``, in execution order."""
        return [s.freq_mhz for s in self.schedule if s.stage == stage]

    def decisions_for(self, stage: int = 0) -> dict[str, Decision]:
        """Return the per-type decisions of one stage (forward and backward types)."""
        out: dict[str, Decision] = {}
        for group, decs in self.decisions.items():
            if int(group.split("/")[0]) == stage:
                out.update(decs)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return the plan as JSON-ready data."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Return the plan as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | pathlib.Path) -> None:
        """Write the plan as JSON (atomically: a reader never sees half a plan)."""
        from kareus._files import write_text

        write_text(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (validated as :meth:`from_json`)."""
        return cls.from_json(json.dumps(data, default=str), "plan data")

    @classmethod
    def from_json(
        cls, text: str, source: str = "plan JSON", clock_range: ClockRange | None = None
    ) -> Plan:
        """Validate a plan's JSON against the schema and build it.

        ``clock_range`` maps the plan's GPU to its (min, max) MHz, or None where unknown
        (``kareus.hardware.clock_range``): each clock is checked to lie in it. Without it,
        clocks are checked to be positive only (this module knows no GPU).

        Raises:
            FileFormatError: the JSON is malformed, of another plan version, has a field of
                the wrong type, or a value no GPU could run (named, with ``source``).
        """
        from kareus.ir.schema import FileFormatError, parse

        try:
            head = json.loads(text)
        except ValueError:
            head = None  # parse() reports where the JSON breaks
        if isinstance(head, dict) and {"workload", "stages", "sets"} <= head.keys():
            raise FileFormatError(
                f"{source} is a partitions file (what `kareus plan` traced), not a plan: "
                "pass the plan.json written beside it, or re-plan from it with "
                f"`kareus plan ... --partitions {source}`"
            )
        if isinstance(head, dict) and head.get("version") != PLAN_VERSION:
            raise FileFormatError(
                f"{source}: plan version {head.get('version')!r} is not supported (this kareus "
                f"reads version {PLAN_VERSION}); re-plan with this version of kareus"
            )
        plan: Plan = parse(cls, text, source, "kareus plan")
        problems = plan.problems(clock_range(plan.gpu) if clock_range is not None else None)
        if problems:
            raise FileFormatError(f"{source} is not a valid kareus plan: " + "; ".join(problems))
        return plan

    def problems(self, clocks: tuple[float, float] | None = None) -> list[str]:
        """Return what in this plan no run could apply (empty when it is sound).

        ``clocks``: the (min, max) MHz of the plan's GPU, where known.
        """
        out = []
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            out.append(
                f"pipeline_schedule {self.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}"
            )
        for i, s in enumerate(self.schedule):
            if s.kind not in ("forward", "backward", "step"):
                out.append(
                    f"schedule[{i}].kind: {s.kind!r} is not forward, backward or step (the "
                    "data-parallel communication and optimizer after a rank's last backward)"
                )
            if s.freq_mhz <= 0 or (clocks and not clocks[0] <= s.freq_mhz <= clocks[1]):
                allowed = f"{clocks[0]:g}-{clocks[1]:g} MHz" if clocks else "a positive clock"
                out.append(f"schedule[{i}].freq_mhz: {s.freq_mhz:g} is outside {allowed}")
            if s.stage < 0 or s.microbatch < 0:
                out.append(f"schedule[{i}]: stage and microbatch must be >= 0")
        for name, point in [*(("frontier", p) for p in self.frontier), ("chosen", self.chosen)]:
            if point.nanobatches not in (1, 2):
                out.append(f"{name}: nanobatches {point.nanobatches!r} is neither 1 nor 2")
        if self.nanobatches == 1 and any(self.decisions.values()):
            out.append("decisions: a plan of the original graphs (nanobatches 1) has none")
        for group, decs in self.decisions.items():
            stage, _, kind = group.partition("/")
            if not stage.isdigit() or kind not in ("forward", "backward", "inference"):
                out.append(f"decisions[{group!r}]: keys are 'STAGE/forward' or 'STAGE/backward'")
            for key, d in decs.items():
                if d.launch_slot is not None and d.launch_slot < 0:
                    out.append(f"decisions[{group!r}][{key!r}].launch_slot must be >= 0")
                if d.sm_share is not None and d.sm_share <= 0:
                    out.append(f"decisions[{group!r}][{key!r}].sm_share must be > 0")
        return out[:5]

    @classmethod
    def load(cls, path: str | pathlib.Path, clock_range: ClockRange | None = None) -> Plan:
        """Read and validate a plan written by :meth:`save`.

        ``clock_range``: as :meth:`from_json`.

        Raises:
            FileFormatError: the file cannot be read or is not a valid plan (see
                :meth:`from_json`).
        """
        from kareus.ir.schema import read_text

        return cls.from_json(read_text(path, "kareus plan"), str(path), clock_range)

    def stage_clocks(self) -> dict[int, str]:
        """Each stage's instructions and clocks in order (``F0@1410 B0@1200 ... step@1005``)."""
        return {
            s: " ".join(
                f"step@{c.freq_mhz:g}"
                if c.kind == "step"
                else f"{c.kind[0].upper()}{c.microbatch}@{c.freq_mhz:g}"
                for c in self.schedule
                if c.stage == s
            )
            for s in sorted({c.stage for c in self.schedule})
        }

    def _clocks_text(self) -> str:
        """Each stage's clocks in order, and the changes an iteration makes."""
        clocks = "\n".join(f"stage {s}: {text}" for s, text in self.stage_clocks().items())
        if self.chosen.switches is None:
            return clocks
        return f"{clocks}\n({self.chosen.switches} clock changes per iteration over the ranks)"

    def to_text(self) -> str:
        """Render the plan as tables; every figure says it is modelled or measured."""
        src = self.source
        par = ", ".join(f"{k} {v}" for k, v in self.parallel.items())
        head = f"kareus plan for {self.gpu} ({par}), policy {self.policy}; all figures {src}"
        if self.workload.get("describe"):
            head += f"\nworkload: {self.workload['describe']}"
        if self.nanobatches == 1:
            head += (
                "\nthe chosen plan leaves the graphs unsplit (no nanobatches, no overlap): "
                "no split plan beats per-instruction clocks alone at its time"
            )
        front = render_table(
            f"kareus frontier ({src})",
            ("#", "iteration time s", "energy J (all GPUs)", "proven gap", "graphs", "chosen"),
            [
                (
                    i,
                    fig(p.time_s),
                    fig(p.energy_j),
                    "n/a" if p.gap is None else f"{100 * p.gap:.1f} %",
                    "split" if p.nanobatches == 2 else "original",
                    "<-" if p == self.chosen else "",
                )
                for i, p in enumerate(self.frontier)
            ],
        )
        base_rows = []
        for name, pts in self.baselines.items():
            fastest = min(pts, key=lambda p: p.time_s)
            frugal = min(pts, key=lambda p: p.energy_j)
            base_rows.append(
                (
                    name,
                    len(pts),
                    fig(fastest.time_s),
                    fig(fastest.energy_j),
                    fig(frugal.energy_j),
                )
            )
        bases = render_table(
            f"baselines ({src})",
            ("method", "points", "fastest time s", "its energy J", "least energy J (all GPUs)"),
            base_rows,
        )
        dec_rows = [
            (
                g,
                k,
                "no overlap" if d.launch_slot is None else d.launch_slot,
                d.sm_share or "default",
            )
            for g, decs in self.decisions.items()
            for k, d in decs.items()
        ]
        decs = render_table(
            "overlap decisions", ("stage/kind", "type", "launch slot", "SM share"), dec_rows
        )
        parts = [head, front, bases, decs, "clock schedule (MHz):\n" + self._clocks_text()]
        if self.evaluations:
            parts.append(
                "evaluations: " + ", ".join(f"{k} {v}" for k, v in self.evaluations.items())
            )
        parts.extend(f"note: {r}" for r in self.skip_reasons)
        return "\n\n".join(parts)

"""The plan: what kareus decided, as versioned data that round-trips through JSON.

A plan holds the iteration frontier of (time, energy) points, the chosen point and the
policy that chose it, the clock of every instruction of every pipeline stage, the launch
slot and SM share of every partition type, the baselines' frontiers computed the same way,
and where the numbers come from (``modelled`` by the hardware model or ``measured``).
Plans are data: never code to evaluate.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from kareus._table import render_table
from kareus.errors import KareusError
from kareus.partitions import Decision

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """Iteration time and energy of all GPUs of one plan."""

    time_s: float
    energy_j: float


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
    version: int = PLAN_VERSION

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
        """Write the plan as JSON."""
        pathlib.Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output.

        Raises:
            KareusError: the data is of another plan version.
        """
        version = data.get("version")
        if version != PLAN_VERSION:
            raise KareusError(
                f"plan version {version!r} is not supported (this kareus reads version "
                f"{PLAN_VERSION}); re-plan with this version of kareus"
            )

        def points(items: Any) -> tuple[FrontierPoint, ...]:
            return tuple(FrontierPoint(**p) for p in items)

        return cls(
            gpu=data["gpu"],
            source=data["source"],
            policy=data["policy"],
            parallel=dict(data["parallel"]),
            frontier=points(data["frontier"]),
            chosen=FrontierPoint(**data["chosen"]),
            schedule=tuple(ScheduledInstruction(**s) for s in data["schedule"]),
            decisions={
                g: {k: Decision(**d) for k, d in decs.items()}
                for g, decs in data["decisions"].items()
            },
            baselines={k: points(v) for k, v in data["baselines"].items()},
            evaluations=dict(data.get("evaluations", {})),
            skip_reasons=tuple(data.get("skip_reasons", ())),
            static_power_w=float(data.get("static_power_w", 0.0)),
            workload=dict(data.get("workload", {})),
        )

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            return cls.from_dict(json.loads(pathlib.Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise KareusError(f"cannot read a kareus plan from {path}: {err}") from err

    def to_text(self) -> str:
        """Render the plan as tables; every figure says it is modelled or measured."""
        src = self.source
        par = ", ".join(f"{k} {v}" for k, v in self.parallel.items())
        head = f"kareus plan for {self.gpu} ({par}), policy {self.policy}; all figures {src}"
        if self.workload.get("describe"):
            head += f"\nworkload: {self.workload['describe']}"
        front = render_table(
            f"kareus frontier ({src})",
            ("#", "iteration time s", "energy J", "chosen"),
            [
                (i, f"{p.time_s:.6f}", f"{p.energy_j:.3f}", "<-" if p == self.chosen else "")
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
                    f"{fastest.time_s:.6f}",
                    f"{fastest.energy_j:.3f}",
                    f"{frugal.energy_j:.3f}",
                )
            )
        bases = render_table(
            f"baselines ({src})",
            ("method", "points", "fastest time s", "its energy J", "least energy J"),
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
        clocks = "\n".join(
            f"stage {s}: "
            + " ".join(
                f"{c.kind[0].upper()}{c.microbatch}@{c.freq_mhz:g}"
                for c in self.schedule
                if c.stage == s
            )
            for s in sorted({c.stage for c in self.schedule})
        )
        parts = [head, front, bases, decs, "clock schedule (MHz):\n" + clocks]
        if self.evaluations:
            parts.append(
                "evaluations: " + ", ".join(f"{k} {v}" for k, v in self.evaluations.items())
            )
        parts.extend(f"note: {r}" for r in self.skip_reasons)
        return "\n\n".join(parts)

"""What a clock runtime applies and reports.

The plan's instructions on one GPU (:class:`Step`), and each iteration's time and energy
(:class:`IterationEnergy`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Step:
    """One instruction of the plan: kind, clock, modelled cost, stage and micro-batch."""

    kind: str
    freq_mhz: float
    time_s: float = 0.0
    dynamic_energy_j: float = 0.0
    stage: int = 0
    microbatch: int = 0

    @property
    def key(self) -> tuple[int, str, int]:
        """The instruction's identity: (stage, kind, micro-batch)."""
        return self.stage, self.kind, self.microbatch


@dataclasses.dataclass(frozen=True)
class IterationEnergy:
    """Time and energy of one iteration on this GPU, and whether measured or modelled."""

    iteration: int
    time_s: float
    energy_j: float
    source: str

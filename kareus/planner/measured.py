"""Measure partitions on a device: the evaluator that replaces the emulator on real GPUs.

:class:`ProfilerEvaluator` runs a partition's workload back to back on a
:class:`ProfilingDevice` after warm-up, over a window long enough for the energy counter
(NVML's updates every ~100 ms, so windows of about a second), and divides time and energy by
the repetitions. It locks the clock only when permitted (``lock_clocks=True``) and restores
it after every measurement, also on errors; with ``lock_clocks=False`` it never changes a
clock and measures at the clock the device runs at (the plan then holds that clock only).

The repetitions are counted before the window starts, from the warm-up's time, and agreed
by every rank that measures together (:meth:`ProfilingDevice.agree`): the ranks of a
tensor-parallel group run the same partition with its collective, so they must run it
equally often; their results are combined the same way (:meth:`ProfilingDevice.combine`).

Devices: :class:`EmulatedProfilingDevice` advances a virtual time and a coarse energy
counter with the hardware model, so the profiler is tested without a GPU (its figures are
modelled); ``kareus.jobs.program_device.ProgramDevice`` runs the partitions extracted from
the model's own graphs (``kareus profile``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

from kareus.errors import KareusError
from kareus.ir.costs import Estimate, Knobs, OpCost, PartitionWork
from kareus.runtime.clocks import ClockController

COUNTER_UPDATES = 5
"""A measurement window covers at least this many updates of the energy counter."""

_GROW = 4
"""How much a window grows when its energy counter did not move (at most eight times)."""


class MeasurementError(KareusError, RuntimeError):
    """A measurement could not be made (an energy counter that never moved)."""


class ProfilingDevice(Protocol):
    """Something that runs workloads and reports time and a cumulative energy counter."""

    @property
    def source(self) -> str:
        """``measured`` or ``modelled``: where its time and energy come from."""
        ...

    def run(self, work: PartitionWork, knobs: Knobs) -> None:
        """Enqueue one execution of the partition's workload."""
        ...

    def synchronize(self) -> None:
        """Wait for enqueued work to finish."""
        ...

    def now_s(self) -> float:
        """Return the device's time in seconds."""
        ...

    def energy_j(self) -> float:
        """Return the cumulative energy counter in joules."""
        ...

    def agree(self, reps: int) -> int:
        """Return the repetitions every rank measuring together runs (the largest asked)."""
        ...

    def combine(self, time_s: float, energy_j: float) -> tuple[float, float]:
        """Return one result for all ranks measuring together (per GPU)."""
        ...


@dataclasses.dataclass
class ProfilerEvaluator:
    """The planner's evaluator over a profiling device (see the module docstring).

    Attributes:
        device: where workloads run.
        clocks: the device's clock controller.
        lock_clocks: set the knob's clock for each measurement (needs permission); when
            False no clock is ever changed.
        static_power_w: static power, to split off dynamic energy.
        warmup: executions before measuring.
        min_window_s: shortest measurement window; it is also at least
            :data:`COUNTER_UPDATES` periods of the device's energy counter
            (``counter_period_s``, where the device says).
        max_reps: most repetitions of one measurement.

    An energy that reads 0 J over a window (the counter did not update within it) is never
    returned: the window grows, and where it still reads 0 J the measurement raises
    :class:`MeasurementError`.
    """

    device: ProfilingDevice
    clocks: ClockController
    lock_clocks: bool = False
    static_power_w: float = 0.0
    warmup: int = 3
    min_window_s: float = 1.0
    max_reps: int = 100_000
    measurements: int = 0

    @property
    def source(self) -> str:
        """``measured`` on a real device, ``modelled`` on the emulated one."""
        return self.device.source

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Measure one partition under one knob setting.

        Raises:
            MeasurementError: the energy counter did not move over the longest window.
        """
        if self.lock_clocks:
            self.clocks.set(knobs.freq_mhz)
        try:
            start = self.device.now_s()
            for _ in range(max(self.warmup, 1)):
                self.device.run(work, knobs)
            self.device.synchronize()
            each = (self.device.now_s() - start) / max(self.warmup, 1)
            period = float(getattr(self.device, "counter_period_s", 0.0) or 0.0)
            window = max(self.min_window_s, COUNTER_UPDATES * period)
            wanted = math.ceil(window / each) if each > 0 else 1
            reps = self.device.agree(min(max(wanted, 1), self.max_reps))
            for _attempt in range(9):
                time_s, energy_j = self._window(work, knobs, reps)
                if energy_j > 0 or reps >= self.max_reps:
                    break
                reps = min(reps * _GROW, self.max_reps)  # the same on every rank (combined)
        finally:
            if self.lock_clocks:
                self.clocks.reset()
        if energy_j <= 0:
            raise MeasurementError(
                f"the energy counter did not move over {reps} runs ({reps * time_s:.3g} s) "
                "of the partition: its energy is unknown, not 0 J. Raise the window "
                "(min_window_s) or the repetition cap (max_reps)"
            )
        self.measurements += 1
        return Estimate(time_s, energy_j, energy_j - self.static_power_w * time_s, self.source)  # type: ignore[arg-type]

    def _window(self, work: PartitionWork, knobs: Knobs, reps: int) -> tuple[float, float]:
        """Run ``reps`` times back to back; return the time and energy of one run."""
        t0, e0 = self.device.now_s(), self.device.energy_j()
        for _ in range(reps):
            self.device.run(work, knobs)
        self.device.synchronize()
        return self.device.combine(
            (self.device.now_s() - t0) / reps, (self.device.energy_j() - e0) / reps
        )

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Measure compute alone at one clock."""
        return self.partition(PartitionWork(ops, None), Knobs(freq_mhz, 0, launch_slot=None))


class EmulatedProfilingDevice:
    """A device whose time and energy come from the hardware model; runs nothing.

    The energy counter updates only every ``counter_period_s`` (like NVML's), so a window
    that is too short under-reads, as on a real GPU. The clock is the controller's current
    one (an :class:`~kareus.runtime.clocks.EmulatedClocks`), else the maximum.
    """

    source = "modelled"

    def __init__(
        self, emulator: object, clocks: object | None = None, counter_period_s: float = 0.1
    ) -> None:
        self.emulator = emulator
        self.clocks = clocks
        self.counter_period_s = counter_period_s
        self._t = 0.0
        self._e = 0.0
        self.runs: list[float] = []

    def run(self, work: PartitionWork, knobs: Knobs) -> None:
        """Advance time and energy by one modelled execution at the device's clock."""
        current = getattr(self.clocks, "current", None)
        freq = current if current is not None else self.emulator.spec.clock_max_mhz  # type: ignore[attr-defined]
        est = self.emulator.partition(work, dataclasses.replace(knobs, freq_mhz=freq))  # type: ignore[attr-defined]
        self.runs.append(freq)
        self._t += est.time_s
        self._e += est.energy_j

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def now_s(self) -> float:
        """Return virtual time."""
        return self._t

    def agree(self, reps: int) -> int:
        """One device: its own count."""
        return reps

    def combine(self, time_s: float, energy_j: float) -> tuple[float, float]:
        """One device: its own result."""
        return time_s, energy_j

    def energy_j(self) -> float:
        """Return the energy counter as of its last update."""
        ticks = math.floor(self._t / self.counter_period_s)
        if self._t <= 0:
            return 0.0
        return self._e * (ticks * self.counter_period_s) / self._t

"""What a GPU did while something was measured: its SM clock and power, sampled in the window.

A GPU's clock before work is its idle clock (an H200 idles at 345 MHz) and under load it
is the boost clock, or lower at the power cap (1455 MHz under a large GEMM at 700 W):
a model priced at a clock read before the work prices the wrong clock. :class:`GpuWatch`
samples the clock and power on a thread while a window is open, and at points the caller
chooses (after a synchronisation, when the kernels have just run), so a measurement is
compared with the model at the clock its kernels ran at. Reading only: nothing is set.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from types import TracebackType

Reader = Callable[[], tuple[float | None, float | None]]
"""Returns (SM clock in MHz, power in W) now; None where it cannot be read."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """One sample: seconds since the window opened, SM clock (MHz), power (W)."""

    t_s: float
    sm_mhz: float | None
    power_w: float | None


def nvml_reader(cuda_index: int) -> Reader | None:
    """Return a reader of CUDA device ``cuda_index``, or None where NVML cannot be used.

    The GPU is found by its UUID (CUDA and NVML number GPUs differently).
    """
    from kareus.runtime.clocks import cuda_uuid

    try:
        import pynvml as nv

        nv.nvmlInit()
        uuid = cuda_uuid(cuda_index)
        if uuid is not None:
            handle = nv.nvmlDeviceGetHandleByUUID(uuid)
        else:
            handle = nv.nvmlDeviceGetHandleByIndex(cuda_index)
    except Exception:  # no library, no driver, no such GPU
        return None

    def read() -> tuple[float | None, float | None]:
        try:
            clock = float(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM))
        except Exception:
            clock = None
        try:
            power = nv.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            power = None
        return clock, power

    return read


def fixed_reader(sm_mhz: float | None, power_w: float | None = None) -> Reader:
    """Return a reader that always says ``sm_mhz`` and ``power_w`` (no GPU: the dry run)."""
    return lambda: (sm_mhz, power_w)


class GpuWatch:
    """Samples a GPU's clock and power while open (``with GpuWatch(reader) as w: ...``).

    Args:
        reader: reads the GPU (:func:`nvml_reader`, or a fake in tests).
        period_s: sampling period of the thread; None samples only at :meth:`sample`.
    """

    def __init__(self, reader: Reader, period_s: float | None = 0.005) -> None:
        self.reader = reader
        self.period_s = period_s
        self.samples: list[Reading] = []
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuWatch:
        self._start = time.perf_counter()
        self._stop.clear()
        if self.period_s is not None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="kareus-watch")
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        assert self.period_s is not None
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        """Take one sample now (call it where the kernels have just run)."""
        clock, power = self.reader()
        self.samples.append(Reading(time.perf_counter() - self._start, clock, power))

    @property
    def clock_mhz(self) -> float | None:
        """The median SM clock over the window (None: never read)."""
        values = [s.sm_mhz for s in self.samples if s.sm_mhz is not None]
        return statistics.median(values) if values else None

    @property
    def clock_range(self) -> tuple[float, float] | None:
        """The lowest and highest SM clock seen (None: never read)."""
        values = [s.sm_mhz for s in self.samples if s.sm_mhz is not None]
        return (min(values), max(values)) if values else None

    @property
    def power_w(self) -> float | None:
        """The mean power over the window (None: never read)."""
        values = [s.power_w for s in self.samples if s.power_w is not None]
        return statistics.fmean(values) if values else None

    def describe(self) -> str:
        """Say in a few words what the window saw (for summaries)."""
        if self.clock_mhz is None:
            return "clock not read"
        lo, hi = self.clock_range or (0.0, 0.0)
        spread = f" ({lo:g}-{hi:g})" if lo != hi else ""
        power = f", {self.power_w:.0f} W" if self.power_w is not None else ""
        return f"{self.clock_mhz:g} MHz{spread}{power} over {len(self.samples)} samples"

"""The clock runtime: apply a stage's per-instruction clocks as training runs, and restore.

A switch node at the start of each compiled forward and backward graph calls
:func:`switch_clock`. The runtime takes the next instruction of the stage's per-iteration
schedule (wrapping at its end, one iteration per lap), skips a switch to the clock already
set, and applies it. On CUDA the switch takes effect when the GPU reaches that point: an
event is recorded on the current stream and a worker thread waits for it before setting
the clock. Clocks are restored on normal exit, on exceptions (``with runtime:``), on
SIGTERM and SIGINT (after the handler that was there before: one that ignores the signal
or lets training go on keeps the clocks), and by :meth:`ClockRuntime.close`, which first
lets the worker finish its queued switches. A journal (:mod:`kareus.runtime.journal`)
records which process locked which GPU at which clock, so that a run killed outright
(SIGKILL) has its clock restored by the next run with that journal or by
``kareus restore-clocks``. Without permission to change clocks it warns once, keeps
training, and says so in :attr:`ClockRuntime.notes`. A failing controller or journal never
stops training: it is reported once and left alone.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import pathlib
import queue
import signal
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from kareus.runtime import journal as _journal
from kareus.runtime.clocks import ClockController, ClockPermissionError

_RUNTIMES: dict[int, ClockRuntime] = {}
_IDS = itertools.count()


@dataclasses.dataclass(frozen=True)
class Step:
    """One instruction of a stage's schedule: kind, clock, and its modelled cost."""

    kind: str
    freq_mhz: float
    time_s: float = 0.0
    dynamic_energy_j: float = 0.0


@dataclasses.dataclass(frozen=True)
class IterationEnergy:
    """Time and energy of one iteration on this GPU, and whether measured or modelled."""

    iteration: int
    time_s: float
    energy_j: float
    source: str


class ClockRuntime:
    """Apply a schedule of clocks to one GPU during training.

    Args:
        schedule: the stage's instructions in per-iteration order.
        controller: sets the clock (Zeus, NVML, emulated, dry run).
        journal: the clock journal's path (:mod:`kareus.runtime.journal`), or None.
        static_power_w: for modelled energy (emulated GPU).
        iteration_time_s: modelled iteration time (pipeline bubbles included).
        on_iteration: called with each finished iteration's :class:`IterationEnergy`.
        measure: read energy from Zeus's monitor (real GPUs) instead of the model.
    """

    def __init__(
        self,
        schedule: Sequence[Step],
        controller: ClockController,
        *,
        journal: str | pathlib.Path | None = None,
        static_power_w: float = 0.0,
        iteration_time_s: float | None = None,
        on_iteration: Callable[[IterationEnergy], None] | None = None,
        measure: bool = False,
    ) -> None:
        if not schedule:
            raise ValueError("the clock schedule is empty")
        self.schedule = list(schedule)
        self.controller = controller
        self.journal = pathlib.Path(journal) if journal else None
        self.static_power_w = static_power_w
        self.iteration_time_s = iteration_time_s or sum(s.time_s for s in schedule)
        self.on_iteration = on_iteration
        self.notes: list[str] = []
        self.iterations: list[IterationEnergy] = []
        self.switches: list[float] = []
        self.failed_switches = 0
        self.enabled = True
        self._pos = 0
        self._started = False
        self._current: float | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._restored = False
        self._queue: queue.Queue[Any] | None = None
        self._worker_thread: threading.Thread | None = None
        self._warned_closed = False
        self._monitor = _ZeusWindow() if measure else None
        self.id = next(_IDS)
        _RUNTIMES[self.id] = self
        atexit.register(self.close)
        self._install_signal_handlers()
        if self.journal is not None:
            self._recover()

    def _recover(self) -> None:
        """Restore clocks that crashed runs of this journal left locked, and say so."""
        assert self.journal is not None
        try:
            messages = _journal.recover(self.journal)
        except OSError as err:
            self._journal_failed(err)
            return
        for message in messages:
            self.notes.append(message)
            warnings.warn(f"kareus: {message}", RuntimeWarning, stacklevel=3)

    # ---- the hot path ----------------------------------------------------------------------

    def switch(self, kind: str) -> None:
        """Advance to the next ``kind`` instruction of the schedule and set its clock."""
        if self._closed:
            if not self._warned_closed:
                self._warned_closed = True
                note = (
                    "the clock runtime was closed (a signal or close()) while training went on: "
                    "the remaining steps run at the default clock"
                )
                self.notes.append(note)
                warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=2)
            return
        with self._lock:
            n = len(self.schedule)
            found = [
                (self._pos + k) % n
                for k in range(n)
                if self.schedule[(self._pos + k) % n].kind == kind
            ]
            if not found:
                return
            idx = found[0]
            if self._started and (idx < self._pos or self._pos == 0):
                self._finish_iteration()  # wrapped: the previous iteration is complete
            self._started = True
            self._pos = (idx + 1) % n
            freq = self.schedule[idx].freq_mhz
            if not self.enabled or freq == self._current:
                return
            self._current = freq
            self.switches.append(freq)
        self._apply(freq)

    def _apply(self, freq: float) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()
            self._enqueue(event, freq)
        else:
            self._set(freq)

    def _enqueue(self, event: Any, freq: float) -> None:
        """Set ``freq`` once ``event`` (anything with ``synchronize()``) has happened."""
        if self._queue is None:
            self._queue = queue.Queue()
            self._worker_thread = threading.Thread(
                target=self._worker, daemon=True, name="kareus-clocks"
            )
            self._worker_thread.start()
        self._queue.put((event, freq))

    def _worker(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:  # close(): every queued switch before it has been applied
                return
            event, freq = item
            event.synchronize()  # the GPU reached the switch point
            self._set(freq)

    def _set(self, freq: float) -> None:
        if self._restored:
            return
        try:
            self.controller.set(freq)
            self._log("set", freq_mhz=freq)
        except ClockPermissionError as err:
            self.enabled = False
            note = f"clocks were not applied: {err}"
            self.notes.append(note)
            warnings.warn(
                f"kareus: {note}. Training continues at the default clock.",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception as err:  # a controller's failure (I/O, driver) never stops training
            self.failed_switches += 1
            if self.failed_switches == 1:
                note = f"a clock switch to {freq:g} MHz failed and was skipped: {err!r}"
                self.notes.append(note + " (later failures are counted, not repeated)")
                warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=3)

    # ---- iterations and energy ---------------------------------------------------------------

    def _finish_iteration(self) -> None:
        if self._monitor is not None:
            time_s, energy_j = self._monitor.lap()
            rec = IterationEnergy(len(self.iterations), time_s, energy_j, "measured")
        else:
            dyn = sum(s.dynamic_energy_j for s in self.schedule)
            t = self.iteration_time_s
            rec = IterationEnergy(
                len(self.iterations), t, dyn + self.static_power_w * t, "modelled"
            )
        self.iterations.append(rec)
        if self.on_iteration is not None:
            try:
                self.on_iteration(rec)
            except Exception as err:  # a user callback must not stop training
                self.notes.append(f"on_iteration callback failed: {err!r}")

    def to_text(self) -> str:
        """Describe the schedule, what was applied and the iterations (for ``explain``)."""
        sched = " ".join(f"{s.kind[0].upper()}@{s.freq_mhz:g}" for s in self.schedule)
        lines = [
            f"clock controller: {self.controller.name}; schedule per iteration (MHz): {sched}",
            f"switches applied: {len(self.switches)}; clocks "
            + ("applied" if self.enabled else "NOT applied")
            + (f"; {self.failed_switches} switch(es) failed" if self.failed_switches else ""),
        ]
        lines += [
            f"iteration {r.iteration}: {r.time_s:.6f} s, {r.energy_j:.3f} J ({r.source})"
            for r in self.iterations[-5:]
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    # ---- safety --------------------------------------------------------------------------------

    def close(self) -> None:
        """Let queued switches finish, then restore the default clock (idempotent).

        A failed restore is journalled and warned about with the GPU and how to restore it.
        """
        if self._closed:
            return
        self._closed = True
        _RUNTIMES.pop(self.id, None)
        if self._queue is not None and self._worker_thread is not None:
            self._queue.put(None)
            self._worker_thread.join(timeout=30)
        self._restored = True
        if self._current is None or not self.enabled:
            return
        try:
            self.controller.reset()
        except Exception as err:  # any failure: say which GPU may still be locked
            gpu = getattr(self.controller, "index", 0)
            note = (
                f"restoring GPU {gpu}'s clock failed, it may still be locked at "
                f"{self._current:g} MHz: {err}. Restore it with `kareus restore-clocks"
                + (f" --journal {self.journal}`" if self.journal else "`")
                + f" or, as root, `nvidia-smi -rgc -i {gpu}`"
            )
            self.notes.append(note)
            warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=2)
            self._log("restore_failed", freq_mhz=self._current, error=str(err))
            return
        self._log("restore")

    def __enter__(self) -> ClockRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log(self, event: str, **extra: Any) -> None:
        if self.journal is None:
            return
        try:
            _journal.record(
                self.journal,
                event,
                gpu=getattr(self.controller, "index", 0),
                controller=getattr(self.controller, "journal_name", self.controller.name),
                **extra,
            )
        except OSError as err:
            self._journal_failed(err)

    def _journal_failed(self, err: OSError) -> None:
        note = (
            f"the clock journal {self.journal} cannot be written ({err}); training goes on "
            "without it, so a crash would leave no record of a locked clock"
        )
        self.journal = None
        self.notes.append(note)
        warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=3)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN or previous is None:
                continue  # the program ignores it (or it was set outside Python): keep going

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                if callable(previous):
                    try:
                        previous(signum, frame)
                    except BaseException:  # the handler ends the program (KeyboardInterrupt)
                        self.close()
                        raise
                    return  # the program's handler chose to go on: so do the clocks
                self.close()
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

            signal.signal(sig, handler)


class _ZeusWindow:
    """Per-iteration time and energy from Zeus's monitor (NVML energy counter)."""

    def __init__(self) -> None:
        from zeus.monitor import ZeusMonitor

        self.mon = ZeusMonitor()
        self.mon.begin_window("kareus", sync_execution=False)

    def lap(self) -> tuple[float, float]:
        m = self.mon.end_window("kareus", sync_execution=False)
        self.mon.begin_window("kareus", sync_execution=False)
        return m.time, m.total_energy


def switch_clock(runtime_id: int, kind: str) -> None:
    """Switch the clock of runtime ``runtime_id`` (what the inserted graph nodes call)."""
    runtime = _RUNTIMES.get(runtime_id)
    if runtime is not None:
        runtime.switch(kind)

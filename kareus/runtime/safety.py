"""The clock runtime's hold on the hardware: set a clock, journal it, restore the default.

:class:`ClockHold` is the part of :class:`~kareus.runtime.switcher.ClockRuntime` that touches
the GPU and the journal (the runtime holds one and never touches its locks): every
controller call goes through :meth:`ClockHold.set` (under one re-entrant lock), the first
lock and each restore are journalled, a signal restores the default clock before the
program ends, and a journal left by a crashed run is recovered at start. No method here
takes the schedule's lock, runs user code, or waits for anything but a controller call in
flight: a signal handler may run them.
"""

from __future__ import annotations

import pathlib
import queue
import signal
import threading
import time
import warnings
from typing import Any

import torch

from kareus.runtime import journal as _journal
from kareus.runtime.clocks import ClockController, ClockPermissionError, journal_name_of

KEEP = 4096
"""Applied instructions and switches kept for ``explain`` (older ones are dropped: a long
run must not grow the runtime)."""


class ClockHold:
    """One GPU's clock as a runtime holds it: set, journalled, restored however the run ends.

    Args:
        controller: sets the clock (Zeus, NVML, emulated, dry run).
        journal: the clock journal's path (:mod:`kareus.runtime.journal`), or None.
        notes: where what went wrong is said (the runtime's notes, shared).

    Attributes:
        enabled: False once the controller refused for want of permission.
        current: the clock asked for last (None: the default, untouched).
        closed: no more switches (``close`` or a signal).
        switches: the last clocks the controller set (recorded once set).
        switch_count, failed_switches: switches set, and failed.
        switch_calls, switch_call_s, switch_call_max_s: the controller's set calls that
            returned, and their wall time in all and at most (measured).
        worker_cpu_s: CPU time the switch worker spent waiting on the GPU (measured).
    """

    def __init__(
        self, controller: ClockController, journal: pathlib.Path | None, notes: list[str]
    ) -> None:
        self.controller = controller
        self.journal = journal
        self.notes = notes
        self.enabled = True
        self.current: float | None = None
        self.closed = False
        self.switches: list[float] = []
        self.switch_count = 0
        self.failed_switches = 0
        self.switch_calls = 0
        self.switch_call_s = 0.0
        self.switch_call_max_s = 0.0
        self.worker_cpu_s = 0.0
        # serialises the controller's calls (switch worker, close, signal handler);
        # re-entrant, so that a handler that interrupts a call on this thread can restore
        self._hw_lock = threading.RLock()
        self._restored = False  # no more clocks set: the default is (being) restored
        self._reset_done = False  # the controller's reset ran (or failed and was reported)
        self._locked = False  # this process locked the clock since it was last restored
        self._queue: queue.Queue[Any] | None = None
        self.worker: threading.Thread | None = None  # the switch worker, once started

    def apply(self, freq: float) -> None:
        """Set ``freq`` when the GPU reaches this point (on CUDA, by the switch worker)."""
        waits = getattr(self.controller, "waits_for_gpu", True)
        if waits and torch.cuda.is_available() and torch.cuda.is_initialized():
            # blocking: the worker's synchronize() sleeps until the GPU gets there instead of
            # spinning a CPU core per rank
            event = torch.cuda.Event(blocking=True)
            event.record()
            self.enqueue(event, freq)
        else:
            self.set(freq)

    def enqueue(self, event: Any, freq: float) -> None:
        """Set ``freq`` once ``event`` (anything with ``synchronize()``) has happened."""
        if self._queue is None:
            self._queue = queue.Queue()
            self.worker = threading.Thread(target=self._work, daemon=True, name="kareus-clocks")
            self.worker.start()
        self._queue.put((event, freq))

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:  # close(): every queued switch before it has been applied
                return
            event, freq = item
            cpu = time.thread_time()
            event.synchronize()  # the GPU reached the switch point
            self.worker_cpu_s += time.thread_time() - cpu
            self.set(freq)

    def stop_worker(self) -> None:
        """Let the switch worker set the clocks queued so far, then end it."""
        if self._queue is not None and self.worker is not None:
            self._queue.put(None)
            self.worker.join(timeout=30)

    def recover(self) -> None:
        """Restore clocks that crashed runs of this journal left locked, and say so."""
        assert self.journal is not None
        try:
            messages = _journal.recover(self.journal, own=self.controller)
        except OSError as err:
            self._journal_failed(err)
            return
        for message in messages:
            self.notes.append(message)
            warnings.warn(f"kareus: {message}", RuntimeWarning, stacklevel=3)

    def set(self, freq: float) -> None:
        """Set ``freq`` now, unless the default clock is (being) restored."""
        with self._hw_lock:
            if self._restored:
                return
            self._set_clock(freq)
            if self._restored:  # a signal restored the clock while this one was being set
                self._reset_now()

    def _set_clock(self, freq: float) -> None:
        try:
            start = time.perf_counter()
            self.controller.set(freq)
            took = time.perf_counter() - start
            self.switch_call_s += took
            self.switch_call_max_s = max(self.switch_call_max_s, took)
            self.switch_calls += 1
            # recorded once the controller has set it, not when the switch was reached
            self.switch_count += 1
            self.switches.append(freq)
            if len(self.switches) > 2 * KEEP:
                del self.switches[:-KEEP]
            if not self._locked:  # one record per lock, not per switch: the journal stays small
                self._locked = True
                self._log("lock", freq_mhz=freq)
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

    def restore_now(self) -> None:
        """Stop switching and restore the default clock now (idempotent, signal-safe).

        Takes no lock a training thread may hold on this thread, runs no user code, and
        waits only for a controller call in flight on the switch worker.
        """
        self.closed = True
        self._restored = True
        with self._hw_lock:
            if not self._reset_done:
                self._reset_now()

    def _reset_now(self) -> None:
        self._restore()
        self._reset_done = True

    def _restore(self) -> None:
        if self.current is None or not self.enabled:
            return
        try:
            self.controller.reset()
        except Exception as err:  # any failure: say which GPU may still be locked
            gpu = {"gpu": self.controller.index, "uuid": getattr(self.controller, "uuid", None)}
            note = (
                f"restoring {_journal.describe_gpu(gpu)}'s clock failed, it may still be "
                f"locked at {self.current:g} MHz: {err}. Restore it with `kareus restore-clocks"
                + (f" --journal {self.journal}`" if self.journal else "`")
                + f" or, as root, `{_journal.reset_command(gpu)}`"
            )
            self.notes.append(note)
            warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=2)
            self._log("restore_failed", freq_mhz=self.current, error=str(err))
            return
        self._locked = False
        self._log("restore")

    def _log(self, event: str, **extra: Any) -> None:
        if self.journal is None:
            return
        try:
            _journal.record(
                self.journal,
                event,
                gpu=getattr(self.controller, "index", 0),
                controller=journal_name_of(self.controller),
                uuid=getattr(self.controller, "uuid", None),
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

    def install_signal_handlers(self) -> None:
        """Restore the default clock on SIGTERM and SIGINT, after the program's own handler."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN or previous is None:
                continue  # the program ignores it (or it was set outside Python): keep going

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                # No lock, no join, no user callback here: the signal may have interrupted
                # this very thread inside the runtime, a callback or close().
                if callable(previous):
                    try:
                        previous(signum, frame)
                    except BaseException:  # the handler ends the program (KeyboardInterrupt)
                        self.restore_now()
                        raise
                    return  # the program's handler chose to go on: so do the clocks
                self.restore_now()
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

            signal.signal(sig, handler)

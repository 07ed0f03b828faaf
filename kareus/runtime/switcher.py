"""The clock runtime: apply each instruction's planned clock as training runs, and restore.

A switch node at the start of each compiled forward and backward graph calls the custom op
``kareus::switch_clock`` with the graph's pipeline stage, its direction and its compiled
region. The runtime names the instruction that is starting by counting: the n-th forward
(backward) pass of a stage is micro-batch ``n mod M`` of iteration ``n div M``, where M is
the stage's micro-batch count in the plan. Every pipeline schedule runs a stage's forwards,
and its backwards, in micro-batch order (GPipe, 1F1B and interleaved 1F1B alike), so this
identifies each instruction whatever the interleaving of forwards and backwards, and the
instruction gets exactly the clock the plan gives it. Each compiled region counts its own
calls, so a graph break (two regions per pass) does not advance the schedule twice; a
forward run while autograd executes a backward is an activation recompute and keeps the
backward's clock. A second switch where each backward graph ends starts the plan's *step*
(data-parallel communication and the optimizer, after the GPU's last backward of the
iteration: every region of every stage on it at its last micro-batch) at its own clock. A
stage whose observed order differs from the plan's (a plan made for another schedule) is
reported once. One runtime serves one GPU, whatever the number of
stages (interleaved schedules) and regions on it.

On CUDA the switch takes effect when the GPU reaches that point: an event is recorded on
the current stream and a worker thread waits for it before setting the clock (a controller
of no GPU, ``waits_for_gpu = False``, is set as the host reaches the switch). Clocks are
restored on normal exit, on exceptions (``with runtime:``), on SIGTERM and SIGINT (after
the handler that was there before: one that ignores the signal or lets training go on keeps
the clocks), and by :meth:`ClockRuntime.close`, which first lets the worker finish its
queued switches. A journal (:mod:`kareus.runtime.journal`) records which process locked
which GPU at which clock, so that a run killed outright (SIGKILL) has its clock restored by
the next run with that journal or by ``kareus restore-clocks``. Without permission to change
clocks it warns once, keeps training, and says so in :attr:`ClockRuntime.notes`. A failing
controller or journal never stops training: it is reported once and left alone.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import pathlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kareus.runtime import journal as _journal
from kareus.runtime.clocks import (
    ClockController,
    ClockError,
)
from kareus.runtime.describe import describe
from kareus.runtime.safety import KEEP, ClockHold
from kareus.runtime.schedule import IterationEnergy, Step

_KEEP = KEEP

_RUNTIMES: dict[int, ClockRuntime] = {}
_BY_DEVICE: dict[object, ClockRuntime] = {}
_IDS = itertools.count()


STEP = "step"
"""The kind of the instruction after a GPU's last backward of an iteration (data-parallel
communication and the optimizer step), and of the switch where a backward graph ends."""

_SHAPE_RUNS = 0
"""Greater than zero while a framework runs the model only to learn shapes (no instruction)."""


class DeviceBusyError(ClockError):
    """Another process already controls this GPU's clock."""


def _not_an_instruction(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that the model runs inside it are not counted as instructions."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        global _SHAPE_RUNS
        _SHAPE_RUNS += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _SHAPE_RUNS -= 1

    wrapped._kareus_shape_run = True  # type: ignore[attr-defined]
    return wrapped


def _watch_shape_runs() -> None:
    """Mark torch.distributed.pipelining's metadata inference as not an instruction.

    Before its first step, a ``PipelineStage`` runs a forward and a backward of its module
    on placeholder tensors to learn shapes; they are no micro-batch of the iteration. A
    process-wide mark (not thread-local: the autograd engine runs CUDA backwards on its own
    threads) makes the runtime ignore the switches they reach.
    """
    try:
        from torch.distributed.pipelining import stage
    except ImportError:  # a torch build without distributed
        return
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        fn = getattr(stage.PipelineStage, name, None)
        if fn is not None and not getattr(fn, "_kareus_shape_run", False):
            setattr(stage.PipelineStage, name, _not_an_instruction(fn))


def _held(name: str) -> Any:
    """Return a read-only view of the runtime's :class:`ClockHold` attribute ``name``."""
    return property(lambda self: getattr(self.hold, name), doc=f"The clock hold's ``{name}``.")


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

    # what the hold on the GPU did, read through the runtime (:class:`ClockHold` owns it)
    controller = _held("controller")
    journal = _held("journal")
    enabled = _held("enabled")
    switches = _held("switches")
    switch_count = _held("switch_count")
    failed_switches = _held("failed_switches")
    switch_calls = _held("switch_calls")
    switch_call_s = _held("switch_call_s")
    switch_call_max_s = _held("switch_call_max_s")
    worker_cpu_s = _held("worker_cpu_s")

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
        self.schedule: list[Step] = []
        self._steps: dict[tuple[int, str, int], Step] = {}
        self._counts: dict[tuple[int, str], int] = {}  # micro-batches per (stage, kind)
        self._step: Step | None = None  # the step after this GPU's last backward, if planned
        self.add(schedule)
        self.static_power_w = static_power_w
        self.iteration_time_s = iteration_time_s or sum(s.time_s for s in self.schedule)
        self.on_iteration = on_iteration
        self.notes: list[str] = []
        self.iterations: list[IterationEnergy] = []
        self.hold = ClockHold(controller, pathlib.Path(journal) if journal else None, self.notes)
        self.applied: collections.deque[tuple[int, int, str, int, float]] = collections.deque(
            maxlen=_KEEP
        )
        """(iteration, stage, kind, micro-batch, MHz) of the last instructions started."""
        self._calls: dict[tuple[int, str, int], int] = {}  # passes per (stage, kind, region)
        self._iteration = -1
        self._order: dict[int, list[tuple[str, int]]] = {}  # iteration 0's order, per stage
        self._seen: set[tuple[int, tuple[int, str, int]]] = set()
        self._ended: dict[int, set[tuple[int, int]]] = {}  # (stage, region) last backwards
        self._step_iteration = -1  # the last iteration whose step started
        # _lock guards the schedule's counters only: no controller, journal, monitor or user
        # callback runs under it, and no signal handler takes it (the hold has its own).
        self._lock = threading.Lock()
        self._finalised = False  # close() ran to its end
        self._warned_closed = False
        key = getattr(controller, "device_key", None)
        if key is not None:
            holder = _journal.claim(key)
            if holder is not None:
                raise DeviceBusyError(
                    f"{key} is already controlled by process {holder}: two processes must "
                    "not set one GPU's clock. Give each rank its own GPU: call "
                    "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
                    "kareus.compile (torchrun sets LOCAL_RANK), or check "
                    "CUDA_VISIBLE_DEVICES; processes that must share a GPU pass "
                    "clocks=kareus.runtime.clocks.DryRunClocks() in all but one"
                )
        self._monitor = _ZeusWindow(controller.index) if measure else None
        _watch_shape_runs()
        self.id = next(_IDS)
        _RUNTIMES[self.id] = self
        atexit.register(self.close)
        self.hold.install_signal_handlers()
        if self.hold.journal is not None:
            self.hold.recover()

    # ---- the hot path ----------------------------------------------------------------------

    @classmethod
    def for_device(
        cls, schedule: Sequence[Step], controller: ClockController, **options: Any
    ) -> ClockRuntime:
        """Return the runtime of ``controller``'s GPU with ``schedule`` added to it.

        One runtime per GPU in a process: the stages of an interleaved schedule, each
        compiled on its own, and regions planned at compile time share it (and its clock).
        A new one (``options`` as for the constructor) when none is open.
        """
        key = getattr(controller, "device_key", None) or controller
        runtime = _BY_DEVICE.get(key)
        if runtime is None or runtime.hold.closed:
            runtime = cls(schedule, controller, **options)
            _BY_DEVICE[key] = runtime
        else:
            runtime.add(schedule)
        return runtime

    def add(self, steps: Sequence[Step]) -> None:
        """Add instructions (another stage on this GPU, or a region planned at compile time).

        Raises:
            ValueError: an instruction is already scheduled at another clock.
        """
        for step in steps:
            old = self._steps.get(step.key)
            if old is not None:
                if old.freq_mhz != step.freq_mhz:
                    raise ValueError(
                        f"instruction {step.key} is scheduled twice on this GPU, at "
                        f"{old.freq_mhz:g} and {step.freq_mhz:g} MHz: two plans claim it"
                    )
                continue
            self._steps[step.key] = step
            self.schedule.append(step)
            if step.kind == STEP:
                self._step = step
            self._counts[step.stage, step.kind] = self._counts.get((step.stage, step.kind), 0) + 1

    def stages(self) -> list[int]:
        """Return the stages this GPU runs in the plan."""
        return sorted({s.stage for s in self.schedule})

    def switch(self, stage: int, kind: str, region: int = 0) -> None:
        """Start the next ``kind`` pass of ``stage`` (seen from ``region``): set its clock."""
        if self.hold.closed:
            if not self._warned_closed:
                self._warned_closed = True
                note = (
                    "the clock runtime was closed (a signal or close()) while training went on: "
                    "the remaining steps run at the default clock"
                )
                self.notes.append(note)
                warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=2)
            return
        if _SHAPE_RUNS:
            return  # a run for shapes only, not an instruction
        if kind == STEP:
            self._after_backward(stage, region)
            return
        if kind == "forward" and torch._C._current_graph_task_id() != -1:
            return  # a recompute inside a backward pass: the backward's clock stays
        per_iteration = self._counts.get((stage, kind), 0)
        if per_iteration == 0:
            return  # the plan has no such instruction on this GPU
        finished = started = False
        freq: float | None = None
        with self._lock:
            calls = self._calls.get((stage, kind, region), 0)
            self._calls[stage, kind, region] = calls + 1
            iteration, microbatch = divmod(calls, per_iteration)
            step = self._steps[stage, kind, microbatch]
            if (iteration, step.key) in self._seen:
                return  # another region of the same pass already started it
            self._seen.add((iteration, step.key))
            if iteration > self._iteration:
                finished = self._iteration >= 0  # the previous iteration is complete
                started = self._iteration < 0  # the first instruction: energy window opens
                if self._iteration == 0:
                    self._check_order()
                self._iteration = iteration
                self._seen = {k for k in self._seen if k[0] >= iteration}
            if iteration == 0:
                self._order.setdefault(stage, []).append((kind, microbatch))
            self.applied.append((iteration, stage, kind, microbatch, step.freq_mhz))
            freq = self._take(step.freq_mhz)
        # Outside the lock: the monitor, the user's callback and the controller.
        if started and self._monitor is not None:
            self._monitor.start()
        if finished:
            self._finish_iteration()
        if freq is not None:
            self.hold.apply(freq)

    def _take(self, freq: float) -> float | None:
        """Under the lock: ``freq`` is the clock from here; return it if it must be set."""
        if not self.hold.enabled or freq == self.hold.current:
            return None
        self.hold.current = freq
        return freq

    def _after_backward(self, stage: int, region: int) -> None:
        """Note that a backward of ``stage`` ended in ``region``; start the step after the last.

        After the GPU's last backward of the iteration (every region of every stage on it
        at its last micro-batch), the step's clock is set: DDP's last all-reduce and the
        optimizer step run at it.
        """
        step = self._step
        if step is None:
            return
        freq: float | None = None
        with self._lock:
            per_iteration = self._counts.get((stage, "backward"), 0)
            calls = self._calls.get((stage, "backward", region), 0)
            if per_iteration == 0 or calls == 0:
                return
            iteration, microbatch = divmod(calls - 1, per_iteration)
            if microbatch != per_iteration - 1 or iteration <= self._step_iteration:
                return
            ended = self._ended.setdefault(iteration, set())
            ended.add((stage, region))
            regions = {
                (s, r)
                for s, k, r in self._calls
                if k == "forward" and self._counts.get((s, "backward"), 0)
            }
            if not regions <= ended:
                return  # another region or stage of this GPU has its last backward to run
            self._ended = {i: e for i, e in self._ended.items() if i > iteration}
            self._step_iteration = iteration
            self.applied.append((iteration, step.stage, STEP, 0, step.freq_mhz))
            freq = self._take(step.freq_mhz)
        if freq is not None:
            self.hold.apply(freq)

    def count_unswitched(self, stage: int, kind: str, region: int, passes: int) -> None:
        """Count ``passes`` of ``kind`` that ``region`` ran before its switch existed.

        A region planned at compile time gets its plan at its first backward, after its first
        forward ran: that forward was the first instruction of the plan, at the clock the GPU
        had, and the region's later passes count from it.
        """
        if passes <= 0 or self._counts.get((stage, kind), 0) == 0:
            return
        with self._lock:
            calls = self._calls.get((stage, kind, region), 0)
            self._calls[stage, kind, region] = calls + passes
            for n in range(calls, calls + passes):
                iteration, microbatch = divmod(n, self._counts[stage, kind])
                self._seen.add((iteration, (stage, kind, microbatch)))
                if iteration == 0:
                    self._order.setdefault(stage, []).append((kind, microbatch))

    def _check_order(self) -> None:
        """Compare each stage's order in the first iteration with the plan's; report once."""
        for stage, seen in sorted(self._order.items()):
            planned = [
                (s.kind, s.microbatch) for s in self.schedule if s.stage == stage and s.kind != STEP
            ]
            if seen != planned:
                note = (
                    f"stage {stage} ran its instructions in the order {_order_text(seen)}, but "
                    f"the plan was made for {_order_text(planned)}: each instruction still "
                    "gets its planned clock, but the plan's modelled time and energy describe "
                    "another pipeline schedule (or micro-batch count); re-plan for the "
                    "schedule this job runs (`kareus plan --schedule ...`)"
                )
                self.notes.append(note)
                warnings.warn(f"kareus: {note}", RuntimeWarning, stacklevel=4)

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
        return describe(self.hold, self.schedule, self.iterations, self.notes)

    # ---- the hold on the GPU -------------------------------------------------------------------

    def restore_now(self) -> None:
        """Stop switching and restore the default clock now (idempotent, signal-safe)."""
        self.hold.restore_now()

    def close(self) -> None:
        """Let queued switches finish, then restore the default clock (idempotent).

        A failed restore is journalled and warned about with the GPU and how to restore it.
        """
        if self._finalised:
            return
        self._finalised = True
        already = self.hold.closed  # a signal closed it: the clock is back already
        self.hold.closed = True
        _RUNTIMES.pop(self.id, None)
        with self._lock:
            done = sum(1 for it, _key in self._seen if it == self._iteration)
            last = not already and self._iteration >= 0 and done == len(self.schedule)
            if last:
                self._iteration += 1
        if last:
            self._finish_iteration()  # the last iteration ran every instruction
        self.hold.stop_worker()
        try:
            self.hold.restore_now()
        finally:
            key = getattr(self.hold.controller, "device_key", None)
            if key is not None:
                _journal.release(key)  # only once the clock is back (or reported stuck)

    def __enter__(self) -> ClockRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ZeusWindow:
    """Per-iteration time and energy of one GPU from Zeus's monitor (NVML energy counter).

    A window opens at the first instruction and is closed and reopened at each iteration
    boundary, without synchronising the GPU (the boundary is a host-side event).
    """

    def __init__(self, gpu_index: int) -> None:
        try:
            from zeus.monitor import ZeusMonitor
        except ImportError as err:
            raise ClockError(
                "measure=True reads energy from Zeus, which is not installed: "
                "`pip install zeus`, or pass measure=False for modelled energy"
            ) from err
        try:
            self.mon = ZeusMonitor(gpu_indices=[gpu_index], cpu_indices=[])
            self.gpu_index = gpu_index
        except Exception as err:  # Zeus raises its own errors without a usable GPU
            raise ClockError(f"Zeus cannot measure GPU {gpu_index}: {err}") from err

    def start(self) -> None:
        """Open the first window."""
        self.mon.begin_window("kareus", sync_execution=False)

    def lap(self) -> tuple[float, float]:
        """Close the window, open the next; return the closed one's time and energy."""
        m = self.mon.end_window("kareus", sync_execution=False)
        self.mon.begin_window("kareus", sync_execution=False)
        return m.time, float(m.gpu_energy[self.gpu_index])


def _order_text(order: Sequence[tuple[str, int]]) -> str:
    return " ".join(f"{kind[0].upper()}{mb}" for kind, mb in order)


@torch.library.custom_op("kareus::switch_clock", mutates_args=())
def switch_clock(runtime_id: int, stage: int, kind: str, region: int) -> None:
    """Start instruction ``kind`` of ``stage`` on runtime ``runtime_id`` (the graph node).

    A registered operator with side effects, so that every backend (Python, Inductor)
    keeps it, in place, at the start of its graph.
    """
    runtime = _RUNTIMES.get(runtime_id)
    if runtime is not None:
        runtime.switch(stage, kind, region)


@switch_clock.register_fake
def _(runtime_id: int, stage: int, kind: str, region: int) -> None:
    return None


@torch.library.custom_op("kareus::switch_clock_after", mutates_args=())
def switch_clock_after(runtime_id: int, stage: int, region: int, after: list[torch.Tensor]) -> None:
    """End a backward graph of ``stage`` (the graph node): start the step after the last.

    Takes the graph's outputs, so that every backend runs it after all that computes them
    (a node with side effects but no inputs may be moved among the kernels).
    """
    runtime = _RUNTIMES.get(runtime_id)
    if runtime is not None:
        runtime.switch(stage, STEP, region)


@switch_clock_after.register_fake
def _(runtime_id: int, stage: int, region: int, after: list[torch.Tensor]) -> None:
    return None


SWITCH_AFTER_OP = torch.ops.kareus.switch_clock_after.default
"""The switch where a backward graph ends, as an operator."""

SWITCH_OP = torch.ops.kareus.switch_clock.default
"""The switch as an operator (the graph pass marks it as having side effects)."""

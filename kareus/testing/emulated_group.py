"""A process group of one whose collectives take a modelled time, without occupying compute.

The overlap kareus makes pays only where a collective runs while the GPU computes, and what
it pays depends on how long each collective takes beside the compute. A machine with one
device (or none) can still run a tensor-parallel layer's shapes and its communication times:
an :class:`EmulatedGroup` is a ``torch.distributed`` process group of one rank whose every
collective returns its true result (a group of one: the input itself) but completes only a
given duration after it was issued. Nothing computes meanwhile: on a CPU a timer completes
the work; on CUDA a side stream runs a spinning kernel for the duration and the compute
stream waits on an event recorded after it (a stream wait, as NCCL's collectives give).
The durations come from kareus's hardware model for a named GPU, tensor-parallel degree and
link (:func:`modelled_durations`), scaled so that each collective keeps its modelled share
of a step on a device of another speed.

The group says how long its collectives take (:meth:`EmulatedGroup.collective_time_s`), so
kareus's split pricing (:mod:`kareus.compiler.split_pricing`) reads the same durations the
group runs. Everything measured through it is "collectives emulated at modelled durations".

Example::

    group = EmulatedGroup.register(modelled_durations("a100-nvlink", tp=8, scale=s))
    model = Llama(per_rank_config, tp_group=group.group_name)
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kareus._torch_internals import register_process_group

DurationFn = Callable[[str, int], float]
"""Seconds a collective takes: (kind, bytes of its input as this process holds it, which is
what kareus's graphs record of a collective, :class:`kareus.ir.costs.CollectiveCost`)."""

_NAMES = itertools.count()


@dataclasses.dataclass
class CollectiveRecord:
    """One emulated collective as it ran (host seconds from ``time.perf_counter``).

    Attributes:
        kind: ``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``.
        nbytes: the bytes its duration was priced on.
        duration_s: how long it took to complete after being issued.
        overlapped_s: of that, the time before anything waited for it (the part that flew
            beside other work); None until it is waited for (and on CUDA, where the host
            does not see when the device waits).
    """

    kind: str
    nbytes: int
    duration_s: float
    issued_at: float
    overlapped_s: float | None = None


class _TimedWork(dist._Work):  # type: ignore[misc,name-defined]
    """Work that completes ``duration`` after it was issued (a timer on the CPU)."""

    def __init__(self, result: list[torch.Tensor], record: CollectiveRecord) -> None:
        super().__init__()
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._record = record
        self._result = result
        self._done_at = record.issued_at + record.duration_s
        if record.duration_s <= 0:
            self._future.set_result(result)
        else:
            timer = threading.Timer(record.duration_s, self._future.set_result, (result,))
            timer.daemon = True
            timer.start()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the collective completes; record how much of it flew beside work."""
        if self._record.overlapped_s is None:
            now = time.perf_counter()
            self._record.overlapped_s = max(0.0, min(now, self._done_at) - self._record.issued_at)
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the duration has passed."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Return the future completed with the result when the duration has passed."""
        return self._future


class _StreamWork(dist._Work):  # type: ignore[misc,name-defined]
    """Work whose wait makes the current CUDA stream wait on an event after a timed kernel."""

    def __init__(self, result: list[torch.Tensor], event: Any) -> None:
        super().__init__()
        self._event = event
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        """Order the current stream after the emulated collective (the host does not block)."""
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        """Whether the side stream passed the event."""
        return bool(self._event.query())

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Return a completed future (the stream wait orders the result)."""
        return self._future


class EmulatedGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A process group of one whose collectives complete after ``durations(kind, bytes)``.

    Args:
        durations: seconds each collective takes, from its kind and the bytes of its input
            (:data:`DurationFn`; kareus's pricing asks the same function,
            :meth:`collective_time_s`).
        name: the name registered with ``torch.distributed`` (made up when None).
    """

    def __init__(self, durations: DurationFn, *, name: str | None = None) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]
        self._durations = durations
        self._name = name or f"kareus_emulated_{next(_NAMES)}"
        self.records: list[CollectiveRecord] = []
        self._cuda_sleep_cycles_per_s: float | None = None

    @classmethod
    def register(cls, durations: DurationFn, **kwargs: Any) -> EmulatedGroup:
        """Make a group and register it by name (functional collectives find it by name)."""
        group = cls(durations, **kwargs)
        register_process_group(group.group_name, group)
        return group

    # ---- what kareus reads ---------------------------------------------------------------

    def collective_time_s(self, kind: str, nbytes: int) -> float:
        """Return the seconds a collective of ``kind`` on an input of ``nbytes`` takes here."""
        return float(self._durations(kind, nbytes)) if nbytes else 0.0

    occupies_compute = False
    """The emulated collective takes no compute from the work beside it (kareus's pricing)."""

    # ---- the process-group protocol ------------------------------------------------------

    def getGroupName(self) -> str:
        """Return the registered name (functional collectives look the group up by it)."""
        return self._name

    def setGroupName(self, name: str) -> None:
        """Rename (c10d renames a group it registers)."""
        self._name = name

    def getBackendName(self) -> str:
        """Return the backend's name as c10d reports it."""
        return "kareus-emulated"

    def size(self) -> int:
        """One rank."""
        return 1

    def rank(self) -> int:
        """Rank 0."""
        return 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """All-reduce over one rank: the tensors as they are, after the duration."""
        return self._issue("all_reduce", tensors, _bytes(tensors))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        output.copy_(input.reshape(output.shape))
        return self._issue("all_gather", [output], _bytes([input]))

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """All-gather each input into its output (one rank: a copy), after the duration."""
        for out, inp in zip(outputs, inputs, strict=True):
            out.copy_(inp.reshape(out.shape))
        return self._issue("all_gather", outputs, _bytes(inputs))

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        output.copy_(input.reshape(output.shape))
        return self._issue("reduce_scatter", [output], _bytes([input]))

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """Reduce-scatter each input into its output (one rank: a copy), after the duration."""
        for out, inp in zip(outputs, inputs, strict=True):
            out.copy_(inp.reshape(out.shape))
        return self._issue("reduce_scatter", outputs, _bytes(inputs))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        """All-to-all over one rank: the input, after the duration."""
        output.copy_(input.reshape(output.shape))
        return self._issue("all_to_all", [output], _bytes([input]))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """Broadcast from the only rank: nothing moves."""
        return self._issue("broadcast", tensors, 0)

    def barrier(self, opts: Any = None) -> Any:
        """Pass a barrier of one rank."""
        return self._issue("barrier", [], 0)

    # ---- emulation -----------------------------------------------------------------------

    def _issue(self, kind: str, result: list[torch.Tensor], nbytes: int) -> Any:
        duration = self.collective_time_s(kind, nbytes)
        record = CollectiveRecord(kind, nbytes, duration, time.perf_counter())
        self.records.append(record)
        device = result[0].device if result else torch.device("cpu")
        if device.type == "cuda":
            return _StreamWork(result, self._cuda_delay(duration, device))
        return _TimedWork(result, record)

    def _cuda_delay(self, duration_s: float, device: torch.device) -> Any:
        """Record an event ``duration_s`` of device time after the current stream's work.

        A side stream waits for the compute stream (the collective's input is ready), runs
        one spinning kernel of one thread block for the duration, and records an event.
        """
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if duration_s > 0:
                torch.cuda._sleep(int(duration_s * self._cycles_per_s(device)))
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _cycles_per_s(self, device: torch.device) -> float:
        """Return the spinning kernel's cycles per second on ``device`` (measured once)."""
        if self._cuda_sleep_cycles_per_s is None:
            cycles = 10_000_000
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cuda_sleep_cycles_per_s = cycles / (start.elapsed_time(end) * 1e-3)
        return self._cuda_sleep_cycles_per_s

    def per_step(self, steps: int) -> list[tuple[str, int, int, float]]:
        """(kind, bytes, calls per step, seconds each) of the collectives recorded so far."""
        counts: dict[tuple[str, int], list[float]] = {}
        for r in self.records:
            counts.setdefault((r.kind, r.nbytes), []).append(r.duration_s)
        return [
            (kind, nbytes, round(len(d) / steps), d[0])
            for (kind, nbytes), d in sorted(counts.items())
        ]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


LINKS: dict[str, str] = {
    "a100-nvlink": "a100-40gb",
    "h100-nvlink": "h100",
    "h200-nvlink": "h200",
}
"""Links the emulation knows, as the GPU whose NVLink (and collective kernels) carries them."""


def modelled_durations(
    gpu: str,
    *,
    tp: int,
    scale: float = 1.0,
    bytes_scale: float = 1.0,
    sm_share: int | None = None,
) -> DurationFn:
    """Return each collective's duration as the hardware model prices it on ``gpu`` at ``tp``.

    A collective alone at the GPU's top clock with NCCL's default SM share (that of
    :class:`~kareus.planner.settings.PlannerSettings`), on the GPU's NVLink; times ``scale``
    (the ratio of this device's compute to the modelled GPU's, and any extra factor). The
    input's bytes as this process holds it, times ``bytes_scale`` (0.5: an fp32 run priced
    as the GPU's bf16), are priced as the hardware model prices a collective of that input:
    the all-reduces of a model built with TP 8's per-rank shapes in a group of one are TP
    8's (a sequence-parallel gather there gathers from one rank, not eight).
    """
    from kareus.hardware import Emulator
    from kareus.hardware import gpu as gpu_spec
    from kareus.ir.costs import CollectiveCost, Knobs
    from kareus.planner.settings import PlannerSettings

    spec = gpu_spec(LINKS.get(gpu, gpu))
    emulator = Emulator(spec)
    share = sm_share if sm_share is not None else PlannerSettings().no_overlap_sm_share
    knobs = Knobs(spec.clock_max_mhz, share, launch_slot=None)
    kinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}

    def duration(kind: str, nbytes: int) -> float:
        if kind not in kinds or tp <= 1:
            return 0.0
        coll = CollectiveCost(kind, float(nbytes * bytes_scale), tp)  # type: ignore[arg-type]
        return emulator.collective_time(coll, knobs) * scale

    return duration

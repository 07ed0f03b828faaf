"""Clock controllers: one protocol, backends for real GPUs (Zeus, NVML) and an emulated one.

Vendor errors are translated into :class:`ClockPermissionError` (the process may not change
clocks: the fix is a capability or the ``zeusd`` daemon) or :class:`ClockError`, with the
vendor's error chained. Nothing here is imported by ``import kareus``.
"""

from __future__ import annotations

import collections
import os
from typing import Protocol

from kareus.errors import KareusError

PERMISSION_FIX = (
    "changing GPU clocks needs the SYS_ADMIN capability: run with "
    "`docker run --cap-add SYS_ADMIN`, or as root, or start the Zeus daemon `zeusd` and set "
    "ZEUSD_SOCK_PATH so that Zeus changes clocks on the process's behalf"
)


class ClockError(KareusError, RuntimeError):
    """Setting or resetting a GPU clock failed."""


class ClockPermissionError(ClockError, PermissionError):
    """The process may not change GPU clocks."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{detail}; {PERMISSION_FIX}")


CLOCKS_ENV = "KAREUS_CLOCKS"
"""The process-wide switch: ``KAREUS_CLOCKS=off`` and kareus changes no GPU setting."""

_ON = ("", "on", "1", "yes", "true")
_OFF = ("off", "0", "no", "false")


def clock_changes_allowed() -> bool:
    """Return whether kareus may change a GPU's settings in this process (``KAREUS_CLOCKS``).

    Unset or ``on``: allowed (kareus still changes clocks only where asked: ``clocks=``,
    ``--lock-clocks``, ``--try-switch``). ``off``: never, whatever a call asks, for users of
    shared nodes and for the test suite. Any other value counts as ``off``: a mistyped
    switch must not let clocks change.
    """
    return os.environ.get(CLOCKS_ENV, "").strip().lower() in _ON


def clock_switch_state() -> str:
    """Say in one line what ``KAREUS_CLOCKS`` lets kareus do (``kareus doctor`` shows it)."""
    raw = os.environ.get(CLOCKS_ENV)
    if clock_changes_allowed():
        shown = f"{CLOCKS_ENV}={raw}" if raw else f"{CLOCKS_ENV} unset"
        return f"allowed where asked ({shown}; set {CLOCKS_ENV}=off to forbid them)"
    unknown = raw is not None and raw.strip().lower() not in _OFF
    why = f" ({raw!r} is neither on nor off: read as off)" if unknown else ""
    return f"off: kareus changes no GPU setting in this process ({CLOCKS_ENV}={raw}){why}"


class ClocksOffError(ClockPermissionError):
    """``KAREUS_CLOCKS=off`` forbids changing GPU settings in this process."""

    def __init__(self, detail: str) -> None:
        ClockError.__init__(
            self,
            f"{detail}: {CLOCKS_ENV}={os.environ.get(CLOCKS_ENV)} forbids kareus to change "
            f"any GPU setting in this process; unset it (or {CLOCKS_ENV}=on) to allow it",
        )


def refuse_if_off(detail: str) -> None:
    """Raise :class:`ClocksOffError` when ``KAREUS_CLOCKS`` forbids setting changes.

    Every controller that changes a real GPU calls it before each setter.
    """
    if not clock_changes_allowed():
        raise ClocksOffError(detail)


def journal_name_of(controller: object) -> str:
    """Return how the clock journal names ``controller`` (``journal_name``, else ``name``)."""
    return str(getattr(controller, "journal_name", None) or getattr(controller, "name", ""))


class ClockController(Protocol):
    """Sets and resets the locked SM clock of one GPU.

    ``name`` says which kind of controller it is; ``index`` is the GPU's index for it;
    ``journal_name`` is how the clock journal names it, so that a later process can build
    the same controller (:func:`controller_for`) and restore a clock left locked;
    ``device_key`` names the physical device it controls on this host (None when nothing
    outlives the process), so that two processes controlling one GPU are caught. Real GPUs
    also have ``uuid``, NVML's name of the GPU, the same whatever ``CUDA_VISIBLE_DEVICES``
    and ``CUDA_DEVICE_ORDER`` say (controllers without one need not have it). A controller
    whose clock is no GPU's (emulated ones) sets ``waits_for_gpu = False``: the runtime then
    applies its switches as the host reaches them instead of when a CUDA stream does
    (controllers without the attribute wait). A controller that changes a real GPU calls
    :func:`refuse_if_off` before each setter.
    """

    name: str
    index: int
    journal_name: str
    device_key: str | None

    def supported_clocks(self) -> list[int]:
        """Return the supported SM clocks in MHz."""
        ...

    def set(self, freq_mhz: float) -> None:
        """Lock the SM clock at ``freq_mhz``."""
        ...

    def reset(self) -> None:
        """Return the clock to the driver's default."""
        ...


class ZeusClocks:
    """A real GPU through Zeus (``zeus.device``), which can also go through ``zeusd``."""

    name = "zeus"
    journal_name = "zeus"
    device_key: str | None

    def __init__(self, gpu_index: int | None = None) -> None:
        """``gpu_index`` is a CUDA index (Zeus honours CUDA_VISIBLE_DEVICES like CUDA does).

        Without it, the GPU this process computes on (:func:`local_cuda_index`).
        """
        from zeus.device import get_gpus

        gpu_index = local_cuda_index() if gpu_index is None else gpu_index
        self.index = gpu_index
        self.uuid = cuda_uuid(gpu_index)
        self.device_key = f"gpu:{self.uuid or physical_gpu(gpu_index)}"
        try:
            self._gpus = get_gpus()
        except Exception as err:  # Zeus raises its own init errors without a GPU
            raise ClockError(f"Zeus found no usable GPU: {err}") from err

    def _call(self, what: str, fn: object, *args: object) -> object:
        from zeus.device.gpu.common import ZeusGPUNoPermissionError

        try:
            return fn(self.index, *args)  # type: ignore[operator]
        except ZeusGPUNoPermissionError as err:
            raise ClockPermissionError(f"Zeus may not {what} on GPU {self.index}") from err
        except Exception as err:
            raise ClockError(f"Zeus could not {what} on GPU {self.index}: {err}") from err

    def supported_clocks(self) -> list[int]:
        """Return the supported SM clocks in MHz."""
        return list(self._call("read supported clocks", self._gpus.get_supported_graphics_clocks))  # type: ignore[call-overload]

    def set(self, freq_mhz: float) -> None:
        """Lock the SM clock."""
        refuse_if_off(f"Zeus may not lock the clock of GPU {self.index}")
        f = int(freq_mhz)
        self._call("lock the clock", self._gpus.set_gpu_locked_clocks, f, f)

    def reset(self) -> None:
        """Reset the locked clock."""
        refuse_if_off(f"Zeus may not reset the clock of GPU {self.index}")
        self._call("reset the clock", self._gpus.reset_gpu_locked_clocks)


class NvmlClocks:
    """A real NVIDIA GPU through NVML directly, for when Zeus cannot be used."""

    name = "nvml"
    journal_name = "nvml"
    device_key: str | None

    def __init__(self, gpu_index: int | None = None, *, uuid: str | None = None) -> None:
        """Control the GPU named by ``uuid``, else by ``gpu_index``, else this process's.

        ``uuid`` is NVML's (as the clock journal records it); ``gpu_index`` NVML's index
        (all GPUs of the host, in PCI order, whatever CUDA_VISIBLE_DEVICES says); without
        either, the GPU this process computes on (its UUID as CUDA reports it, else its CUDA
        index mapped through CUDA_VISIBLE_DEVICES).
        """
        import pynvml

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            if uuid is None and gpu_index is None:
                uuid = cuda_uuid(local_cuda_index())
                if uuid is None:
                    ident = physical_gpu(local_cuda_index())
                    uuid, gpu_index = (None, int(ident)) if ident.isdigit() else (ident, None)
            if uuid is not None:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            self.index = int(pynvml.nvmlDeviceGetIndex(self._handle))
            self.uuid = nvml_str(pynvml.nvmlDeviceGetUUID(self._handle))
        except pynvml.NVMLError as err:
            raise ClockError(f"NVML is not usable here: {err}") from err
        self.device_key = f"gpu:{self.uuid}"

    def _call(self, what: str, fn: object, *args: object) -> object:
        nv = self._nvml
        try:
            return fn(self._handle, *args)  # type: ignore[operator]
        except nv.NVMLError as err:
            if getattr(err, "value", None) == nv.NVML_ERROR_NO_PERMISSION:
                raise ClockPermissionError(f"NVML may not {what} on GPU {self.index}") from err
            raise ClockError(f"NVML could not {what} on GPU {self.index}: {err}") from err

    def supported_clocks(self) -> list[int]:
        """Return the supported SM clocks in MHz."""
        nv = self._nvml
        mem = self._call("read memory clocks", nv.nvmlDeviceGetSupportedMemoryClocks)
        return list(self._call("read clocks", nv.nvmlDeviceGetSupportedGraphicsClocks, max(mem)))  # type: ignore[arg-type, call-overload]

    def set(self, freq_mhz: float) -> None:
        """Lock the SM clock."""
        refuse_if_off(f"NVML may not lock the clock of GPU {self.index}")
        f = int(freq_mhz)
        self._call("lock the clock", self._nvml.nvmlDeviceSetGpuLockedClocks, f, f)

    def reset(self) -> None:
        """Reset the locked clock."""
        refuse_if_off(f"NVML may not reset the clock of GPU {self.index}")
        self._call("reset the clock", self._nvml.nvmlDeviceResetGpuLockedClocks)


class EmulatedClocks:
    """An emulated GPU: accepts every switch (or refuses all, to test that path)."""

    name = "emulated"
    journal_name = "emulated"
    index = 0
    device_key: str | None = None
    waits_for_gpu = False  # its clock is no GPU's: nothing to wait for

    def __init__(self, clocks_mhz: list[int] | None = None, *, refuse: bool = False) -> None:
        self._clocks = clocks_mhz or list(range(1410, 209, -15))
        self.refuse = refuse
        self.current: float | None = None
        self.history: collections.deque[float | None] = collections.deque(maxlen=4096)
        """The states the device took, in order (the last 4096): a clock, or None."""

    def supported_clocks(self) -> list[int]:
        """Return the emulated GPU's clocks."""
        return list(self._clocks)

    def set(self, freq_mhz: float) -> None:
        """Record the new clock (or refuse)."""
        if self.refuse:
            raise ClockPermissionError("the emulated GPU refuses clock changes (refuse=True)")
        self.current = freq_mhz
        self.history.append(freq_mhz)

    def reset(self) -> None:
        """Record the reset."""
        if not self.refuse:
            self.current = None
            self.history.append(None)


class DryRunClocks:
    """Wrap a controller and never change anything (for checks on shared GPUs)."""

    name = "dry-run"
    journal_name = "dry-run"
    device_key: str | None = None  # changes nothing: may watch a GPU another process controls

    def __init__(
        self,
        inner: ClockController | None = None,
        *,
        index: int | None = None,
        why: str = "",
    ) -> None:
        """Wrap ``inner``, or stand for the GPU of CUDA index ``index`` (default 0).

        ``why`` says why nothing is changed (shown by ``explain``), when not asked for.
        """
        self.inner = inner
        self.index = inner.index if inner is not None else (index or 0)
        self.why = why

    def supported_clocks(self) -> list[int]:
        """Return the wrapped controller's clocks (reading is allowed)."""
        return self.inner.supported_clocks() if self.inner else []

    def set(self, freq_mhz: float) -> None:
        """Do nothing."""

    def reset(self) -> None:
        """Do nothing."""


class FileClocks:
    """An emulated GPU whose clock lives in a file, so that it outlives the process.

    What a real GPU does: a clock locked by a process that is killed stays locked. Tests use
    it to check that a later run restores it; ``fail_reset`` makes resets fail.
    """

    name = "file"
    index = 0
    device_key: str | None
    waits_for_gpu = False

    def __init__(self, path: str, *, fail_reset: bool = False) -> None:
        import pathlib

        self.path = pathlib.Path(path)
        self.fail_reset = fail_reset
        self.journal_name = f"file:{self.path}"
        self.device_key = f"file:{self.path.resolve()}"

    @property
    def current(self) -> float | None:
        """The locked clock, or None at the default."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        return float(text) if text and text != "default" else None

    def supported_clocks(self) -> list[int]:
        """Return the clocks of an A100."""
        return list(range(1410, 209, -15))

    def set(self, freq_mhz: float) -> None:
        """Lock the clock (write it to the file)."""
        self.path.write_text(f"{freq_mhz:g}\n")

    def reset(self) -> None:
        """Return to the default (or fail, with ``fail_reset``)."""
        if self.fail_reset:
            raise ClockError(f"the file-backed GPU {self.path} refuses resets (fail_reset=True)")
        self.path.write_text("default\n")


def controller_for(journal_name: str, gpu: int, uuid: str | None = None) -> ClockController | None:
    """Build a controller for the GPU a journal record names, or None where kareus cannot.

    A real GPU is found by its UUID through NVML (Zeus's and NVML's locks are the same
    driver setting), whatever this process's CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER
    say; a record without a UUID only by an NVML index ("nvml" records): a "zeus" record's
    index was the CUDA index of a process whose environment is gone. None also for
    controllers whose state died with their process (emulated, dry run) and for kinds
    kareus does not know.

    Raises:
        ClockError: the controller cannot be built here (no GPU, no NVML).
    """
    if journal_name.startswith("file:"):
        return FileClocks(journal_name[len("file:") :])
    if journal_name in ("zeus", "nvml") and uuid:
        return NvmlClocks(uuid=uuid)
    if journal_name == "nvml":
        return NvmlClocks(gpu)
    return None


def local_cuda_index() -> int:
    """Return the CUDA index of the GPU this process computes on.

    The current CUDA device (set it with ``torch.cuda.set_device(LOCAL_RANK)``, as
    distributed jobs do); without CUDA, ``LOCAL_RANK`` (0 when unset).
    """
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def cuda_uuid(cuda_index: int) -> str | None:
    """Return NVML's UUID of CUDA device ``cuda_index`` as CUDA reports it, or None.

    CUDA numbers the visible devices in its own order (CUDA_DEVICE_ORDER), so an index is
    no name outside this process; the UUID is.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # an old torch without .uuid, or no such device
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def nvml_str(value: object) -> str:
    """Return an NVML string as str (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def physical_gpu(cuda_index: int) -> str:
    """Return the host-wide identity of CUDA device ``cuda_index``: NVML index or UUID.

    CUDA numbers only the devices in CUDA_VISIBLE_DEVICES, in its order; NVML numbers all.

    Raises:
        ClockError: CUDA_VISIBLE_DEVICES has no entry ``cuda_index``.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(cuda_index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= cuda_index < len(entries):
        raise ClockError(
            f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}; set "
            "the current device to one of them (torch.cuda.set_device)"
        )
    return entries[cuda_index]


def default_controller() -> ClockController:
    """Return this process's GPU through Zeus, else NVML, else the emulated GPU.

    Under ``KAREUS_CLOCKS=off``, a dry run of that GPU (it reads, never sets).
    """
    for cls in (ZeusClocks, NvmlClocks):
        try:
            found: ClockController = cls()
            break
        except (ClockError, ImportError):
            continue
    else:
        found = EmulatedClocks()
    if not clock_changes_allowed() and not isinstance(found, EmulatedClocks):
        return DryRunClocks(found, why=f"{CLOCKS_ENV}={os.environ.get(CLOCKS_ENV)}")
    return found

"""``kareus doctor``: what this node offers kareus, and what to do where it falls short.

Reads, and changes nothing unless asked: the driver through NVML, Zeus and its daemon, each
GPU (its UUID, CUDA and NVML indices, current and supported SM clocks, power limit), and
whether this process may lock clocks. ``--try-switch`` (explicit) locks each GPU's clock
once, times the call and the clock's transition, and restores it at once — on errors and on
Ctrl-C too — and writes the latencies, labelled measured, as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import time
from typing import Any

from kareus.runtime.clocks import (
    PERMISSION_FIX,
    ClockError,
    NvmlClocks,
    clock_changes_allowed,
    clock_switch_state,
    cuda_uuid,
    nvml_str,
)


@dataclasses.dataclass
class GPUReport:
    """One GPU as NVML and CUDA see it."""

    nvml_index: int
    uuid: str
    name: str
    cuda_index: int | None
    sm_clock_mhz: int | None
    max_sm_clock_mhz: int | None
    supported_mhz: list[int]
    power_limit_w: float | None


@dataclasses.dataclass
class DoctorReport:
    """What ``kareus doctor`` found."""

    driver: str | None
    nvml_error: str | None
    zeus: str | None
    zeusd_socket: str | None
    may_lock: bool
    why: str
    gpus: list[GPUReport]
    switches: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    clock_changes: str = dataclasses.field(default_factory=clock_switch_state)
    """What ``KAREUS_CLOCKS`` lets kareus do in this process."""

    def to_text(self) -> str:
        """Render the report for a person."""
        lines = [f"NVML: {'driver ' + self.driver if self.driver else self.nvml_error}"]
        lines.append(f"clock changes by kareus: {self.clock_changes}")
        lines.append(f"Zeus: {self.zeus or 'not installed (pip install zeus)'}")
        if self.zeusd_socket:
            lines.append(f"Zeus daemon socket: {self.zeusd_socket}")
        if not self.gpus:
            lines.append("no GPU here: kareus plans with its hardware model (modelled figures)")
            return "\n".join(lines)
        for g in self.gpus:
            clocks = (
                f"{len(g.supported_mhz)} SM clocks {min(g.supported_mhz)}-{max(g.supported_mhz)}"
                f" MHz"
                if g.supported_mhz
                else "supported clocks unknown"
            )
            lines.append(
                f"GPU {g.uuid}: {g.name}; NVML index {g.nvml_index}, CUDA index "
                f"{'not visible' if g.cuda_index is None else g.cuda_index}; SM clock now "
                f"{g.sm_clock_mhz} MHz (max {g.max_sm_clock_mhz}); {clocks}; power limit "
                f"{g.power_limit_w} W (read from NVML)"
            )
        lines.append(
            f"may this process lock clocks: {'yes' if self.may_lock else 'no'} ({self.why})"
        )
        for uuid, sw in self.switches.items():
            lines.append(
                f"switch on {uuid}: lock call {sw['lock_call_s'] * 1e3:.2f} ms, clock reached "
                f"{sw['target_mhz']} MHz after {_ms(sw['transition_s'])}, reset call "
                f"{sw['reset_call_s'] * 1e3:.2f} ms (measured)"
            )
        return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "an unknown time (not seen within 1 s)" if value is None else f"{value * 1e3:.1f} ms"


def _permission(nvml_usable: bool, zeusd: str | None) -> tuple[bool, str]:
    if not clock_changes_allowed():
        return False, clock_switch_state()
    if os.geteuid() == 0:
        return True, "running as root"
    if _has_sys_admin():
        return True, "the process has the SYS_ADMIN capability"
    if zeusd:
        return True, f"the Zeus daemon at {zeusd} changes clocks on this process's behalf"
    if not nvml_usable:
        return False, "no usable NVML"
    return False, PERMISSION_FIX


def _has_sys_admin() -> bool:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 21 & 1)
    except (OSError, ValueError):
        pass
    return False


def _cuda_indices() -> dict[str, int]:
    """Map each CUDA-visible GPU's UUID to its CUDA index (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {}
    for i in range(torch.cuda.device_count()):
        uuid = cuda_uuid(i)
        if uuid:
            out[uuid] = i
    return out


def _gpu(nv: Any, index: int, cuda: dict[str, int]) -> GPUReport:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    uuid = nvml_str(nv.nvmlDeviceGetUUID(handle))

    def ask(fn: str, *args: Any) -> Any:
        try:
            return getattr(nv, fn)(handle, *args)
        except nv.NVMLError:
            return None

    mem = ask("nvmlDeviceGetSupportedMemoryClocks") or []
    supported = ask("nvmlDeviceGetSupportedGraphicsClocks", max(mem)) if mem else None
    limit = ask("nvmlDeviceGetPowerManagementLimit")
    return GPUReport(
        index,
        uuid,
        nvml_str(ask("nvmlDeviceGetName") or "?"),
        cuda.get(uuid),
        ask("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM),
        ask("nvmlDeviceGetMaxClockInfo", nv.NVML_CLOCK_SM),
        sorted(supported or [], reverse=True),
        None if limit is None else limit / 1000,
    )


def diagnose() -> DoctorReport:
    """Read what this node offers; change nothing."""
    zeus = None
    if importlib.util.find_spec("zeus") is not None:
        from importlib.metadata import version

        zeus = f"zeus {version('zeus')}"
    sock = os.environ.get("ZEUSD_SOCK_PATH")
    zeusd = sock if sock and pathlib.Path(sock).exists() else None
    try:
        import pynvml as nv

        nv.nvmlInit()
        driver = nvml_str(nv.nvmlSystemGetDriverVersion())
        count = int(nv.nvmlDeviceGetCount())
    except Exception as err:  # no library, no driver, no GPU: all say "no NVML here"
        may, why = _permission(False, zeusd)
        return DoctorReport(None, f"not usable ({err})", zeus, zeusd, may, why, [])
    cuda = _cuda_indices()
    gpus = [_gpu(nv, i, cuda) for i in range(count)]
    may, why = _permission(True, zeusd)
    return DoctorReport(driver, None, zeus, zeusd, may, why, gpus)


def try_switches(report: DoctorReport, settle_s: float = 1.0) -> dict[str, dict[str, Any]]:
    """Lock each GPU's clock once, time it, restore it at once (also on Ctrl-C); return times.

    The target is the supported clock nearest 3/4 of the maximum. A GPU whose clock cannot
    be locked says why.
    """
    out: dict[str, dict[str, Any]] = {}
    for gpu in report.gpus:
        if not gpu.supported_mhz:
            out[gpu.uuid] = {"error": "supported clocks unknown", "source": "measured"}
            continue
        target = min(gpu.supported_mhz, key=lambda f: abs(f - 0.75 * max(gpu.supported_mhz)))
        out[gpu.uuid] = _one_switch(NvmlClocks(uuid=gpu.uuid), target, settle_s)
    return out


def _one_switch(clocks: NvmlClocks, target: int, settle_s: float) -> dict[str, Any]:
    import pynvml as nv

    previous = signal.getsignal(signal.SIGINT)

    def restore_then_stop(signum: int, frame: Any) -> None:
        clocks.reset()  # no lock held here: the controller's calls are plain NVML calls
        signal.signal(signal.SIGINT, previous)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, restore_then_stop)
    try:
        start = time.perf_counter()
        clocks.set(target)
        locked = time.perf_counter()
        reached = None
        while time.perf_counter() - locked < settle_s:
            if nv.nvmlDeviceGetClockInfo(clocks._handle, nv.NVML_CLOCK_SM) == target:
                reached = time.perf_counter() - locked
                break
            time.sleep(0.001)
        before_reset = time.perf_counter()
        clocks.reset()
        done = time.perf_counter()
    except ClockError as err:
        return {"error": str(err), "source": "measured"}
    finally:
        with contextlib.suppress(ClockError):
            clocks.reset()  # whatever happened above: the clock goes back
        signal.signal(signal.SIGINT, previous)
    return {
        "target_mhz": target,
        "lock_call_s": locked - start,
        "transition_s": reached,
        "reset_call_s": done - before_reset,
        "source": "measured",
    }


def switch_cost(path: pathlib.Path) -> Any:
    """Return the clock-change cost measured by ``kareus doctor --try-switch --json path``.

    The slowest GPU's transition (lock call to clock reached), charged whole: an upper bound
    of what a change costs, since the GPU computes through it at the old clock.

    Raises:
        ValueError: the file is not such a report, or measured no switch.
    """
    from kareus.planner.dag import SwitchCost

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--gpu-profile {path}: not a kareus doctor JSON report ({err})") from err
    measured = {
        uuid: sw["lock_call_s"] + sw["transition_s"]
        for uuid, sw in (data.get("switches") or {}).items()
        if isinstance(sw, dict) and sw.get("transition_s") is not None and "lock_call_s" in sw
    }
    if not measured:
        raise ValueError(
            f"--gpu-profile {path}: no clock change measured there; run `kareus doctor "
            "--try-switch --json FILE` on the GPU node (it needs permission to lock clocks)"
        )
    uuid = max(measured, key=lambda u: measured[u])
    return SwitchCost(
        measured[uuid],
        f"measured by kareus doctor --try-switch ({path}): slowest of {len(measured)} GPU(s), "
        f"{uuid}, {measured[uuid] * 1e3:.2f} ms from the lock call to the clock reached, "
        "charged whole",
    )


def write_json(report: DoctorReport, path: pathlib.Path) -> None:
    """Write the report (switch latencies included) as JSON."""
    path.write_text(json.dumps(dataclasses.asdict(report), indent=1) + "\n")

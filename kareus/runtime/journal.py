"""The clock journal: who locked which GPU's clock, so a crashed run's lock can be undone.

Each line is one JSON record, a handful per process and GPU, not one per switch: ``event``
"lock" (the process took the GPU from its default clock; ``freq_mhz`` its first clock),
"restore" (its reset ran), "restore_failed" (with ``error``) or "recovered" (another
process restored it: ``recovered_pid``). A record names the process by ``pid``, its
``start`` time (clock ticks after boot, so a reused pid is not mistaken for it) and the
host's ``boot`` id besides ``host``; the GPU by ``uuid`` (NVML's, which no
``CUDA_VISIBLE_DEVICES`` or ``CUDA_DEVICE_ORDER`` changes) and, for people, ``gpu`` (the
controller's index); and the ``controller`` ("zeus", "nvml", "file:PATH" for the
file-backed emulated GPU, ...). A process killed with SIGKILL cannot restore its clock: the
next run with the same journal (or ``kareus restore-clocks``) finds its lock without a
later restore and, once that process no longer runs, restores it — and says "restored" only
after a reset ran; where no controller can be built for the record it says the clock may
still be locked, which GPU, and the command that restores it.

Journal I/O never stops training: a journal that cannot be written is reported once by the
runtime and then left alone.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
from typing import Any

HOST = socket.gethostname()

LOCK_EVENTS = ("lock", "set", "restore_failed")
"""Events after which a GPU's clock is (or may be) locked ("set": journals before "lock")."""


def _boot_id() -> str:
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """Return when process ``pid`` started (clock ticks after boot), or None if unknown."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


BOOT = _boot_id()


def record(
    path: pathlib.Path,
    event: str,
    *,
    gpu: int,
    controller: str,
    uuid: str | None = None,
    **extra: Any,
) -> None:
    """Append one record (raises OSError when the file cannot be written)."""
    line = {"event": event, "pid": os.getpid(), "host": HOST, "gpu": gpu}
    line.update(start=process_start(os.getpid()), boot=BOOT, controller=controller)
    if uuid:
        line["uuid"] = uuid
    line.update(extra)
    with path.open("a") as fh:  # a file object of its own: safe inside a signal handler
        fh.write(json.dumps(line, sort_keys=True) + "\n")
        fh.flush()


def read(path: pathlib.Path) -> tuple[list[dict[str, Any]], int]:
    """Return the journal's records and how many lines were not records."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return [], 0
    out, bad = [], 0
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(item, dict) and "event" in item:
            out.append(item)
        else:
            bad += 1
    return out, bad


def alive(item: dict[str, Any]) -> bool:
    """Whether the process that wrote ``item`` still runs (on this host).

    Its pid must exist, in this boot, with the start time it recorded: a pid reused by
    another process, or a record from before a reboot, is a process that is gone.
    """
    if item.get("boot") and BOOT and item["boot"] != BOOT:
        return False
    pid = int(item.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return False
    started = item.get("start")
    return started is None or process_start(pid) in (None, started)


def _gpu_key(item: dict[str, Any]) -> tuple[Any, Any, Any]:
    return item.get("host"), item.get("uuid") or item.get("gpu"), item.get("controller")


def open_locks(path: pathlib.Path) -> list[dict[str, Any]]:
    """Return the last record of each (host, GPU, controller) that leaves the clock locked."""
    last: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for item in read(path)[0]:
        last[_gpu_key(item)] = item
    return [item for item in last.values() if item["event"] in LOCK_EVENTS]


def stale_locks(path: pathlib.Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split the open locks into (stale: their process is gone, elsewhere: another host).

    A lock held by a live process on this host (a run still training) is neither.
    """
    stale, elsewhere = [], []
    for item in open_locks(path):
        if item.get("host") != HOST:
            elsewhere.append(item)
        elif item.get("pid") != os.getpid() and not alive(item):
            stale.append(item)
    return stale, elsewhere


def describe_gpu(item: dict[str, Any]) -> str:
    """Name the GPU of a record: its UUID and index where known."""
    uuid, gpu = item.get("uuid"), item.get("gpu")
    return f"GPU {uuid} (index {gpu})" if uuid else f"GPU {gpu}"


def reset_command(item: dict[str, Any]) -> str:
    """Return the command that resets the GPU of a record by hand (as root).

    By UUID where the record has it: nvidia-smi numbers GPUs in PCI order, which is neither
    CUDA's numbering nor CUDA_VISIBLE_DEVICES's.
    """
    return f"nvidia-smi -rgc -i {item.get('uuid') or item.get('gpu')}"


def recover(path: pathlib.Path, own: Any = None) -> list[str]:
    """Restore the clocks that dead processes left locked; return what was done, per GPU.

    Args:
        path: the journal.
        own: this process's controller: used for a record of the same kind and GPU when no
            controller can be rebuilt from the record.

    Each restore is journalled ("recovered", or "restore_failed" with the error), so a
    second call does not try again what succeeded; a lock no controller can reset is
    reported, with its GPU and the command, every time until it is reset.
    """
    messages = []
    _records, bad = read(path)
    if bad:
        messages.append(f"{path}: {bad} line(s) are not clock-journal records and were skipped")
    stale, elsewhere = stale_locks(path)
    for item in stale:
        messages.append(_recover_one(path, item, own))
    for item in elsewhere:
        messages.append(
            f"{describe_gpu(item)} on host {item.get('host')} may still have its clock locked "
            f"by process {item.get('pid')}: run `kareus restore-clocks --journal {path}` on "
            "that host"
        )
    return messages


def _recover_one(path: pathlib.Path, item: dict[str, Any], own: Any) -> str:
    from kareus.runtime.clocks import ClockError, controller_for

    gpu, name = int(item.get("gpu", 0)), str(item.get("controller", ""))
    uuid = item.get("uuid")
    what = (
        f"{describe_gpu(item)} ({name}) was left with its clock locked (first at "
        f"{item.get('freq_mhz')} MHz) by process {item.get('pid')}, which no longer runs"
    )
    by_hand = (
        f"restore it by hand (as root: `{reset_command(item)}`) or with `kareus "
        f"restore-clocks --journal {path}`"
    )
    try:
        controller = controller_for(name, gpu, uuid)
    except (ClockError, OSError) as err:
        return f"{what}; it is NOT restored: no controller for it here ({err}); {by_hand}"
    if controller is None and own is not None and _same_gpu(own, name, uuid):
        controller = own
    ids: dict[str, Any] = {"gpu": gpu, "controller": name, "uuid": uuid}
    if controller is None:
        if name in ("emulated", "dry-run"):
            record(path, "recovered", **ids, recovered_pid=item.get("pid"))
            return f"{what}: nothing to restore (an emulated GPU's clock ended with the process)"
        return f"{what}; it is NOT restored: kareus cannot rebuild a {name!r} controller; {by_hand}"
    try:
        controller.reset()
    except (ClockError, OSError) as err:
        record(path, "restore_failed", **ids, freq_mhz=item.get("freq_mhz"), error=str(err))
        return f"{what}; restoring it failed: {err}. It may still be locked; {by_hand}"
    record(path, "recovered", **ids, recovered_pid=item.get("pid"))
    return f"{what}: restored to the default clock"


def _same_gpu(own: Any, name: str, uuid: str | None) -> bool:
    from kareus.runtime.clocks import journal_name_of

    ours = journal_name_of(own)  # as the run that wrote the record named it
    return ours == name and (uuid is None or getattr(own, "uuid", None) == uuid)


_CLAIMS: dict[str, Any] = {}


def lock_dir() -> pathlib.Path:
    """Where device claims live: ``$KAREUS_LOCK_DIR``, else the temp dir's ``kareus-locks``."""
    import tempfile

    return pathlib.Path(
        os.environ.get("KAREUS_LOCK_DIR") or pathlib.Path(tempfile.gettempdir()) / "kareus-locks"
    )


def claim(device_key: str) -> int | None:
    """Claim ``device_key`` for this process until it exits; return the holder if another.

    The claim is an exclusive ``flock`` on a file named after the device, so it ends with
    the process however it ends. Claiming again from the same process succeeds.

    Returns:
        None when this process holds the claim, else the pid of the process that does.
    """
    import fcntl
    import hashlib

    if device_key in _CLAIMS:
        return None
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha1(device_key.encode()).hexdigest()[:16]
    fh = (directory / f"{name}.lock").open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        text = fh.read().split()
        fh.close()
        return int(text[0]) if text and text[0].isdigit() else -1
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()} {HOST} {device_key}\n")
    fh.flush()
    _CLAIMS[device_key] = fh
    return None


def release(device_key: str) -> None:
    """End this process's claim of ``device_key`` (no-op when it holds none)."""
    fh = _CLAIMS.pop(device_key, None)
    if fh is not None:
        fh.close()  # closing the file drops the flock

"""The clock journal: who locked which GPU's clock, so a crashed run's lock can be undone.

Each line is one JSON record: ``event`` ("set", "restore", "restore_failed" or
"recovered"), ``freq_mhz`` for a set, and the process that wrote it (``pid``, ``host``),
the GPU (``gpu``, its index) and the controller (``controller``: "zeus", "nvml", or
"file:PATH" for the file-backed emulated GPU). A process killed with SIGKILL cannot restore
its clock; the next run with the same journal (or ``kareus restore-clocks``) finds its last
"set" without a later "restore" and, once that process no longer exists, restores it.

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


def record(path: pathlib.Path, event: str, *, gpu: int, controller: str, **extra: Any) -> None:
    """Append one record (raises OSError when the file cannot be written)."""
    line = {"event": event, "pid": os.getpid(), "host": HOST, "gpu": gpu}
    line.update(controller=controller, **extra)
    with path.open("a") as fh:
        fh.write(json.dumps(line, sort_keys=True) + "\n")
        fh.flush()


def read(path: pathlib.Path) -> list[dict[str, Any]]:
    """Return the journal's records (lines that are not records are skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and "event" in item:
            out.append(item)
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_locks(path: pathlib.Path) -> list[dict[str, Any]]:
    """Return the last "set" of each (host, GPU, controller) not followed by a restore."""
    last: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for item in read(path):
        key = (item.get("host"), item.get("gpu"), item.get("controller"))
        last[key] = item
    return [item for item in last.values() if item["event"] in ("set", "restore_failed")]


def stale_locks(path: pathlib.Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split the open locks into (stale: their process is gone, elsewhere: another host).

    A lock held by a live process on this host (a run still training) is neither.
    """
    stale, elsewhere = [], []
    for item in open_locks(path):
        if item.get("host") != HOST:
            elsewhere.append(item)
        elif item.get("pid") != os.getpid() and not alive(int(item.get("pid", -1))):
            stale.append(item)
    return stale, elsewhere


def recover(path: pathlib.Path) -> list[str]:
    """Restore the clocks that dead processes left locked; return what was done, per GPU.

    Each restore is journalled ("recovered", or "restore_failed" with the error), so a
    second call does not try again what succeeded.
    """
    from kareus.runtime.clocks import ClockError, controller_for

    messages = []
    stale, elsewhere = stale_locks(path)
    for item in stale:
        gpu, name = int(item.get("gpu", 0)), str(item.get("controller", ""))
        what = (
            f"GPU {gpu} ({name}) was left locked at {item.get('freq_mhz')} MHz by process "
            f"{item.get('pid')}, which no longer runs"
        )
        try:
            controller = controller_for(name, gpu)
            if controller is not None:
                controller.reset()
        except (ClockError, OSError) as err:
            record(
                path,
                "restore_failed",
                gpu=gpu,
                controller=name,
                freq_mhz=item.get("freq_mhz"),
                error=str(err),
            )
            messages.append(
                f"{what}; restoring it failed: {err}. Restore it by hand (as root: "
                f"`nvidia-smi -rgc -i {gpu}`) or with `kareus restore-clocks --journal {path}`"
            )
            continue
        record(path, "recovered", gpu=gpu, controller=name, recovered_pid=item.get("pid"))
        messages.append(f"{what}: restored to the default clock")
    for item in elsewhere:
        messages.append(
            f"GPU {item.get('gpu')} on host {item.get('host')} may still be locked at "
            f"{item.get('freq_mhz')} MHz by process {item.get('pid')}: run `kareus "
            f"restore-clocks --journal {path}` on that host"
        )
    return messages


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

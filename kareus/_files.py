"""Writing kareus's output files safely: check the directory first, replace files atomically.

A long run (tracing and planning take minutes) must not fail at its end because ``--out``
names a file or an unwritable place, and an interrupted write must not leave half a plan.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Iterator


def check_output_dir(out: str | pathlib.Path, option: str = "--out") -> pathlib.Path:
    """Create ``out`` if needed and check that files can be written there.

    Raises:
        ValueError: ``out`` is a file, cannot be created, or is not writable (the message
            names the option and the path).
    """
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a directory: name a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kareus-check-"):
            pass
    except OSError as err:
        raise ValueError(
            f"{option} {path} cannot be written ({err.strerror or err}): name a directory "
            "you can write to"
        ) from None
    return path


@contextlib.contextmanager
def output_dir(out: str | pathlib.Path, option: str = "--out") -> Iterator[pathlib.Path]:
    """Check ``out`` as :func:`check_output_dir` does, for the length of a command.

    A directory this made is removed again if the command fails before writing into it.
    """
    made = not pathlib.Path(out).exists()
    path = check_output_dir(out, option)
    try:
        yield path
    except BaseException:
        if made and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise


@contextlib.contextmanager
def atomic_path(path: str | pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` at once.

    The file gets the permissions a plain ``open`` would give it (``0666`` less the umask),
    not ``mkstemp``'s private ``0600``: plans and reports are read by others.
    """
    final = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=final.suffix)
    os.close(fd)
    try:
        yield pathlib.Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _umask() -> int:
    """Return the process's umask, read without changing it where Linux tells it."""
    with contextlib.suppress(OSError, ValueError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere, reading it sets it: set it back at once
    os.umask(mask)
    return mask


def write_text(path: str | pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the old file or the new one)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)

"""Validate kareus's files (plans, partition sets) on load, against the dataclasses they hold.

The schema is the dataclasses themselves: pydantic checks a file's JSON against their
annotations (strictly: no string where a number belongs) and builds them, so a malformed
file fails on load with every wrong field named, never later (at the first forward) and
never with a Python-internal message.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from kareus.errors import FileFormatError


@functools.cache
def _adapter(kind: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(kind)


def read_text(path: str | pathlib.Path, what: str) -> str:
    """Return the file's text, or raise :class:`FileFormatError` saying why it cannot be read."""
    try:
        return pathlib.Path(path).read_text()
    except OSError as err:
        raise FileFormatError(f"cannot read the {what} {path}: {err.strerror or err}") from err


def parse(kind: Any, text: str, source: str, what: str) -> Any:
    """Validate JSON ``text`` against ``kind`` (a dataclass or type) and build it.

    Args:
        kind: the type the file holds.
        text: the file's text.
        source: where it came from (a path), for the message.
        what: what the file is ("kareus plan"), for the message.

    Raises:
        FileFormatError: naming the file and, per wrong field, its path, what was expected
            and what was found.
    """
    from pydantic import ValidationError

    try:
        return _adapter(kind).validate_json(text, strict=True)
    except ValidationError as err:
        problems = []
        for e in err.errors()[:5]:
            field = _field(e["loc"]) or "the top level"
            if e["type"] == "json_invalid":
                problems.append(f"it is not valid JSON ({e['ctx'].get('error', e['msg'])})")
                continue
            found = e.get("input")
            shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
            shown = shown if len(shown) < 60 else shown[:57] + "..."
            problems.append(f"{field}: {e['msg'].lower()} (found {shown})")
        more = err.error_count() - len(problems)
        tail = f"; and {more} more" if more > 0 else ""
        raise FileFormatError(
            f"{source} is not a valid {what}: " + "; ".join(problems) + tail
        ) from None


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part).startswith("function-"):
            continue  # pydantic's union branch names
        else:
            out += ("." if out else "") + str(part)
    return out

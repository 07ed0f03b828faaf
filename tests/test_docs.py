"""The README and docs/ name only modules, files and attributes that exist.

Every dotted ``kareus.…`` name resolves (imported, then its attributes looked up), and every
file named in backticks (``passes/census.py``, ``tests/test_moe.py``) is in the repository:
a module moved or renamed without its docs fails here.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bkareus(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FILE = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py)`")


def _texts():
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in DOCS}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _exists(path: str) -> bool:
    if "/" in path:
        return any((base / path).is_file() for base in (ROOT, ROOT / "kareus"))
    return any(ROOT.rglob(path)) if not path.startswith(".") else True


def _named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted(
        {(doc, m.group(1) if m.groups() else m.group(0)) for doc, text in _texts().items()
         for m in pattern.finditer(text)}
    )  # fmt: skip


def test_every_kareus_name_in_the_docs_resolves():
    names = _named(DOTTED)
    assert len(names) > 20  # the docs do name kareus's modules
    missing = [(doc, n) for doc, n in names if not _resolves(n.rstrip("."))]
    assert missing == [], missing


def test_every_file_the_docs_name_exists():
    files = _named(FILE)
    assert len(files) > 50
    missing = [(doc, f) for doc, f in files if not _exists(f)]
    assert missing == [], missing


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("kareus.planner.compose.Composer", True),
        ("kareus.planner.nowhere", False),
        ("kareus.planner.compose.Nothing", False),
    ],
)
def test_the_resolver_can_say_no(name, found):
    assert _resolves(name) is found

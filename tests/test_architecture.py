"""The boundaries of the design: planner free of fx, passes free of ortools, runtime tiny."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kareus"


def imports(package: str) -> dict[str, set[str]]:
    out = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[path.name] = names
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("planner", ("torch.fx", "kareus.passes", "torch")),
        ("passes", ("ortools", "kareus.planner")),
        ("runtime", ("torch.fx", "ortools", "kareus.planner", "kareus.passes")),
        ("hardware", ("torch", "ortools", "kareus.passes")),
    ],
)
def test_package_boundaries(package, forbidden):
    found = imports(package)
    assert found, package
    for module, names in found.items():
        bad = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        assert not bad, f"kareus/{package}/{module} imports {bad}"

"""The rules of the architecture (docs/architecture.md), checked on the source.

The boxes of the design are packages, and what each may import is fixed: the planner is free
of torch.fx, the runtime is tiny, the passes never reach the solver, the file formats import
no graph code. Modules have names that do not collide, no import circle, and functions a
reader can hold in mind.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kareus"

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350
MAX_LOOSE_MODULES = 10


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: pathlib.Path, *, typing: bool = False) -> set[str]:
    """Every module ``path`` imports at run time (top level or in a function).

    Imports under ``if TYPE_CHECKING:`` are left out (they never run) unless ``typing``: a
    type named from a floor above is an arrow climbing back all the same.
    """
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not typing:
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            # "from kareus.passes import pipeline" imports the module kareus.passes.pipeline
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _package_imports(package: str) -> dict[str, set[str]]:
    return {
        name: _imports(path, typing=True)
        for name, path in _sources().items()
        if name == f"kareus.{package}" or name.startswith(f"kareus.{package}.")
    }


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("planner", ("torch", "kareus.passes", "kareus.compiler", "kareus.jobs")),
        ("passes", ("ortools", "kareus.planner", "kareus.jobs", "kareus.compiler")),
        ("runtime", ("torch.fx", "ortools", "kareus.planner", "kareus.passes", "kareus.jobs")),
        ("hardware", ("torch", "ortools", "kareus.passes", "kareus.compiler", "kareus.jobs")),
        (
            "ir",
            (
                "torch.fx",
                "ortools",
                "kareus.passes",
                "kareus.planner",
                "kareus.compiler",
                "kareus.hardware",
                "kareus.runtime",
                "kareus.jobs",
            ),
        ),
        ("compiler", ("ortools", "kareus.jobs")),
    ],
)
def test_package_boundaries(package, forbidden):
    found = _package_imports(package)
    assert found, package
    for module, names in found.items():
        bad = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        assert not bad, f"{module} imports {bad}"


def test_the_runtime_and_the_config_import_nothing_heavy():
    # What runs inside a training step, and what validating a Config reaches.
    heavy = ("torch.fx", "ortools", "networkx", "matplotlib", "scipy", "kareus.passes.pipeline")
    for module in ("kareus.runtime.switcher", "kareus.runtime.clocks", "kareus.passes.names"):
        names = _imports(_sources()[module])
        assert not [n for n in names if n.startswith(heavy)], (module, names)


def _kareus_graph(*, typing: bool = False) -> dict[str, set[str]]:
    sources = _sources()
    graph = {}
    for name, path in sources.items():
        graph[name] = {n for n in _imports(path, typing=typing) if n in sources and n != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_modules():
    # Every run-time import counts, in functions too, packages' own __init__ included (the
    # old config <-> passes and compose <-> relax circles are found by this on the old tree).
    assert _cycles(_kareus_graph()) == []
    # nor by the names a module imports for its types only (``if TYPE_CHECKING:``): a type
    # named from a module that imports this one is the same circle, hidden
    assert _cycles(_kareus_graph(typing=True)) == []


def test_the_cycle_finder_finds_a_circle():
    # The check above can fail: a two-module circle is found, a chain is not.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_functions_fit_in_a_readers_mind():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_module_name(path)}.{node.name}: {lines} lines")
    assert long == []


def test_modules_and_classes_are_rooms_not_halls():
    big = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{_module_name(path)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{_module_name(path)}.{node.name}: {lines} lines")
    assert big == []


def _module_names() -> list[str]:
    """The last part of every module and package name under kareus/."""
    return sorted({name.rsplit(".", 1)[-1] for name in _sources()})


def _colliding(names: list[str]) -> list[tuple[str, str]]:
    """Pairs whose names differ only by a suffix ("plan", "planning", "planner")."""
    return [
        (a, b)
        for a in names
        for b in names
        if a != b and b.startswith(a) and re.match(r"[a-z]", b[len(a)])
    ]


def test_no_two_modules_differ_only_by_a_suffix():
    assert _colliding(_module_names()) == []
    assert _colliding(["plan", "planner", "plan_file", "planning"]) == [
        ("plan", "planner"),
        ("plan", "planning"),
    ]


def test_no_module_is_named_like_its_folder():
    same = [n for n in _sources() if n.count(".") >= 2 and n.split(".")[-1] == n.split(".")[-2]]
    assert same == []


def test_few_modules_lie_loose_at_the_top():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_each_box_of_the_design_is_a_package():
    for box in ("compiler", "passes", "ir", "planner", "hardware", "runtime", "jobs", "models"):
        assert (ROOT / box / "__init__.py").is_file(), box


def test_kareus_explain_is_the_function():
    # A submodule import would set its parent's attribute: no module kareus.explain may
    # shadow the function kareus.explain.
    import types

    import kareus

    assert callable(kareus.explain) and not isinstance(kareus.explain, types.ModuleType)
    assert kareus.explain.__module__ == "kareus.compiler.explain"


def _strings_outside_docstrings(tree: ast.AST) -> list[str]:
    docs = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_collectives_are_classified_in_one_place():
    """Only kareus.passes.census names the functional collectives' ops (its classifier is
    what every pass, the lowering and the test helpers ask): no other module compares an
    op's name with a collective's or a wait's (the cost model's kinds, ``all_reduce`` and
    the like, are its vocabulary, not op names)."""
    names = re.compile(
        r"\b(_c10d_functional\w*|wait_tensor|all_reduce_|all_reduce_coalesced\w*|"
        r"all_gather_into_tensor\w*|reduce_scatter_tensor\w*|all_to_all_single)\b"
    )
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "census.py":
            continue
        tree = ast.parse(path.read_text())
        found += [
            f"{path.relative_to(ROOT)}: {s!r}"
            for s in _strings_outside_docstrings(tree)
            if names.search(s)
        ]
    assert not found, found


PUBLIC_DYNAMO = {"mark_dynamic", "maybe_mark_dynamic", "mark_static", "reset", "config"}
"""``torch._dynamo`` names documented for users (torch.compiler's troubleshooting pages)."""

OWN_INTERNAL = {
    "runtime/switcher.py": "torch._C._current_graph_task_id",  # the runtime imports no torch.fx
}
"""Private names read outside ``_torch_internals.py``, each with why it stays there."""


def _private_torch(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each ``torch._*`` import and outermost ``torch._*`` attribute chain."""
    found, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append((node.lineno, str(node.module)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("torch._")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                name = ".".join(["torch", *reversed(parts)])
                if parts[-1].startswith("_") and not parts[-1].startswith("__"):
                    found.append((node.lineno, name))
    return found


def test_private_torch_internals_are_read_in_one_module():
    """kareus reads PyTorch's private names (``torch._inductor``, ``torch._ops``, ...) in
    ``kareus/_torch_internals.py`` only, where each has its fallback and a PyTorch upgrade
    breaks one file; Dynamo's documented ``mark_dynamic``/``reset``/``config`` and
    ``torch._check`` are public in all but name."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where == "_torch_internals.py":
            continue
        for line, name in _private_torch(ast.parse(path.read_text())):
            parts = name.split(".")
            if name == "torch._check" or (
                parts[1] == "_dynamo" and parts[2:3] and parts[2] in PUBLIC_DYNAMO
            ):
                continue
            if name == "torch._dynamo" or OWN_INTERNAL.get(where) == name:
                continue  # (``import torch._dynamo`` to reach the public names)
            bad.append(f"{where}:{line}: {name}")
    assert not bad, bad

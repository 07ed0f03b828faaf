"""Old import paths of modules that moved when the package took the architecture's shape.

``import kareus.api`` (and the other paths below) still works for one release and warns with
the new path; the module object is the moved one, so patches and ``isinstance`` agree.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    "kareus.api": "kareus.compiler.backend",
    "kareus.config": "kareus.compiler.config",
    "kareus.region": "kareus.compiler.region",
    "kareus.explain": "kareus.compiler.explain",
    "kareus.plan": "kareus.ir.plan_file",
    "kareus.partitions": "kareus.ir.partitions",
    "kareus.costs": "kareus.ir.costs",
    "kareus.schema": "kareus.ir.schema",
    "kareus.planning": "kareus.jobs.workload",
    "kareus.trace": "kareus.jobs.trace",
    "kareus.profile": "kareus.jobs.profile",
    "kareus.evaluate": "kareus.jobs.evaluate",
    "kareus.parallel": "kareus.models.parallel",
    "kareus.planner.planner": "kareus.planner.iteration",
    "kareus.planner.profiler": "kareus.planner.measured",
}
"""Old module path -> where it lives now (moved in kareus 0.1; the old paths go in 0.2)."""


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there (the old path goes in "
            "kareus 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Run nothing: the moved module ran when it was imported under its new path."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


class _Package(ModuleType):
    """The ``kareus`` package, whose public functions an old module path cannot shadow.

    Importing a submodule sets it as an attribute of its parent: ``import kareus.explain``
    (the old module path) would replace the function ``kareus.explain`` with the module.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        current = self.__dict__.get(name)
        if isinstance(value, ModuleType) and callable(current):
            return  # kareus.explain stays the function; the module is in sys.modules
        super().__setattr__(name, value)


def install() -> None:
    """Serve the old paths (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    sys.modules["kareus"].__class__ = _Package

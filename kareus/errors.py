"""The one exception hierarchy of kareus.

Every message says what failed, on what (field and value, node, pass) and how to fix it.
Errors that are also ordinary Python errors (a bad value, misuse of an API) inherit from the
matching built-in too, so ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence


class KareusError(Exception):
    """Base class of every error kareus raises on purpose."""


class ConfigError(KareusError, ValueError):
    """A configuration field has a value kareus cannot use."""

    def __init__(self, field: str, value: object, allowed: str, *, owner: str = "Config.") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{owner}{field}={value!r} is not allowed: expected {allowed}.")


class FileFormatError(KareusError, ValueError):
    """A kareus file (plan, partitions) cannot be read, is not JSON, or breaks its schema."""


class PlanMismatchError(KareusError, ValueError):
    """A plan was made for another workload (or stage) than the model it is applied to."""


class NotCompiledError(KareusError, TypeError):
    """An object that kareus did not compile was handed to a kareus inspection function."""


class NotYetCapturedError(KareusError, RuntimeError):
    """A compiled model was inspected before its first call captured any graph."""


class PassError(KareusError, RuntimeError):
    """A graph pass failed; names the pass, the graph, the node and the passes already run."""

    def __init__(
        self,
        pass_name: str,
        graph: str,
        message: str,
        *,
        node: str | None = None,
        passes_run: Sequence[str] = (),
    ) -> None:
        self.pass_name = pass_name
        self.graph = graph
        self.node = node
        self.passes_run = tuple(passes_run)
        self.detail = message
        where = f" at node {node!r}" if node else ""
        before = ", ".join(self.passes_run) if self.passes_run else "none"
        super().__init__(
            f"pass {pass_name!r} failed on the {graph} graph{where}: {message} "
            f"(passes already run on this graph: {before}). Set Config.strict=False to run "
            f"the model without kareus's rewrites, or disable the pass with "
            f"disable_passes=({pass_name!r},)."
        )


class NodeError(KareusError):
    """Raised inside a pass about one node; the pass runner turns it into a :class:`PassError`."""

    def __init__(self, node: object, message: str) -> None:
        self.node = str(getattr(node, "name", node))
        self.message = message
        super().__init__(f"{self.node}: {message}")

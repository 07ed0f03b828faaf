"""The one exception hierarchy of kareus.

Every message says what failed, on what (field and value, node, pass) and how to fix it.
Errors that are also ordinary Python errors (a bad value, misuse of an API) inherit from the
matching built-in too, so ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence


class KareusError(Exception):
    """Base class of every error kareus raises on purpose.

    Attributes:
        one_line: its message says all a user needs (what differs and the command that
            fixes it): left uncaught, it ends the program with that one line, without a
            traceback (``KAREUS_TRACEBACK=1`` shows it).
    """

    one_line = False


class ConfigError(KareusError, ValueError):
    """A configuration field has a value kareus cannot use."""

    def __init__(self, field: str, value: object, allowed: str, *, owner: str = "Config.") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{owner}{field}={value!r} is not allowed: expected {allowed}.")


class FileFormatError(KareusError, ValueError):
    """A kareus file (plan, partitions) cannot be read, is not JSON, or breaks its schema."""


class SourceError(KareusError, ValueError):
    """A model source (``--hf-config``, ``--factory``) cannot be used as given."""


class PlanMismatchError(KareusError, ValueError):
    """A plan was made for another workload (or stage) than the model it is applied to."""

    one_line = True


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


TRACEBACK_ENV = "KAREUS_TRACEBACK"
"""Set to 1 to see the traceback of an uncaught one-line kareus error."""


def install_excepthook() -> None:
    """End the program on an uncaught one-line kareus error with its message alone.

    One line on stderr, exit status 1, instead of a traceback through Dynamo and the model
    per rank (``torch.distributed`` prefixes each line with ``[rankN]:``); any other
    exception goes to the hook that was installed before. Installed once, when kareus is
    imported.
    """
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_kareus", False):
        return

    def hook(kind: type[BaseException], error: BaseException, tb: object) -> None:
        one_line = isinstance(error, KareusError) and error.one_line
        if not one_line or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            previous(kind, error, tb)  # type: ignore[arg-type]
            return
        text = " ".join(str(error).split())
        hint = f"{TRACEBACK_ENV}=1 shows the traceback"
        print(f"kareus: {kind.__name__}: {text} ({hint})", file=sys.stderr)

    hook._kareus = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class TraceError(KareusError, RuntimeError):
    """Tracing a configuration failed, or its graphs had no partitions to plan."""

"""kareus broken on purpose, one way at a time, to show that the tests see its effects.

``KAREUS_BREAK=split`` keeps the split pass's record but leaves the graph whole; ``clocks``
keeps the clock runtime's records but sets no clock; ``overlap`` keeps the schedule's
decisions but leaves the graph's order; ``serial`` keeps the rewritten graphs but runs them
(on the python codegen) waiting on each collective right after its launch, so the graph's
order claims an overlap that never happens. The test suite applies it in its own process
(``tests/conftest.py``) and :func:`kareus.testing.run_ranks` in every rank it starts, so a
multi-rank test is broken the same way; ``benchmarks/break_kareus.py`` runs the suite under
each break and lists the tests that caught it.
"""

from __future__ import annotations

import os

BREAK_ENV = "KAREUS_BREAK"
"""The environment variable naming the break (one of :data:`BREAKS`; unset: none)."""

BREAKS = ("split", "clocks", "overlap", "serial")


def break_kareus(how: str | None = None) -> str:
    """Break kareus as ``how`` (default: ``$KAREUS_BREAK``) says, in this process; return it.

    Raises:
        ValueError: an unknown break.
    """
    how = os.environ.get(BREAK_ENV, "") if how is None else how
    if how == "split":
        from kareus.compiler.lowering import copy_module
        from kareus.passes.base import PassResult
        from kareus.passes.split_nanobatches import SplitNanobatches

        decide = SplitNanobatches.run
        if getattr(decide, "broken", False):
            return how

        def records_only(self, gm, ctx):  # type: ignore[no-untyped-def]
            decide(self, copy_module(gm), ctx)  # its record of what it split is kept
            return PassResult(gm, modified=False)

        records_only.broken = True  # type: ignore[attr-defined]
        SplitNanobatches.run = records_only  # type: ignore[method-assign]
    elif how == "clocks":
        from kareus.runtime.safety import ClockHold

        ClockHold.set = lambda self, freq: None  # type: ignore[method-assign,assignment]
    elif how == "overlap":
        from kareus.passes import schedule_overlap

        schedule_overlap.rewrite_schedule = lambda *args, **kwargs: False  # type: ignore[assignment]
    elif how == "serial":
        _run_serially()
    elif how:
        raise ValueError(f"{BREAK_ENV}={how!r}: one of {', '.join(BREAKS)}")
    return how


def _run_serially() -> None:
    """Run the python codegen's graphs node by node, waiting on each collective at once."""
    import torch.fx as fx

    from kareus.compiler.backend import KareusBackend
    from kareus.passes.census import collective_kind, wait_now

    passes = KareusBackend._run_graph_passes
    if getattr(passes, "broken", False):
        return

    class Serial(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if collective_kind(n) is not None:
                wait_now(out)  # the graph's own wait, later, finds nothing left to wait on
            return out

    def serially(self, region, kind, gm, example_inputs):  # type: ignore[no-untyped-def]
        out = passes(self, region, kind, gm, example_inputs)
        if kind not in ("forward", "backward") or self.config.codegen != "python":
            return out
        return lambda *args: Serial(out).run(*args)

    serially.broken = True  # type: ignore[attr-defined]
    KareusBackend._run_graph_passes = serially  # type: ignore[method-assign]

"""Plain-text tables, rendered with rich without colour so they read well in logs."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence


def render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Return ``rows`` as a boxed text table with ``columns`` as headers."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None, force_terminal=False).print(table)
    return buf.getvalue().rstrip()


def fig(value: float, digits: int = 5) -> str:
    """Format a time or an energy with ``digits`` significant digits (no exponent).

    ``0.000461`` stays ``0.000461``, not ``0.0005`` (tiny workloads are not all equal);
    ``1234.567`` is ``1234.6``; a figure of more digits keeps them (``123457``).
    """
    if value == 0 or abs(value) >= 10**digits:
        return f"{value:.0f}"
    text = f"{value:.{digits}g}"
    if "e" in text:  # .5g writes small numbers with an exponent
        decimals = digits - 1 - int(f"{value:e}".split("e")[1])
        text = f"{value:.{max(decimals, 0)}f}".rstrip("0").rstrip(".")
    return text

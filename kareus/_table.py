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

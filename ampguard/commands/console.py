"""Output meant for a person at a terminal: rich tables there, plain text elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], stream: TextIO | None = None
) -> None:
    stream = stream or sys.stdout
    if stream.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(str(cell) for cell in row))
        Console(file=stream).print(table)
        return
    cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    stream.write(f"{title}\n")
    for index, row in enumerate(cells):
        stream.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n")
        if index == 0:
            stream.write("  ".join("-" * width for width in widths) + "\n")

"""Plain-text tables and sizes, as the commands print them."""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


def table(header: list[str], rows: list[list[Any]]) -> str:
    """``rows`` under ``header``, aligned: the first column left, the others right."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def size(value: float) -> str:
    """A number of bytes in GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g} B"

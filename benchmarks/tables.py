"""Markdown tables for the benchmarks' reports."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """The lines of a markdown table: a header, the alignment row, then one line per row (cells as ``str``).

    ``align`` has one letter per column: ``l`` (left, ``---``) or ``r`` (right, ``---:``); missing letters
    mean left.
    """
    if any(a not in "lr" for a in align) or len(align) > len(headers):
        raise ValueError(f"align must be at most {len(headers)} letters l or r, got {align!r}")
    marks = "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(headers), "l"))
    return [_line(headers), "|" + marks, *(_line(row) for row in rows)]


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"

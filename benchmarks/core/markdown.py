"""Markdown cells and tables of measured figures (``n/a`` where a figure is missing), and the line that says where."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.core.figures import finite, median_and_range

NA = "n/a"


def num(value: Any, digits: int | None = 2) -> str:
    """A number with ``digits`` decimals (``None``: 3 significant digits), ``n/a`` where missing."""
    if finite(value) is None:
        return NA
    return f"{value:.3g}" if digits is None else f"{value:.{digits}f}"


def times(value: float | None, digits: int = 2) -> str:
    """A speed ratio: ``2.26x``."""
    return NA if value is None else f"{value:.{digits}f}x"


def rounds_ratio(ratios: Sequence[float], digits: int = 2, bold_from: float | None = None) -> str:
    """The median of per-round speed ratios with their range: ``1.21x (1.09-1.53x)``; bold from ``bold_from`` on.

    One round, or rounds that agree to ``digits``, show no range.

    Example:
        >>> rounds_ratio([1.09, 1.53, 1.21, 1.46, 1.12])
        '1.21x (1.09-1.53x)'
    """
    found = median_and_range(ratios)
    if found is None:
        return NA
    median, low, high = found
    text = times(median, digits)
    if bold_from is not None and median >= bold_from:
        text = f"**{text}**"
    shown = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return text if shown[0] == shown[1] else f"{text} ({shown[0]}-{shown[1]}x)"


def cell(text: Any, limit: int = 200) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text or "").replace("|", "/").replace("\n", " ")[:limit]


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column (``l`` left, ``r`` right; default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)]) + "\n"


def by_variant(results: Sequence[dict[str, Any]], batch: int | None = None) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in results if batch is None or r.get("batch_size") == batch}


def env_line(record: dict[str, Any]) -> str:
    env = record.get("environment") or {}
    if "device_name" in record:  # the zoo's header
        env = {"gpu": record["device_name"], **record.get("versions", {}), "date": record.get("date")}
    return (
        f"<sub>{env.get('gpu', 'unknown GPU')}, torch {env.get('torch', NA)}, lightning {env.get('lightning', NA)},"
        f" {env.get('date', NA)}; `{record['file']}`; measured by `{env.get('command') or record.get('command', NA)}`"
        "</sub>\n"
    )

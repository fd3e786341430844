"""The zoo's results as Markdown: one summary line, and one row per entry with a cell per package variant."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.core.markdown import by_variant, cell, env_line, table, times

#: Classes that break the package's promise (the zoo's exit code is 1 when a run has one of them).
FAILURES = ("graphs-WRONG", "eager-SILENT", "state-WRONG", "error")


def zoo_summary(record: dict[str, Any]) -> str:
    """One line: the zoo's runs by class, the range of speedups on graphs, and every run that broke the promise."""
    runs = [(e["entry"], run) for e in record["entries"] for run in e.get("runs", [])]
    counts = Counter(run["class"] for _, run in runs)
    speedups = [run["speedup"] for _, run in runs if run["class"] == "graphs-ok" and run.get("speedup")]
    broken = [f"{entry} through {run['label']} ({run['class']}, off: {', '.join(run['off'])})"
              for entry, run in runs if run["class"] in FAILURES]  # fmt: skip
    spread = f" at {min(speedups):.2f}-{max(speedups):.2f}x eager" if speedups else ""
    line = (
        f"Model zoo: {len(record['entries'])} real models and training patterns, {len(runs)} runs against eager"
        f" Lightning: {counts['graphs-ok']} on graphs and equal to eager{spread}, {counts['eager-with-reason']} eager"
        f" with the reason reported, {counts['refused']} refused before training"
    )
    line += f"; off eager: {'; '.join(broken)}." if broken else "; none off eager."
    return f"{line} Source: `{record['file']}`."


def zoo_cell(run: dict[str, Any] | None) -> str:
    """A zoo run's class (bold where it broke the promise) and its speedup."""
    if run is None:
        return ""
    mark = "**" if run["class"] in FAILURES else ""
    return f"{mark}{run['class']}{mark} {times(run.get('speedup'))}"


def zoo_section(record: dict[str, Any]) -> str:
    """``zoo/run.py``: one row per entry, one cell per package variant (class and speedup)."""
    labels = {run["variant"]: run["label"] for entry in record["entries"] for run in entry.get("runs", [])}
    rows = []
    for entry in record["entries"]:
        found = by_variant(entry.get("runs", []))
        rows.append(
            [
                cell(entry["patterns"], 80),
                *("skipped" if "skipped" in entry else zoo_cell(found.get(v)) for v in labels),
            ]
        )
    header = ["entry", *(f"`{text}`" for text in labels.values())]
    return f"{zoo_summary(record)}\n\n{table(header, rows, 'l' * len(header))}\n{env_line(record)}"

"""Figures from measurements: quantiles, speed ratios, per-round ratios of alternated rounds, loss parity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def finite(value: Any) -> float | None:
    """``value`` where it is a finite number, else ``None`` (strict JSON has no NaN).

    Example:
        >>> finite(float("nan")), finite(2)
        (None, 2)
    """
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation (``nan`` for no values).

    Example:
        >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5)
        2.5
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(step_ms: Sequence[float]) -> dict[str, Any]:
    """Median, p25 and p75 of step times, and how many were timed, JSON-ready."""
    return {
        "median_ms": finite(quantile(step_ms, 0.5)),
        "p25_ms": finite(quantile(step_ms, 0.25)),
        "p75_ms": finite(quantile(step_ms, 0.75)),
        "steps_timed": len(step_ms),
    }


def ratio(reference_ms: float | None, ms: float | None) -> float | None:
    """How much faster ``ms`` is than the reference (``reference_ms / ms``), or ``None`` where one is missing.

    Example:
        >>> ratio(10.0, 4.0), ratio(None, 4.0)
        (2.5, None)
    """
    if finite(reference_ms) is None or finite(ms) is None or ms <= 0:  # type: ignore[operator]
        return None
    return reference_ms / ms  # type: ignore[operator]


def round_ratios(reference_ms: Sequence[float | None], ms: Sequence[float | None]) -> list[float]:
    """The speed ratio of each alternated round: round i of the reference over round i of the variant.

    A reader compares the two fits of one round, which ran side by side; rounds where either is missing are left out.

    Example:
        >>> round_ratios([10.0, 12.0, None], [5.0, 4.0, 3.0])
        [2.0, 3.0]
    """
    return [r for a, b in zip(reference_ms, ms, strict=False) if (r := ratio(a, b)) is not None]


def median_and_range(values: Sequence[float]) -> tuple[float, float, float] | None:
    """The median of per-round figures, with the smallest and the largest (``None`` for no values).

    Example:
        >>> median_and_range([1.09, 1.53, 1.21, 1.46, 1.12])
        (1.21, 1.09, 1.53)
    """
    if not values:
        return None
    return quantile(values, 0.5), min(values), max(values)


def least(fits: Sequence[dict[str, Any]], figure: str) -> dict[str, Any]:
    """The fit with the least ``figure`` among those that have it (the first fit where none has).

    Example:
        >>> least([{"ms": None}, {"ms": 2.0}, {"ms": 1.5}], "ms")
        {'ms': 1.5}
    """
    measured = [fit for fit in fits if fit.get(figure) is not None]
    return min(measured, key=lambda fit: fit[figure]) if measured else fits[0]


def fastest_round(fits: Sequence[dict[str, Any]], cold: Sequence[str] = ()) -> dict[str, Any]:
    """A variant's fastest fit, with every round's median; the ``cold`` figures come from the first fit.

    Host-bound step times differ between fits of the same graphs by a third or more, in stretches: each variant
    counts at its fastest of alternated rounds, and every round's median is kept beside it.

    Example:
        >>> fastest_round([{"median_ms": 3.0, "compile_s": 9.0}, {"median_ms": 2.0, "compile_s": 1.0}], ["compile_s"])
        {'median_ms': 2.0, 'compile_s': 9.0, 'round_ms': [3.0, 2.0]}
    """
    first = {key: fits[0][key] for key in cold if key in fits[0]}
    return {**least(fits, "median_ms"), **first, "round_ms": [fit.get("median_ms") for fit in fits]}


def max_abs_diff(reference: Sequence[float], other: Sequence[float]) -> float | None:
    """The largest per-step difference over the steps both runs have (``None`` where either has none).

    Example:
        >>> max_abs_diff([1.0, 2.0], [1.5, 2.0, 9.0])
        0.5
    """
    return max((abs(a - b) for a, b in zip(reference, other, strict=False)), default=None)


def add_relative(results: list[dict[str, Any]], losses: dict[str, list[float]], baseline: str = "eager") -> None:
    """Add each result's ``speedup`` over ``baseline`` and its loss parity against it, in place."""
    base = next((r for r in results if r["variant"] == baseline), {})
    for result in results:
        result["speedup"] = ratio(base.get("median_ms"), result.get("median_ms"))
        result["loss_max_abs_diff"] = max_abs_diff(losses.get(baseline, []), losses.get(result["variant"], []))

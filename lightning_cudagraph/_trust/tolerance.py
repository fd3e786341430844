"""How far a graph may be from eager: one table for every check, by what is compared and the fit's precision.

Run-to-run noise of the same kernels is orders of magnitude below each figure, while a wrong batch, a frozen value
or stale storage moves a result by about its own size. Reduced precision rounds more, compiled kernels reorder sums,
and FP8 rounds most.
"""

from __future__ import annotations

__all__ = ["FORWARD_TOL", "STEP_TOL", "forward_tolerance", "full_precision", "step_tolerance"]

#: Largest relative difference between a graphed and an eager forward, by what runs it.
FORWARD_TOL = {"full": 1e-4, "compiled": 1e-3, "reduced": 2e-2, "fp8": 0.125}
#: Largest relative difference between a graphed and an eager training step's update (and loss).
STEP_TOL = {"full": 1e-3, "reduced": 5e-2}
_FULL_PRECISIONS = ("32", "32-true", "64", "64-true")


def full_precision(precision: object) -> bool:
    """Whether the Trainer's ``precision`` computes in float32 or float64 throughout.

    Example:
        >>> full_precision("32-true"), full_precision("bf16-mixed")
        (True, False)
    """
    return str(precision) in _FULL_PRECISIONS


def forward_tolerance(parity_tol: float | None, *, reduced: bool, compiled: bool = False, fp8: bool = False) -> float:
    """The tolerance of a forward's parity check: ``parity_tol`` when given, else the table's figure.

    Example:
        >>> forward_tolerance(None, reduced=False), forward_tolerance(None, reduced=True)
        (0.0001, 0.02)
        >>> forward_tolerance(0.3, reduced=True)
        0.3
    """
    if parity_tol is not None:
        return parity_tol
    if fp8:
        return FORWARD_TOL["fp8"]
    if reduced:
        return FORWARD_TOL["reduced"]
    return FORWARD_TOL["compiled"] if compiled else FORWARD_TOL["full"]


def step_tolerance(precision: object) -> float:
    """The tolerance of a training step's check (the whole step, the optimizer update) under ``precision``."""
    return STEP_TOL["full" if full_precision(precision) else "reduced"]

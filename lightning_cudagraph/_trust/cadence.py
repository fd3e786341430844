"""When a training graph is checked against eager, and what its checks found: one rule for every kind of graph.

A new graph owes ``confirm_steps`` checks (its confirmation). What a graph froze at capture (a value read from a
counter, a branch taken once) shows first in the steps right after it, so the audits of a trusted graph start after 2
replayed steps and the interval doubles up to ``audit_every_n_steps``.
"""

from __future__ import annotations

from lightning_cudagraph._trust.evidence import largest_so_far
from lightning_cudagraph.health import CUDAGraphReport

__all__ = ["FIRST_INTERVAL", "GraphChecks"]

#: Replayed steps before the first audit after a capture; each later interval doubles up to ``audit_every_n_steps``.
FIRST_INTERVAL = 2


class GraphChecks:
    """The checks against eager of one kind of training graph (regions, the whole step, the optimizer update).

    Each kind says what its check is. This says when one is due, counts each in ``report.audits``, and keeps the
    largest difference seen in the report's ``parity`` field.

    Args:
        confirm_steps: Checks a new graph owes before it is trusted.
        audit_every: The longest interval between audits, in replayed steps (``None`` or 0: no audits).
        report: Where the checks are counted.
        parity: The report's field for this kind's largest difference.

    Example:
        >>> from lightning_cudagraph.health import CUDAGraphReport
        >>> checks = GraphChecks(confirm_steps=2, audit_every=16, report=CUDAGraphReport())
        >>> [step for step in range(1, 64) if checks.audit_due()]
        [2, 6, 14, 30, 46, 62]
        >>> checks.checked(0.5); checks.checked(0.25); checks.report.audits, checks.report.parity_err
        (2, 0.5)
    """

    def __init__(
        self, confirm_steps: int, audit_every: int | None, report: CUDAGraphReport, parity: str = "parity_err"
    ) -> None:
        self.confirm_steps, self.report, self._parity = confirm_steps, report, parity
        self._every = audit_every or 0
        self._interval = min(FIRST_INTERVAL, self._every)
        self._since = 0

    def captured(self) -> int:
        """A graph was captured: the audit interval counts from here; returns the checks the graph owes."""
        self._since = 0
        return self.confirm_steps

    def audit_due(self) -> bool:
        """Count one replayed step of a trusted graph; whether it is the one to audit (the interval then grows)."""
        if not self._every:
            return False
        self._since += 1
        if self._since < self._interval:
            return False
        self._since, self._interval = 0, min(2 * self._interval, self._every)
        return True

    def checked(self, *errors: float) -> None:
        """A check ran (confirmation's or an audit): count it, keep the largest difference, count the interval anew."""
        self._since = 0
        self.report.audits += 1
        if errors:
            setattr(self.report, self._parity, largest_so_far(getattr(self.report, self._parity), *errors))

"""When a trusted graph is checked against eager again: often right after capture, then every ``audit_every_n_steps``.

What a graph froze at capture (a value read from a counter, a branch taken once) shows first in the steps right
after it, so the interval starts at 2 replayed steps and doubles up to ``audit_every_n_steps``.
"""

from __future__ import annotations

__all__ = ["FIRST_INTERVAL", "AuditCadence"]

#: Replayed steps before the first audit after a capture; each later interval doubles up to ``audit_every_n_steps``.
FIRST_INTERVAL = 2


class AuditCadence:
    """Counts replayed steps and says when the next audit is due (``every``: the longest interval; ``None``/0: never).

    Example:
        >>> cadence = AuditCadence(every=16)
        >>> [step for step in range(1, 64) if cadence.due()]
        [2, 6, 14, 30, 46, 62]
    """

    def __init__(self, every: int | None) -> None:
        self.every = every or 0
        self._interval = min(FIRST_INTERVAL, self.every) if self.every else 0
        self._since = 0

    def due(self) -> bool:
        """Count one replayed step; whether it is the one to audit (the interval then grows)."""
        if not self.every:
            return False
        self._since += 1
        if self._since < self._interval:
            return False
        self._since, self._interval = 0, min(2 * self._interval, self.every)
        return True

    def checked(self) -> None:
        """A check ran for another reason (a capture's own): count the next interval from here."""
        self._since = 0

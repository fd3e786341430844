"""The one failure rule: what a failed capture or check does under ``on_failure``.

Under ``"eager"`` a failure warns and the failing part (or the fit) runs eagerly; under ``"raise"`` it raises
:class:`GraphFailure`, except a part that fails under ``scope="auto"``, which is the ladder's to handle.
"""

from __future__ import annotations

from lightning_cudagraph._warnings import warn_user

__all__ = ["FailurePolicy", "GraphFailure"]


class GraphFailure(RuntimeError):
    """A capture or check of a graph failed and the options asked to stop (``on_failure="raise"``).

    The graphs are released as on any early exit of a fit.

    Example:
        >>> import lightning_cudagraph
        >>> issubclass(lightning_cudagraph.GraphFailure, RuntimeError)
        True
    """


class FailurePolicy:
    """What a failure does, for every kind of graph (``auto_scope``: a failed part is the ladder's, never raised).

    Example:
        >>> policy = FailurePolicy("CUDAGraphCallback", "raise")
        >>> policy.part_failure_stops_graphs
        True
        >>> policy.fail("parity: off by 2x", eager_message="unused")
        Traceback (most recent call last):
        ...
        lightning_cudagraph._trust.failure.GraphFailure: CUDAGraphCallback(on_failure='raise'): parity: off by 2x
    """

    def __init__(self, component: str, on_failure: str, auto_scope: bool = False) -> None:
        self.component, self.on_failure, self.auto_scope = component, on_failure, auto_scope

    @property
    def part_failure_stops_graphs(self) -> bool:
        """A failed region or optimizer update takes the fit's graphs down (and raises) instead of going eager alone."""
        return self.on_failure == "raise" and not self.auto_scope

    def fail(self, reason: str, error: BaseException | None = None, *, eager_message: str) -> None:
        """Raise :class:`GraphFailure` for ``reason`` under ``on_failure="raise"``; otherwise warn ``eager_message``."""
        if self.on_failure == "raise":
            raise GraphFailure(f"{self.component}(on_failure='raise'): {reason}") from error
        warn_user(eager_message)

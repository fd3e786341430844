"""What both kinds of evaluation graph share: the trust rule, the per-key cache, and the loop's figures.

An evaluation graph (a whole evaluation step, or one region's forward) is captured on the second time its key is
seen (the first run is its eager warmup), replayed once on the capture's inputs and compared with the eager result
of the same inputs before it is trusted. A graph that fails its capture or that check is dropped, and that key (or
the whole loop) runs eagerly with the reason; with ``on_failure="raise"`` the failure raises instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, TypeVar

from torch import Tensor

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._trust.evidence import largest_so_far, relative_error
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.shape_cache import GraphCache
from lightning_cudagraph.health import EvaluationRecord

__all__ = ["CaptureCost", "EvalGraphCache", "EvalGraphs", "parity_of"]


class Resettable(Protocol):
    """A cached evaluation graph: frees its graph on :meth:`reset`."""

    def reset(self) -> None:
        """Free the graph and its buffers."""


G = TypeVar("G", bound=Resettable)


class EvalGraphs:
    """What both kinds of evaluation graphs hold: the backend, the loop's figures, the failure rule, the tolerance.

    Args:
        backend: Captures and replays (its pool is the training graphs' pool during a fit).
        record: The evaluation figures of the report.
        policy: What a failed capture or parity check does.
        component: Named in messages.
        tolerance: Largest relative difference between a graph and the eager result allowed.

    Example:
        >>> graphs = EvalGraphs(backend, record, policy, "CUDAGraphStrategy", 1e-4)  # doctest: +SKIP
    """

    def __init__(
        self, backend: CaptureBackend, record: EvaluationRecord, policy: FailurePolicy, component: str, tolerance: float
    ) -> None:
        self.backend, self.record, self.policy = backend, record, policy
        self.component, self.tolerance = component, tolerance

    def fail(self, reason: str, error: BaseException | None = None) -> None:
        """Say loudly why this graph is not used, or raise (``on_failure="raise"``); the reason lands in the record."""
        self.record.reason = reason
        self.policy.fail(
            f"evaluation graphs failed: {reason}",
            error,
            eager_message=f"{self.component}: evaluation runs eagerly here: {reason}",
        )


def parity_of(reference: Sequence[Tensor], graphed: Sequence[Tensor]) -> float:
    """Largest relative difference between the eager and the graphed tensors (one host sync, at capture only)."""
    if not reference and not graphed:
        return 0.0
    return float(relative_error(list(reference), list(graphed)))


class EvalGraphCache(GraphCache[G]):
    """Evaluation graphs by key, at most ``limit`` of them (least recently used evicted), and the sightings of keys.

    Args:
        limit: Most graphs held.

    Example:
        >>> cache = EvalGraphCache(limit=2)
        >>> cache.sighted("a"), cache.sighted("a")
        (1, 2)
    """

    def __init__(self, limit: int) -> None:
        super().__init__(limit, reset=lambda graph: graph.reset())
        self._sightings: dict[Hashable, int] = {}
        #: Keys that run eagerly for good (a failed capture or parity check), with the reason.
        self.eager: dict[Hashable, str] = {}

    def sighted(self, key: Hashable) -> int:
        """Count one more sighting of ``key`` without a graph; the count so far."""
        self._sightings[key] = self._sightings.get(key, 0) + 1
        return self._sightings[key]

    def add(self, key: Hashable, item: G) -> None:
        """Hold ``item`` for ``key`` (its sightings are done), evicting the least recently used graph when full."""
        self._sightings.pop(key, None)
        super().add(key, item)

    def clear(self) -> list[G]:
        """Reset and forget every graph, sighting and eager key."""
        graphs = super().clear()
        self._sightings.clear()
        self.eager.clear()
        for graph in graphs:
            graph.reset()
        return graphs


class CaptureCost:
    """What one capture costs: host time, and the memory it adds to the pool plus its static inputs.

    Args:
        backend: Reads the pool (once before and once after: a capture-time cost, never per replay).
        static: The tensors the graph reads across replays that were made for it (its static inputs).

    Example:
        >>> cost = CaptureCost(backend, inputs)  # doctest: +SKIP
        >>> graph = backend.capture_step(body)  # doctest: +SKIP
        >>> cost.count(record, parity, live=lambda: 1)  # doctest: +SKIP
    """

    def __init__(self, backend: CaptureBackend, static: Sequence[Tensor]) -> None:
        self.backend = backend
        self._inputs_mib = sum(t.numel() * t.element_size() for t in static) / 2**20
        self._pool_mib = backend.pool_mib()
        self._started = time.perf_counter()

    def elapsed_ms(self) -> float:
        """Host milliseconds since the capture began."""
        return (time.perf_counter() - self._started) * 1e3

    def count(self, record: EvaluationRecord, error: float, live: Callable[[], int]) -> None:
        """A trusted capture: the record's counters, the largest parity error, the memory and time it took."""
        record.captures += 1
        record.graphs = live()
        record.memory_mib += max(self.backend.pool_mib() - self._pool_mib, 0.0) + self._inputs_mib
        record.parity_err = largest_so_far(record.parity_err, error)

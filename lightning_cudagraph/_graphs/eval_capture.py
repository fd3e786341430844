"""The lifecycle both kinds of evaluation graph share: the cache by key, the decision, the checked capture.

An evaluation graph (a whole evaluation step, or one region's forward) is captured the second time its key is seen,
replayed once on the capture's inputs and kept only if it gives the eager result. A key whose graph fails runs
eagerly with the reason (or raises under ``on_failure="raise"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from lightning_cudagraph._backend.backend import CaptureBackend, StepGraph
from lightning_cudagraph._trust.evidence import largest_so_far, relative_error
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.shape_cache import GraphCache
from lightning_cudagraph.health import EvaluationRecord

__all__ = ["EvalGraphCache", "EvalGraphs", "Failure"]


class Resettable(Protocol):
    """A cached evaluation graph: it holds its graph and frees it on :meth:`reset`."""

    graph: StepGraph | None

    def reset(self) -> None:
        """Free the graph and its buffers."""


G = TypeVar("G", bound=Resettable)
#: Why a capture was not kept, and the error behind it.
Failure = tuple[str, BaseException | None]


class EvalGraphCache(GraphCache[G]):
    """Evaluation graphs by key (least recently used evicted), the sightings of keys, and the keys kept eager.

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


class EvalGraphs(Generic[G]):
    """Evaluation graphs of one kind: what to do with a key, and the capture that is checked before it is kept.

    A kind supplies its key, what its graph holds (:meth:`capture`'s ``body``) and its replay. ``tolerance`` is the
    largest relative difference from the eager result allowed; ``limit`` the most graphs held.
    """

    #: Whether :attr:`cache` holds at most ``limit`` graphs (a kind that bounds each of its parts apart says no).
    cache_bounded = True

    def __init__(
        self,
        backend: CaptureBackend,
        record: EvaluationRecord,
        policy: FailurePolicy,
        component: str,
        tolerance: float,
        limit: int,
    ) -> None:
        self.backend, self.record, self.policy = backend, record, policy
        self.component, self.tolerance, self.limit = component, tolerance, limit
        self.cache: EvalGraphCache[G] = EvalGraphCache(limit if self.cache_bounded else 1 << 30)

    def decide(self, key: Hashable, room: bool = True) -> G | bool:
        """What a call of ``key`` does: replay the graph returned, capture it (``True``), or run eagerly (``False``).

        A key that failed before runs eagerly, counted as a fallback; a key's first sighting is its eager warmup.
        """
        graph = self.cache.get(key)
        if graph is not None:
            return graph
        reason = self.cache.eager.get(key)
        if reason is not None:
            self.fallback(reason)
            return False
        return self.cache.sighted(key) >= 2 and room

    def fallback(self, reason: str) -> None:
        """Count one call run eagerly with ``reason``."""
        self.record.fallbacks += 1
        self.record.reason = reason

    def capture(
        self,
        key: Hashable,
        graph: G,
        body: Callable[[], None],
        modules: Sequence[torch.nn.Module],
        static: Sequence[Tensor],
        checked: tuple[Sequence[Tensor], Callable[[], Sequence[Tensor]]],
        what: str,
    ) -> Failure | None:
        """Capture ``body`` into ``graph``, replay it once and keep it if it gives the eager result; else the failure.

        ``checked`` is the eager result and a reader of the graph's; ``static`` the inputs made for the graph (their
        memory is counted). The caller hands a failure to :meth:`fail` once its eager result is in place.
        """
        pool_mib, started = self.backend.pool_mib(), time.perf_counter()
        error: Exception | None = None
        try:
            with self.backend.preserved(modules), self.backend.failure_guard():
                graph.graph = self.backend.capture_step(body)
            graph.graph.replay()  # on the capture's inputs: it must give the eager result
        except Exception as err:  # the key stays eager, loudly (or raises)
            error = err
        if error is not None:
            return self._drop(key, graph, f"eval_capture_failed: {what}: {type(error).__name__}: {error}", error)
        reference, graphed = list(checked[0]), list(checked[1]())
        parity = float(relative_error(reference, graphed)) if reference or graphed else 0.0  # one sync, at capture
        self.record.capture_ms += (time.perf_counter() - started) * 1e3
        if parity > self.tolerance:
            reason = (
                f"eval_parity: the evaluation graph of {what} differs from the eager run on the same inputs (relative"
                f" error {parity:.3g} > {self.tolerance:.3g}); it stays eager"
            )
            return self._drop(key, graph, reason, None)
        self.cache.add(key, graph)
        self.record.captures += 1
        self.record.graphs = len(self.cache)
        inputs_mib = sum(t.numel() * t.element_size() for t in static) / 2**20
        self.record.memory_mib += max(self.backend.pool_mib() - pool_mib, 0.0) + inputs_mib
        self.record.parity_err = largest_so_far(self.record.parity_err, parity)
        return None

    def _drop(self, key: Hashable, graph: G, reason: str, error: BaseException | None) -> Failure:
        graph.reset()
        self.cache.eager[key] = reason
        return reason, error

    def fail(self, reason: str, error: BaseException | None = None) -> None:
        """Say loudly why this graph is not used, or raise (``on_failure="raise"``); the reason lands in the record."""
        self.record.reason = reason
        self.policy.fail(
            f"evaluation graphs failed: {reason}",
            error,
            eager_message=f"{self.component}: evaluation runs eagerly here: {reason}",
        )

    def release(self) -> None:
        """Free every graph (idempotent)."""
        self.cache.clear()
        self.record.graphs = 0

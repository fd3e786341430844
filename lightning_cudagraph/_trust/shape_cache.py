"""Graphs by batch shape: a bounded, least-recently-used cache that can be sealed (a shape outside it is an error)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any, Generic, TypeVar

from lightning_cudagraph._options.batches import describe_batch_key
from lightning_cudagraph._warnings import warn_user
from lightning_cudagraph.health import CUDAGraphReport

T = TypeVar("T")


class GraphCache(Generic[T]):
    """Graphs by key, at most ``limit`` of them: a new key evicts the one used longest ago, which is reset.

    The one cache of the package's graphs: :class:`ShapeCache` and the evaluation graphs build on it.

    Example:
        >>> freed = []
        >>> cache = GraphCache(2, reset=freed.append)
        >>> for key in ("a", "b"):
        ...     cache.add(key, key.upper())
        >>> cache.get("a")  # "a" is now the most recently used
        'A'
        >>> cache.add("c", "C"); freed, cache.keys()
        (['B'], ['a', 'c'])
    """

    def __init__(self, limit: int, reset: Callable[[T], None]) -> None:
        self.limit, self._reset = limit, reset
        self._items: OrderedDict[Any, T] = OrderedDict()

    def get(self, key: Any) -> T | None:
        """The graph of ``key`` (marked most recently used), or ``None``."""
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def add(self, key: Any, item: T) -> None:
        """Hold ``item`` for ``key``, evicting the least recently used graph when full."""
        while len(self._items) >= self.limit:
            _, evicted = self._items.popitem(last=False)
            self._reset(evicted)
            self._evicted()
        self._items[key] = item

    def _evicted(self) -> None:
        """One graph was evicted (a subclass counts it)."""

    def clear(self) -> list[T]:
        """Forget every graph and return them (the caller resets them)."""
        items, self._items = list(self._items.values()), OrderedDict()
        return items

    def keys(self) -> list[Any]:
        """The keys held, least recently used first."""
        return list(self._items)

    def values(self) -> Iterator[T]:
        """The graphs held."""
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


class ShapeCache(GraphCache[T]):
    """Graph sets by batch key, least recently used first; sealable."""

    def __init__(self, limit: int, report: CUDAGraphReport, component: str, reset: Callable[[T], None]) -> None:
        super().__init__(limit, reset)
        self.report, self.component = report, component
        #: Every shape captured so far, held or not: once sealed, these may be captured again (an evicted shape, or
        #: the shapes of an earlier level of ``scope="auto"``).
        self.known: set[tuple[Any, ...]] = set()
        self.sealed = False
        self._thrash_warned = False

    def add(self, key: tuple[Any, ...], item: T) -> None:
        """Hold ``item`` for ``key``, evicting the least recently used set when full; the shape is known from now."""
        super().add(key, item)
        self.known.add(key)

    def _evicted(self) -> None:
        self.report.evictions += 1
        self._warn_if_thrashing()

    def seal(self, known: AbstractSet[tuple[Any, ...]] = frozenset()) -> None:
        """Close the set of shapes to those captured so far (and ``known``): any other shape is an error."""
        self.sealed = True
        self.known |= known

    def admits(self, key: tuple[Any, ...]) -> bool:
        """Whether a shape without graphs may be captured: always before the seal, then only a known shape."""
        return not self.sealed or key in self.known

    def sealed_error(self, key: tuple[Any, ...]) -> RuntimeError:
        """The error for a shape outside a sealed set."""
        captured = ", ".join(f"[{describe_batch_key(k)}]" for k in self._items) or "nothing"
        return RuntimeError(
            f"{self.component}: batch shape [{describe_batch_key(key)}] has no graph and the set of shapes is sealed"
            f" (captured: {captured}). Fix: pad batches to the captured shapes (lightning_cudagraph.bucketing), seal"
            " later (seal_after_steps), or do not seal."
        )

    def shapes(self) -> list[tuple[Any, ...]]:
        """The batch keys held, least recently used first."""
        return self.keys()

    def _warn_if_thrashing(self) -> None:
        if not self._thrash_warned and self.report.evictions >= 2 * self.limit:
            self._thrash_warned = True
            warn_user(
                f"{self.component}: {self.report.evictions} graph sets evicted with max_graphs={self.limit}: more"
                " shapes rotate than the cache holds, so most steps capture again instead of replaying. Raise"
                " max_graphs to the number of shapes, or pad batches to fewer lengths (lightning_cudagraph.bucketing)."
            )

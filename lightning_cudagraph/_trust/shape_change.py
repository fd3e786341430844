"""The one home of ``on_shape_change``: what a batch shape does, for the scoped and the whole-step driver alike."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lightning_cudagraph._options.batches import describe_batch_key
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import Stage


class ShapeChange(enum.Enum):
    """What a batch of another shape does once graphs exist (the ``on_shape_change`` option)."""

    EAGER = "eager"
    RECAPTURE = "recapture"
    ERROR = "error"


class ShapeAction(enum.Enum):
    """What one batch does with its shape's graphs."""

    REPLAY = "replay"
    #: One of the shape's own eager steps before its capture (recorded, for a scoped capture).
    EAGER = "eager"
    #: Run eagerly while graphs of other shapes stay on (counted as a fallback, with the reason).
    FALLBACK = "fallback"
    #: Run eagerly and wait: the warmup steps were not all finite, so nothing is captured yet.
    WAIT = "wait"
    CAPTURE = "capture"


@dataclass(frozen=True)
class ShapeOutcome:
    """The answer for one batch.

    Attributes:
        reason: Why the step runs eagerly while graphs are in use (a fallback's reason), else ``None``.
        evicts: The batch key whose graph set a capture evicts (the least recently used, when the cache is full).
        held: The shape's graph set, to replay.
    """

    action: ShapeAction
    reason: str | None = None
    evicts: tuple[Any, ...] | None = None
    held: Any = None


def shape_change_error(component: str, change: str) -> RuntimeError:
    """The error of ``on_shape_change="error"``, for a batch shape or a region's call."""
    return RuntimeError(
        f"{component}(on_shape_change='error'): {change}. Fix: keep batch shapes fixed (e.g."
        " DataLoader(drop_last=True)), or pass on_shape_change='eager' or 'recapture'."
    )


class ShapeDecision:
    """Decides what each batch shape does, from ``on_shape_change``, the shape cache and the stage."""

    def __init__(self, policy: str, cache: ShapeCache[Any], machine: StageMachine, component: str) -> None:
        self.policy = ShapeChange(policy)
        self.cache, self.machine, self.component = cache, machine, component

    def decide(self, key: tuple[Any, ...], seen: int, needed: int, uncapturable: bool = False) -> ShapeOutcome:
        """What a batch with key ``key`` does; raises under ``on_shape_change="error"`` or outside a sealed set.

        Args:
            key: The batch's key (its shapes).
            seen: Eager steps this shape ran so far (before this batch).
            needed: Eager steps this shape runs before its capture.
            uncapturable: Whether an earlier attempt found that this shape cannot be captured.
        """
        held = self.cache.get(key)
        if held is not None:
            return ShapeOutcome(ShapeAction.REPLAY, held=held)
        change = self._change(key)
        in_use = self.machine.stage != Stage.WARMUP  # graphs of other shapes exist: an eager step is a fallback
        if in_use:
            if not self.cache.admits(key):
                raise self.cache.sealed_error(key)
            if self.policy is ShapeChange.ERROR:
                raise shape_change_error(self.component, change)
            if uncapturable:
                return ShapeOutcome(ShapeAction.FALLBACK, f"{change}; it cannot be captured")
            if self.policy is ShapeChange.EAGER:
                return ShapeOutcome(ShapeAction.FALLBACK, change)
        if seen < needed:
            return ShapeOutcome(ShapeAction.EAGER, change if in_use else None)
        if not in_use and not self.machine.warmup_was_finite():
            return ShapeOutcome(ShapeAction.WAIT)
        full = len(self.cache) >= self.cache.limit
        return ShapeOutcome(ShapeAction.CAPTURE, change if in_use else None, self.cache.shapes()[0] if full else None)

    def region_mismatch(self, region: str, mismatch: str) -> str:
        """A region's call that its graph was not captured for: the fallback's reason, or raise under ``"error"``."""
        if self.policy is ShapeChange.ERROR:
            raise shape_change_error(self.component, f"{region} was captured for another input: {mismatch}")
        return f"{region}: {mismatch}"

    def _change(self, key: tuple[Any, ...]) -> str:
        captured = ", ".join(describe_batch_key(k) for k in self.cache.shapes()) or "nothing yet"
        return f"batch shape {describe_batch_key(key)} differs from the captured {captured}"

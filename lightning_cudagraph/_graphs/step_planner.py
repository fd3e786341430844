"""The whole step's plan: what the next optimizer step does, decided in ``batch_to_device`` before it runs.

:meth:`~lightning_cudagraph._graphs.whole_step.WholeStepDriver.run` carries the plan out.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_cudagraph._graphs.accumulation import GradientBinding, Position
from lightning_cudagraph._graphs.step_capture import every_batch_another_key
from lightning_cudagraph._graphs.step_pieces import CaptureStep, EagerStep, ReplayStep, StepPlan, StepWindow, WholeStep
from lightning_cudagraph._options.batches import batch_key, opaque_reason, own_copy
from lightning_cudagraph._trust.shape_change import ShapeAction, ShapeDecision
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import Stage

__all__ = ["StepPlanner"]


class StepPlanner:
    """Plans each training batch of the whole step: replay, capture, or run eagerly."""

    def __init__(self, machine: StageMachine, shapes: ShapeDecision) -> None:
        self.machine, self.shapes = machine, shapes
        #: The place of the batch planned last in its accumulation window.
        self.position = Position.at(0, 1, last_batch=False)
        self._sightings: dict[tuple[Any, ...], int] = {}  # eager steps of each batch key not captured yet

    def plan(
        self, trainer: pl.Trainer, batch: Any, binding: GradientBinding, eager_steps: int, recheck: str | None
    ) -> tuple[StepPlan | None, Any]:
        """The plan of this batch's step (``None``: an eager step that is no fallback) and the batch it should use.

        Args:
            trainer: The Trainer, about to run the batch.
            batch: The batch, on the device.
            binding: The gradients the graphs read and write (a later micro-batch replays only while they hold).
            eager_steps: Eager steps a new batch shape runs before its capture.
            recheck: Run this step eagerly, a fallback with this reason (a re-check of the step's Python).
        """
        if recheck is not None:
            self.position = Position.of(trainer)
            return EagerStep(fallback=recheck), batch
        key = batch_key(batch, values=True)  # a graph bakes in the batch's non-tensor values too
        if key is None:  # no key could tell this batch's graph: it runs eagerly, or graphs are off, with the reason
            if self.machine.stage != Stage.WARMUP:
                return EagerStep(fallback=f"opaque_batch: {opaque_reason(batch)}"), batch
            self.machine.disable("opaque_batch", detail=opaque_reason(batch))
            return None, batch
        position = self.position = Position.of(trainer)
        seen = self._sightings.get(key, 0)
        outcome = self.shapes.decide(key, seen, eager_steps)
        if outcome.action is ShapeAction.REPLAY:
            return self._in_window(key, outcome.held, position, batch, binding)
        if outcome.action is ShapeAction.FALLBACK:
            return EagerStep(fallback=outcome.reason), batch
        if not position.place.zeroes:  # a shape's warmup and capture count windows, which start at a first micro-batch
            return (EagerStep(fallback=outcome.reason) if outcome.reason is not None else None), batch
        self._sightings[key] = seen + 1
        if outcome.action is ShapeAction.EAGER:  # this shape's own eager steps
            return EagerStep(fallback=outcome.reason), batch
        if outcome.action is ShapeAction.WAIT:
            return None, batch
        return self._capture(key, StepWindow(), position, batch, outcome.evicts)

    def captured(self, key: tuple[Any, ...]) -> None:
        """A step of this batch key was captured: its eager steps no longer count."""
        self._sightings.pop(key, None)

    def why_not_captured(self) -> str | None:
        """Every batch had a signature of its own: a value that changes per batch is part of the whole step's key."""
        return every_batch_another_key(self._sightings)

    def _in_window(
        self, key: tuple[Any, ...], window: StepWindow, position: Position, batch: Any, binding: GradientBinding
    ) -> tuple[StepPlan, Any]:
        """A shape with graphs: replay this position's, or capture it, or run eagerly (a window started eagerly)."""
        part = window.parts.get(position)
        if part is not None and (position.place.zeroes or binding.holds(part.grads)):
            return ReplayStep(key, part, position), part.stage(batch)
        first = window.first(position.accumulate)
        if part is None and (position.place.zeroes or (first is not None and binding.holds(first.grads))):
            return self._capture(key, window, position, batch)
        reason = f"accumulation: {position.describe()} runs eagerly, as its window's first micro-batch did"
        return EagerStep(fallback=reason), batch

    def _capture(
        self, key: tuple[Any, ...], window: StepWindow, position: Position, batch: Any, evicts: Any = None
    ) -> tuple[StepPlan, Any]:
        # A copy of this batch becomes the static buffers of the step about to be captured: later batches are copied
        # into it, so it must never be the user's own tensors (a dataset on the device would be overwritten).
        whole = WholeStep(static_batch=own_copy(batch))
        return CaptureStep(key, whole, evicts, window, position), whole.static_batch

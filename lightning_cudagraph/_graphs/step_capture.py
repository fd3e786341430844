"""The capture of one whole step: ``training_step``, backward and the optimizer step recorded into one graph.

A capture that fails on any rank is dropped on every rank, and what its Python changed is put back, so the step can run
again eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._graphs.accumulation import GradientBinding, Position
from lightning_cudagraph._graphs.step_optimizers import Schedule, schedule_moved
from lightning_cudagraph._graphs.step_pieces import NonFiniteFlags, WholeStep
from lightning_cudagraph._lightning import GradToggles, manual_optimizers, step_loss
from lightning_cudagraph._options.batches import describe_batch_key
from lightning_cudagraph._trust.capture_hints import capture_failure
from lightning_cudagraph._trust.evidence import MetricUpdates
from lightning_cudagraph._trust.observation import SKIP_FIX
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.stages import StageMachine

#: What a user can do about a value the whole step read that changes between steps.
GUARD_FIX = (
    "keep a value that changes in a device tensor the step reads (self.register_buffer('scale', torch.tensor(1.0),"
    " persistent=False), then self.scale.fill_(...) between steps), or use a scoped level (strategy='cudagraph' or"
    " scope=['layer']), which runs training_step's Python every step (docs/python.md)"
)


class StepCapture:
    """Captures whole steps on the backend and says what ran inside them.

    Args:
        flags: The non-finite flags the captured step writes.
    """

    def __init__(self, backend: CaptureBackend, machine: StageMachine, flags: NonFiniteFlags) -> None:
        self.backend, self.machine, self.flags = backend, machine, flags
        self._capturing: WholeStep | None = None
        self._manual = False  # whether the step being captured is a manual training_step
        self._moved: str | None = None  # what the manual step captured last moved of the schedule

    @property
    def capturing(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return self._capturing is not None

    def on_training_step_output(self, output: Any) -> None:
        """While capturing: keep ``training_step`` 's output (static tensors) and add the non-finite check."""
        whole = self._capturing
        if whole is None:
            return
        whole.output = output
        loss = step_loss(output)
        if loss is not None and not whole.updates.calls:  # a manual step checked the losses it backpropagated
            self.flags.update(loss)

    def on_backward(self, loss: Any) -> None:
        """While capturing a manual step: each loss ``manual_backward`` receives gets the non-finite check."""
        if self._capturing is not None and self._manual and isinstance(loss, Tensor):
            self.flags.update(loss)

    def capture(
        self, whole: WholeStep, run_step: Callable[[], Any], module: Any, before: TrainingState
    ) -> MetricUpdates | None:
        """Capture ``run_step`` into ``whole.graph``; the metrics to check after, or ``None`` (failed, rolled back).

        Args:
            whole: Receives the graph, the output and the ``self.log`` calls.
            run_step: Lightning's optimizer step (``training_step`` and backward run inside it).
            module: The LightningModule.
            before: Everything the step changes, copied before: put back when the capture is dropped.
        """
        metrics = MetricUpdates([("", module)])
        # Under manual optimization training_step steps the optimizers: the loop hears of it at each replay instead.
        self._manual = not module.automatic_optimization
        manual = manual_optimizers(module.trainer) if self._manual else []
        schedule = Schedule(module.trainer) if self._manual else None  # a manual step may move it inside the graph

        def body() -> None:  # what the graph holds; its Python runs while capturing only
            self._capturing = whole
            try:
                with whole.logs.recorded(module), whole.updates.recorded(manual):
                    run_step()
            finally:
                self._capturing = None

        toggles = GradToggles(module)
        started = time.perf_counter()
        error: Exception | None = None
        try:
            with self.backend.failure_guard():
                whole.graph = self.backend.capture_step(body)
        except Exception as err:  # roll back loudly (or raise); the step then runs eagerly
            error = err
        finally:
            self.machine.report.capture_ms_total += (time.perf_counter() - started) * 1e3
        self._moved = schedule.moved() if schedule is not None else None
        if schedule is not None and self._moved is not None:
            schedule.restore()
        if self.machine.agreement.all_ok(error is None):  # a rank whose capture worked drops it too
            return metrics
        if whole.graph is not None:
            whole.graph.reset()
            whole.graph = None
        updated = metrics.changed()  # before the state (update counters included) is put back
        before.restore()
        toggles.restore()  # a capture that failed inside toggle_optimizer ... untoggle_optimizer
        if updated and error is not None:  # torchmetrics' own host syncs fail the capture: name the cause
            self.machine.rollback(metric_in_graph(updated, f" (its capture failed: {error})"), error)
        else:
            error = error or RuntimeError("the capture failed on another rank")
            self.machine.rollback(capture_failure(error, module), error)
        return None

    def refusal(
        self, whole: WholeStep, position: Position, binding: GradientBinding, step: int, drawn: list[str]
    ) -> str | None:
        """The rollback reason of the capture that just ran, or ``None`` (:func:`refused_capture`).

        A manual step that moved the schedule (stepped a scheduler, wrote a rate) is refused as well: its graph would
        keep the rate the capture left.
        """
        found = refused_capture(whole, position, binding, step, drawn, self._manual)
        return found or (schedule_moved(self._moved, step) if self._moved is not None else None)

    def release(self) -> None:
        """Nothing is being captured any more."""
        self._capturing = None


def metric_in_graph(updated: list[str], failure: str = "") -> str:
    """The rollback reason of torchmetrics metrics updated inside the captured ``training_step``."""
    return (
        f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside the captured training_step{failure};"
        " a replay would not count their updates. Fix: update them in on_train_batch_end from the step's outputs,"
        " or use a scoped capture (scope=['layer'])"
    )


def refused_capture(
    whole: WholeStep, position: Position, binding: GradientBinding, step: int, drawn: list[str], manual: bool = False
) -> str | None:
    """The rollback reason of a capture that ran but cannot be trusted with the fit, or ``None``.

    A step whose ``training_step`` skipped its batch (``manual``: stepped no optimizer) holds no optimizer step. A
    later micro-batch of an accumulation window must add into the gradients its window's first graph writes, not
    replace them. A step that ``drawn`` from a private generator at its capture, which the observed steps did not show,
    would repeat the draw.
    """
    if drawn:
        return (
            f"step_python: training_step drew from {', '.join(drawn)} at the captured step {step}, which a whole-step"
            " graph would freeze (a replay draws nothing). Fix: draw with torch on the device (torch.rand(...,"
            " device=self.device)), which a replay draws anew, or use a scoped level (strategy='cudagraph' or"
            " scope=['layer'])"
        )
    if manual and not whole.updates.calls:
        return (
            f"skipped_step: training_step stepped no optimizer at step {step}, the step being captured, so every replay"
            f" would train nothing. Fix: {SKIP_FIX}"
        )
    if not manual and step_loss(whole.output) is None:
        return (
            f"skipped_step: training_step returned None at step {step}, the step being captured, so its graph would"
            f" hold no backward and no optimizer step and every replay would train nothing. Fix: {SKIP_FIX}"
        )
    if not position.place.zeroes and not binding.verify():
        return (
            f"accumulation_rebound: capturing {position.describe()} replaced parameters' .grad tensors instead of"
            " adding into them, so the window's graphs would not share gradients. Fix: do not assign .grad in"
            " training_step or backward hooks, or pass accumulate_grad_batches=1 with a larger batch"
        )
    return None


def every_batch_another_key(sightings: Mapping[Any, int]) -> str | None:
    """Why no whole step was captured when every batch seen had a key of its own (seen once each), or ``None``."""
    if len(sightings) < 2 or max(sightings.values()) > 1:
        return None
    keys = list(sightings)
    return (
        f"every batch had another signature ({len(keys)} batches, e.g. {describe_batch_key(keys[0])} then"
        f" {describe_batch_key(keys[1])}), so no batch shape ran the eager steps before its capture. A whole step"
        " bakes the batch's non-tensor values in (a string, a number), so they are part of its key. Fix: keep"
        " per-batch values that change out of the batch (drop them in the collate function), or pad tensors to a"
        " few shapes (lightning_cudagraph.bucketing.PadToBucket)"
    )

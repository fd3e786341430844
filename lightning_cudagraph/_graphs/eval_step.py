"""The whole evaluation step as one forward-only graph: ``validation_step``, ``test_step`` or ``predict_step``.

The strategy hands over the batch (``batch_to_device``: :meth:`EvalStepGraphs.plan`) and the step itself
(:meth:`EvalStepGraphs.run`). A key's second step runs eagerly as the real step, then the graph is captured on the
same static batch and kept only if its output and ``self.log`` values equal the eager step's. A replay re-issues the
captured ``self.log`` calls, so ``val_loss``, checkpointing, early stopping and predictions match eager evaluation.
A step that updates a torchmetrics metric is never captured: a replay would not run ``update``'s Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_cudagraph._backend.backend import StepGraph
from lightning_cudagraph._graphs.eval_capture import EvalGraphs
from lightning_cudagraph._lightning import StepLogs
from lightning_cudagraph._options.batches import (
    BatchKey,
    batch_key,
    batch_tensors,
    copy_into,
    describe_batch_key,
    own_copy,
)
from lightning_cudagraph._trust.evidence import MetricUpdates

__all__ = ["EvalStep", "EvalStepGraphs", "metric_in_eval_graph"]

#: A step's key: its hook and its batch's key (structure, shapes, dtypes, non-tensor values).
StepKey = tuple[str, BatchKey]


@dataclass(eq=False)
class EvalStep:
    """One captured evaluation step: its static batch, graph, static output and ``self.log`` calls.

    Example:
        >>> step = EvalStep(static_batch={"x": None}, logs=StepLogs("validation_step"))
        >>> step.reset()
        >>> step.graph is None and step.static_batch is None
        True
    """

    static_batch: Any
    logs: StepLogs
    graph: StepGraph | None = None
    output: Any = None

    def reset(self) -> None:
        """Free the graph and drop the buffers."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.output, self.static_batch = None, None, None
        self.logs.clear()


@dataclass
class _Plan:
    """What the next evaluation step does: replay ``step``, or capture a new one for ``key``."""

    key: StepKey
    step: EvalStep
    capture: bool = False


class EvalStepGraphs(EvalGraphs[EvalStep]):
    """Forward-only graphs of whole evaluation steps, one per step hook and batch key, in the backend's pool."""

    #: Why every step runs eagerly from now on (a metric updated inside the step), or ``None``.
    off: str | None = None
    _plan: _Plan | None = None

    # ------------------------------------------------------------------ the plan (``batch_to_device``)
    def plan(self, hook: str, batch: Any) -> Any:
        """Pick what the next ``hook`` step runs; the batch to hand it (a static batch holding its values)."""
        self._plan = None
        if self.off is not None:
            return batch
        key = batch_key(batch, values=True)
        if key is None:
            self.fallback("opaque_batch: the batch holds something the package cannot see into")
            return batch
        step_key: StepKey = (hook, key)
        decision = self.decide(step_key)
        if isinstance(decision, EvalStep):
            copy_into(decision.static_batch, batch)
            self._plan = _Plan(step_key, decision)
            return decision.static_batch
        if not decision:
            return batch
        self._plan = _Plan(step_key, EvalStep(own_copy(batch), StepLogs(hook)), capture=True)
        return self._plan.step.static_batch

    # ------------------------------------------------------------------ the step (``validation_step`` etc.)
    def run(self, module: pl.LightningModule, step: Callable[[], Any]) -> Any:
        """Run the planned step: replay its graph, or run it eagerly and capture it, or run it eagerly."""
        plan, self._plan = self._plan, None
        if plan is None:
            return step()
        if not plan.capture:
            return self._replay(plan.step, module)
        return self._capture(plan, module, step)

    def _replay(self, step: EvalStep, module: pl.LightningModule) -> Any:
        assert step.graph is not None, "a cached evaluation step always holds its graph"
        step.graph.replay()
        self.record.replays += 1
        step.logs.reissue(module)
        return own_copy(step.output)  # the next replay rewrites the static output

    def _capture(self, plan: _Plan, module: pl.LightningModule, step: Callable[[], Any]) -> Any:
        hook, key = plan.key
        metrics = MetricUpdates([("", module)])
        eager_logs = StepLogs(hook)
        with eager_logs.recorded(module):  # the real step of this batch, run eagerly; its logs are issued below
            reference = step()
        updated = metrics.changed()
        if updated:
            self.off = metric_in_eval_graph(updated, hook)
            self.fail(self.off)
            eager_logs.reissue(module)
            return reference
        captured = plan.step

        def body() -> None:  # what the graph holds; its Python runs while capturing only
            with captured.logs.recorded(module):
                captured.output = step()

        failure = self.capture(
            plan.key,
            captured,
            body,
            [module],
            batch_tensors(captured.static_batch),
            (_step_tensors(reference, eager_logs), lambda: _step_tensors(captured.output, captured.logs)),
            f"{hook} (batch {describe_batch_key(key)})",
        )
        eager_logs.reissue(module)  # before a raise: this batch's logs are the eager step's
        if failure is not None:
            self.fail(*failure)
        else:
            rank_zero_info(f"{self.component}: captured {hook} for batch {describe_batch_key(key)} (forward only)")
        return reference

    def release(self) -> None:
        """Free every graph (idempotent)."""
        self._plan = None
        self.off = None
        super().release()


def _step_tensors(output: Any, logs: StepLogs) -> list[Tensor]:
    """The tensors a step hands on: its output's and its logged values'."""
    logged = [value for _, value, _, _ in logs.calls if isinstance(value, Tensor)]
    return [t.detach() for t in (*batch_tensors(output), *logged)]


def metric_in_eval_graph(updated: list[str], hook: str) -> str:
    """The reason an evaluation loop runs eagerly: torchmetrics metrics updated inside its step."""
    return (
        f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside {hook}; a graph replay would not count"
        f" their updates, so {hook} runs eagerly. Fix: update them in on_validation_batch_end (or the matching hook)"
        " from the step's outputs"
    )

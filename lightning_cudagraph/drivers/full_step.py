"""The whole-step driver: ``training_step``, backward, clipping and the optimizer step as one graph.

The strategy hands it the batch (``batch_to_device``: :meth:`FullStepDriver.plan` makes a :data:`StepPlan`), the
output of ``training_step`` (captured output and in-graph non-finite check), and the step itself
(``optimizer_step``: :meth:`FullStepDriver.run` carries the plan out). A replayed step rebuilds Lightning's closure
result and re-issues the captured ``self.log`` calls, so the loop, loggers, checkpointing and early stopping behave
as in eager training.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._lightning import logs_recorded, relog, set_closure_result, step_loss
from lightning_cudagraph.drivers.base import Driver, shape_change_error
from lightning_cudagraph.drivers.evidence import MetricUpdates, TrainableWatch, state_addresses
from lightning_cudagraph.drivers.whole_step import NonFiniteFlags, WholeStep
from lightning_cudagraph.graphs.backend import PreparedOptimizer
from lightning_cudagraph.health import Stage
from lightning_cudagraph.signature import batch_key, describe_batch_key


@dataclass(frozen=True)
class EagerStep:
    """Run the step eagerly; ``fallback`` says why while graphs are in use (counted), ``None`` during warmup."""

    fallback: str | None = None


@dataclass(frozen=True)
class CaptureStep:
    """Capture the step for this batch signature, then replay it."""

    key: tuple[Any, ...]


@dataclass(frozen=True)
class ReplayStep:
    """Replay the step captured for this batch signature."""

    key: tuple[Any, ...]


#: What the next optimizer step does: made by :meth:`FullStepDriver.plan`, consumed by :meth:`FullStepDriver.run`.
StepPlan = EagerStep | CaptureStep | ReplayStep


class FullStepDriver(Driver):
    """Captures and replays whole training steps, one per batch signature."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.steps: dict[tuple[Any, ...], WholeStep] = {}
        self.optimizers: dict[int, PreparedOptimizer] = {}
        self.flags = NonFiniteFlags(self.backend.device)
        self.trainable = TrainableWatch()
        self._plan: StepPlan | None = None
        self._capturing: WholeStep | None = None
        self._seen: set[tuple[Any, ...]] = set()
        self._problem: str | None = None
        self._replays_since_capture = 0
        self._last_nonfinite_check = 0

    def start(self, trainer: pl.Trainer) -> None:
        """Switch optimizers to their capturable form for the whole fit, so their arithmetic never changes mid-run."""
        self._last_nonfinite_check = trainer.global_step
        for optimizer in trainer.optimizers:
            self._prepare(optimizer)

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self.optimizers:
            self.optimizers[id(optimizer)] = self.backend.prepare_optimizer(optimizer)

    # ------------------------------------------------------------------ the plan (``batch_to_device``)
    def plan(self, step: int, batch: Any) -> Any:
        """Decide what the next optimizer step does, and return the batch it should use (static buffers to replay)."""
        self._plan = None
        if not self.machine.graphs_allowed or self.machine.recording_due(step):
            return batch
        key = batch_key(batch)
        if self.machine.capture_due(step):
            return self._adopt(key, batch) if self.machine.warmup_was_finite() else batch
        if key in self.steps:
            self._plan = ReplayStep(key)
            return self.steps[key].stage(batch)
        captured = ", ".join(describe_batch_key(k) for k in self.steps)
        change = f"batch shape {describe_batch_key(key)} differs from the captured {captured}"
        if self.config.on_shape_change == "error":
            raise shape_change_error(self.component, change)
        recapture = self.config.on_shape_change == "recapture" and len(self.steps) < self.config.graph_set_limit
        if recapture and key in self._seen:  # captured on its second sighting: one-off shapes stay eager
            return self._adopt(key, batch)
        self._seen.add(key)
        self._plan = EagerStep(fallback=change)
        return batch

    def _adopt(self, key: tuple[Any, ...], batch: Any) -> Any:
        """This (already on-device) batch becomes the static buffers of the step about to be captured."""
        self.steps[key] = WholeStep(static_batch=batch)
        self._plan = CaptureStep(key)
        return batch

    # ------------------------------------------------------------------ carrying it out (``optimizer_step``)
    def run(
        self, trainer: pl.Trainer, closure: Any, optimizer: torch.optim.Optimizer, run_step: Callable[[], Any]
    ) -> Any:
        """Run the optimizer step as planned: eagerly, or captured then replayed."""
        plan, self._plan = self._plan, None
        if plan is None or isinstance(plan, EagerStep) or not self.machine.graphs_allowed:
            if isinstance(plan, EagerStep) and plan.fallback is not None and self.machine.graphs_allowed:
                self.report.count_fallback(plan.fallback)
            return _eager(run_step)
        module = trainer.lightning_module
        if isinstance(plan, CaptureStep):
            first = self.machine.stage == Stage.WARMUP
            if not self._capture(plan.key, optimizer, run_step, module):
                return _eager(run_step)
            if first:
                self.machine.begin_confirmation(trainer.global_step, self.config.confirm_steps)
                self._replays_since_capture = 0
        else:
            problem = self.trainable.problem()
            if problem is not None:
                self.machine.rollback(problem)
                return _eager(run_step)
        return self._replay(self.steps[plan.key], trainer, closure, module)

    def _capture(
        self, key: tuple[Any, ...], optimizer: torch.optim.Optimizer, run_step: Callable[[], Any], module: Any
    ) -> bool:
        whole = self.steps[key]
        self._prepare(optimizer)
        self._note_memory_before_capture()
        metrics = MetricUpdates([("", module)])

        def body() -> None:  # what the graph holds; its Python runs while capturing only
            whole.logs.clear()
            self._capturing = whole
            try:
                with logs_recorded(module, whole.logs):
                    run_step()
            finally:
                self._capturing = None

        started = time.perf_counter()
        try:
            with self.backend.failure_guard():
                whole.graph = self.backend.capture_step(body)
        except Exception as err:  # roll back loudly (or raise); the step then runs eagerly
            self.steps.pop(key, None)
            self._capture_failed(err)
            return False
        whole.addresses = state_addresses(module)
        if not self._captured(started, len(self.steps)):
            return False
        updated = metrics.changed()
        if updated:
            self.machine.rollback(
                f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside the captured training_step;"
                " a replay would not count their updates. Fix: update them in on_train_batch_end from the step's"
                " outputs, or use a scoped capture (scope=['layer'])"
            )
            return False
        self.trainable.watch(module.named_parameters())
        rank_zero_info(f"{self.component}: captured the training step for batch {describe_batch_key(key)}")
        return True

    def _replay(self, whole: WholeStep, trainer: pl.Trainer, closure: Any, module: Any) -> Any:
        for optimizer in self.optimizers.values():
            optimizer.refresh()
        self.flags.current_step.fill_(trainer.global_step)
        whole.graph.replay()
        self._replays_since_capture += 1
        self.report.replays += 1
        output = whole.output_copy()
        set_closure_result(closure, output, trainer.accumulate_grad_batches)
        relog(module, whole.logs)
        if self.machine.stage == Stage.CONFIRMING and state_addresses(module) != whole.addresses:
            self._problem = "address_changed: a parameter is not the tensor the step graph was captured with"
        return output

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
        if loss is not None:
            self.flags.update(loss)

    # ------------------------------------------------------------------ confirmation, health, release
    def end_step(self, outputs: Any) -> None:
        """Roll back on what a confirming replay found."""
        problem, self._problem = self._problem, None
        if problem is not None and self.machine.graphs_allowed:
            self.machine.rollback(problem)

    def finish_confirmation(self) -> None:
        """Confirm if the step replayed and its losses were finite (one host sync)."""
        if self._replays_since_capture == 0:
            self.machine.rollback("not_replayed: no graph replayed during confirmation")
            return
        count, first = self.flags.read_and_clear()
        self.machine.confirm(graphs=self.report.graphs, nonfinite_first_step=first if count else None)

    def check_nonfinite(self, step: int) -> None:
        """Read the in-graph non-finite counter (one host sync per log interval, once a step is captured)."""
        if not self.steps or not self.machine.graphs_allowed:
            return
        count, first = self.flags.read_and_clear()
        since, self._last_nonfinite_check = self._last_nonfinite_check, step
        if count:
            self.report.nonfinite.append((first, count))
            self.machine.rollback(
                f"nonfinite_loss: {count} non-finite loss(es) in steps {since}-{step - 1}, first at step {first}"
            )

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            prepared = self.optimizers.get(id(optimizer))
            if prepared is not None:
                prepared.plain_state_dict(state)

    def release(self) -> None:
        """Reset every step graph and give the optimizers back (the optimizers even when a reset fails)."""
        self._plan = self._capturing = None
        steps, self.steps = list(self.steps.values()), {}
        try:
            for whole in steps:
                whole.reset()
        finally:
            self.report.graphs = 0
            optimizers, self.optimizers = list(self.optimizers.values()), {}
            for optimizer in optimizers:
                optimizer.restore()


def _eager(run_step: Callable[[], Any]) -> Any:
    """Run an optimizer step eagerly; the optimizer is capturable, which PyTorch would warn about on every fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        return run_step()

"""The whole-step driver: ``training_step``, backward, clipping and the optimizer step as one graph.

The strategy hands it the batch (``batch_to_device``: a plan is made), the output of ``training_step`` and the step
itself (``optimizer_step``: the plan is carried out). A replayed step rebuilds Lightning's closure result and
re-issues the captured ``self.log`` calls, so the loop, loggers, checkpointing and early stopping behave as in eager
training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.compiling import CompiledModules, called_modules
from lightning_cudagraph._backend.watchdog import ReplayWatchdog
from lightning_cudagraph._graphs.accumulation import GradientBinding
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._graphs.step_capture import GUARD_FIX, StepCapture, metric_in_graph
from lightning_cudagraph._graphs.step_optimizers import StepOptimizers
from lightning_cudagraph._graphs.step_pieces import (
    CaptureStep,
    EagerStep,
    NonFiniteFlags,
    ReplayStep,
    StepPlan,
    StepWindow,
)
from lightning_cudagraph._graphs.step_planner import StepPlanner
from lightning_cudagraph._graphs.step_replay import StepReplays, run_eagerly
from lightning_cudagraph._lightning import accumulating
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust.cadence import GraphChecks
from lightning_cudagraph._trust.evidence import StateWatch
from lightning_cudagraph._trust.guards import GuardSet
from lightning_cudagraph._trust.shadow import precision_state
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.shape_change import ShapeDecision
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import Stage


class WholeStepDriver(Driver):
    """Captures and replays whole training steps, one per batch signature and place in the accumulation window.

    With gradient accumulation, the first place zeroes the gradients and the last steps the optimizer; later places
    are captured once the first is, and add into the gradients its graph writes. ``compiled`` (``compile=``) holds
    the step's modules, compiled in place at :meth:`start` and on during training steps only.
    """

    def __init__(
        self,
        config: CUDAGraphConfig,
        backend: CaptureBackend,
        machine: StageMachine,
        settings: LevelSettings,
        compiled: CompiledModules | None = None,
    ) -> None:
        super().__init__(config, backend, machine, settings)
        self.compiled = compiled
        self.steps: ShapeCache[StepWindow] = self._shape_cache(StepWindow.reset)
        shapes = ShapeDecision(config.on_shape_change, self.steps, machine, config.component)
        self.planner = StepPlanner(machine, shapes)
        self.optimizers = StepOptimizers(
            backend,
            "the whole step",
            instead="use a scoped level (strategy='cudagraph' or scope=['layer']), whose optimizer step runs eagerly",
        )
        self.flags = NonFiniteFlags(self.backend.device)
        self.capture = StepCapture(backend, machine, self.flags)
        self.checks = GraphChecks(config.confirm_steps, config.audit_every_n_steps, self.report)
        self.replays = StepReplays(machine, self.optimizers, self.flags, self.checks)
        self.state = StateWatch()
        self._plan: StepPlan | None = None
        self._first: StepWindow | None = None
        self.binding = GradientBinding([])

    def start(self, trainer: pl.Trainer) -> None:
        """Switch optimizers to their capturable form for the whole fit, so their arithmetic never changes mid-run."""
        self.replays.checked_until = trainer.global_step
        if trainer.world_size > 1:  # the graph holds collectives, which NCCL's watchdog does not see
            timeout_s = getattr(trainer.strategy, "replay_timeout_s", None)
            self.replays.watchdog = ReplayWatchdog(timeout_s, self.report, trainer.global_rank, self.backend.marker)
        self.binding = GradientBinding(list(trainer.lightning_module.parameters()))
        for optimizer in trainer.optimizers:
            self.optimizers.prepare(optimizer)
        if self.compiled is not None:
            self.compiled.compile(called_modules(trainer.lightning_module))

    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Turn the compiled modules on for this training step (evaluation runs them as built)."""
        if self.compiled is not None:
            self.compiled.active = self.machine.graphs_allowed

    # ------------------------------------------------------------------ the plan (``batch_to_device``)
    def plan(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Decide what the next optimizer step does, and return the batch it should use (static buffers to replay)."""
        self._plan = None
        if not self.machine.graphs_allowed or not trainer.training or trainer.sanity_checking:
            return batch
        recheck, self.eager_next = self.eager_next, None
        self._plan, batch = self.planner.plan(trainer, batch, self.binding, self.eager_steps_needed(), recheck)
        return batch

    # ------------------------------------------------------------------ carrying it out (``optimizer_step``)
    def run(
        self, trainer: pl.Trainer, closure: Any, optimizer: torch.optim.Optimizer | None, run_step: Callable[[], Any]
    ) -> Any:
        """Run the optimizer step as planned: eagerly, or captured then replayed (manual: ``training_step`` itself)."""
        plan, self._plan = self._plan, None
        if plan is not None and not isinstance(plan, EagerStep) and accumulating(trainer) == plan.position.place.steps:
            plan = EagerStep(fallback=f"accumulation: the loop did not run the planned {plan.position.describe()}")
        if plan is None or isinstance(plan, EagerStep) or not self.machine.graphs_allowed:
            if self.machine.graphs_allowed and self.captured_any:
                self.report.steps_eager += 1
                if isinstance(plan, EagerStep) and plan.fallback is not None:
                    self.report.count_fallback(plan.fallback)
            output = run_eagerly(run_step)
            self.binding.after_eager()
            return output
        module = trainer.lightning_module
        # A micro-batch that only accumulates has no optimizer step in its graph: no setting of it to hold.
        moved = self.optimizers.moved() if plan.position.place.steps else None
        if moved is not None:  # a setting moved during the warmup steps (it moves every step) or since capture
            self.machine.rollback(self.optimizers.reason(moved))
            return run_eagerly(run_step)
        if isinstance(plan, CaptureStep):
            # Everything the step changes, copied before the capture: a capture that is not kept puts it back, and
            # the graph's first run is a shadow step from it, so no unchecked replay ever trains.
            state = self._state_before_step(trainer, module)
            first = self.machine.stage == Stage.WARMUP
            if not self._capture(plan, optimizer, run_step, module, state):
                return run_eagerly(run_step)
            if first:
                self._first = plan.window
                self.machine.begin_confirmation()
            return self._shadow(plan, trainer, closure, run_step, module, state)
        problem = self.state.problem()
        if problem is not None:
            self.machine.rollback(problem)
            return run_eagerly(run_step)
        if plan.position.place.zeroes and plan.whole.grads is not None:  # an eager step moved them: point them back
            self.binding.bind(plan.whole.grads)
        if self.checks.audit_due():
            state = self._state_before_step(trainer, module)
            return self._shadow(plan, trainer, closure, run_step, module, state)
        return self.replays.replay(plan.whole, trainer, closure, module, steps=plan.position.place.steps)

    def _shadow(
        self,
        plan: CaptureStep | ReplayStep,
        trainer: pl.Trainer,
        closure: Any,
        run_step: Callable[[], Any],
        module: Any,
        state: TrainingState,
    ) -> Any:
        """A shadow step; the eager step it keeps leaves its gradients in the graph's, for the window's later steps."""
        output = self.replays.shadow(plan.whole, trainer, closure, run_step, module, state, plan.position.place)
        if plan.whole.grads is not None and self.machine.graphs_allowed:  # not when the check rolled back
            self.binding.adopt(plan.whole.grads)
        return output

    def _state_before_step(self, trainer: pl.Trainer, module: Any) -> TrainingState:
        return TrainingState.take(module, self.optimizers.user, self.backend.device, precision_state(trainer))

    def _capture(
        self,
        plan: CaptureStep,
        optimizer: torch.optim.Optimizer | None,
        run_step: Callable[[], Any],
        module: Any,
        before: TrainingState,
    ) -> bool:
        whole, first = plan.whole, not self.captured_any
        if optimizer is not None:
            self.optimizers.prepare(optimizer)
        self.optimizers.refresh()  # a rate written as a number since the last step is the graph's input, not a constant
        self.before_capture()
        started = time.perf_counter()
        metrics = self.capture.capture(whole, run_step, module, before)
        if metrics is None:
            self.binding.forget()
            return False
        refusal = self.capture.refusal(whole, plan.position, self.binding, module.trainer.global_step, before.drawn())
        if refusal is not None:
            whole.reset()
            before.restore()
            self.binding.forget()
            self.machine.rollback(refusal)
            return False
        whole.grads = self.binding.gradients() if plan.position.place.zeroes else self.binding.bound
        plan.window.parts[plan.position] = whole
        if plan.key not in self.steps:
            self.steps.add(plan.key, plan.window)
        self.planner.captured(plan.key)
        if not self.count_capture(started, self.graph_count(), undo=before.restore):
            return False
        updated = metrics.changed()
        if updated:
            before.restore()
            self.machine.rollback(metric_in_graph(updated))
            return False
        self.optimizers.captured()  # what this graph bakes in
        whole.confirm_left = self.checks.captured()
        if first:  # later shapes must read the same tensors: a rebind in between is caught, not re-watched
            guards = GuardSet("the whole step", list(module.named_modules()), module, GUARD_FIX, clipping=True)
            self.state.watch_module(module, guards)
        rank_zero_info(f"{self.component}: captured the whole step for {plan.describe()}")
        return True

    def run_training_step(self, trainer: pl.Trainer, run_step: Callable[[], Any]) -> Any:
        """A manual ``training_step`` is the whole step: it runs as planned, as :meth:`run` runs an automatic one."""
        return self.run(trainer, None, None, run_step)

    def run_manual_update(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """An optimizer step inside the manual step: captured, or run eagerly, with the step that holds it."""
        return run_step()

    def on_backward(self, loss: Any) -> None:
        """While capturing a manual step: the loss gets the non-finite check."""
        self.capture.on_backward(loss)

    def why_not_captured(self) -> str | None:
        """Every batch had a signature of its own: a value that changes per batch is part of the whole step's key."""
        return None if self.captured_any else self.planner.why_not_captured()

    def graph_count(self) -> int:
        """Captured step graphs, every batch shape and place in the window."""
        return sum(len(window) for window in self.steps.values())

    @property
    def shape_cache(self) -> ShapeCache[StepWindow]:
        """The captured steps by batch shape."""
        return self.steps

    @property
    def capturing(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return self.capture.capturing

    @property
    def plans_capture(self) -> bool:
        """Whether the step just planned captures the whole step."""
        return isinstance(self._plan, CaptureStep)

    def on_training_step_output(self, output: Any) -> None:
        """While capturing: keep ``training_step`` 's output (static tensors) and add the non-finite check."""
        self.capture.on_training_step_output(output)

    def end_step(self, outputs: Any) -> None:
        """Confirm once the first shape replayed ``confirm_steps`` times (its parameters checked before each)."""
        if self.compiled is not None:
            self.compiled.active = False
        if not self.machine.graphs_allowed:
            return
        window, accumulate = self._first, self.planner.position.accumulate
        if self.machine.stage == Stage.CONFIRMING and window is not None and window.confirmed(accumulate):
            count, first = self.flags.read_and_clear()  # the decision's one host sync
            self.machine.confirm(graphs=self.report.graphs, nonfinite_first_step=first if count else None)

    def seal(self, self_check: bool) -> None:
        """Close the set of batch shapes (a whole step has no forward to compare apart: no parity self-check)."""
        self.steps.seal()

    def health_check(self, step: int) -> None:
        """Read the in-graph non-finite counter (one host sync per log interval, once a step is captured)."""
        if len(self.steps) and self.machine.graphs_allowed:
            self.replays.check_finite(step)

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        self.optimizers.save_checkpoint(optimizers, checkpoint)

    def release(self) -> None:
        """Reset every step graph and give the optimizers and compiled modules back (even when a reset fails)."""
        self._plan = self._first = None
        if self.replays.watchdog is not None:
            self.replays.watchdog.close()
        self.capture.release()
        self.binding.forget()
        self.state.release()
        steps = self.steps.clear()
        try:
            for window in steps:
                window.reset()
        finally:
            self.report.graphs = 0
            if self.compiled is not None:
                self.compiled.restore()
            self.optimizers.restore()

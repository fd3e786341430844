"""The optimizer step of a scoped fit as its own graph, replayed after the eager backward.

While the package's strategy runs Lightning's optimizer step, the torch optimizer's ``step`` is Lightning's closure
(``training_step``, backward, clipping: eager, regions replayed inside), a copy of the fresh gradients into the
graph's static buffers, and the replay. The optimizer is capturable for the whole fit, so schedulers reach the graph
through device learning rates. The capture step, the next ``confirm_steps - 1`` and each audit replay from a copy of
the state, put it back and compare with the eager update, which training keeps. The callback alone cannot own the
optimizer step, so nothing here runs without the package's strategy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_cudagraph._backend.backend import CaptureBackend, StepGraph
from lightning_cudagraph._graphs.optimizer_update import (
    eager_update_of,
    optimizer_step_replaced,
    state_error,
    unfit_reason,
)
from lightning_cudagraph._graphs.step_optimizers import StepOptimizers
from lightning_cudagraph._graphs.step_replay import run_eagerly
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust.cadence import GraphChecks
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph._trust.tolerance import STEP_TOL
from lightning_cudagraph._warnings import warn_user

__all__ = ["OptimizerGraph"]

#: ``report.optimizer_graph`` before the graph is captured, while it is checked, and in steady state.
WAITING, CONFIRMING, REPLAYING = "waiting", "confirming", "replaying"
#: The optimizer's update runs in full precision whatever the step's autocast, so the full-precision tolerance holds.
OPTIMIZER_TOL = STEP_TOL["full"]
#: ``report.optimizer_graph`` when the user turned it off (``optimizer_graph=False``).
OPTION_OFF = "optimizer_graph=False"


class OptimizerGraph:
    """Captures a scoped fit's optimizer update once and replays it after each eager backward."""

    def __init__(self, config: CUDAGraphConfig, backend: CaptureBackend, machine: StageMachine) -> None:
        self.config, self.component, self.backend, self.machine = config, config.component, backend, machine
        self.report = machine.report
        self.optimizers = StepOptimizers(
            backend,
            "the optimizer graph",
            instead="train through CUDAGraphCallback alone, whose optimizer step runs eagerly",
        )
        self._optimizer: torch.optim.Optimizer | None = None
        self._graph: StepGraph | None = None
        self._params: list[Tensor] = []
        self._has_grad: list[bool] = []
        self._static_grads: list[Tensor] = []
        self._confirm_left = 0
        self.checks = GraphChecks(
            config.confirm_steps, config.audit_every_n_steps, self.report, parity="optimizer_parity_err"
        )
        self.off_reason: str | None = None
        #: Where the graph is (``waiting``, ``confirming``, ``replaying``, or why it is off); the report mirrors it.
        self.state: str | None = None

    # ------------------------------------------------------------------ the step (the strategy's optimizer_step)
    def run(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, run_step: Callable[[], Any], graphs_live: bool
    ) -> Any:
        """Run Lightning's optimizer step; once ``graphs_live`` (scoped graphs captured), the update as a graph."""
        if self.off_reason is None:
            self._turn_off_if_unfit(trainer, optimizer)
        if self.off_reason is not None or not self.machine.graphs_allowed:
            return run_step()
        self.optimizers.prepare(optimizer)  # from the first step: eager and graphed updates share their arithmetic
        if not graphs_live:
            return run_eagerly(run_step)
        module = trainer.lightning_module
        eager_update = eager_update_of(optimizer)

        def step(closure: Callable[[], Any] | None = None) -> Any:
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            if closure is not None and loss is None:  # training_step skipped the batch: no gradient to update with
                self.report.count_fallback("skipped_step: training_step returned None, so the update runs eagerly")
                eager_update()
                return loss
            self._update(module, optimizer, eager_update)
            return loss

        with optimizer_step_replaced(optimizer, step):
            return run_eagerly(run_step)

    def _update(self, module: Any, optimizer: torch.optim.Optimizer, eager_update: Callable[[], Any]) -> None:
        """The update of one step, after the closure: replayed, captured then checked, or eager (counted)."""
        if self._graph is None:
            self._capture(module, optimizer, eager_update)
            return
        moved = self.optimizers.moved()
        if moved is not None:
            eager_update()
            self.machine.rollback(self.optimizers.reason(moved))
            return
        check_due = self._confirm_left > 0 or self.checks.audit_due()
        grads = [p.grad for p in self._params]  # one pass over the parameters: checked, then copied
        differ = self._grads_differ(module, grads)
        if differ is not None:
            self.report.count_fallback(differ)
            eager_update()
            if check_due:  # every rank takes its checks at the same steps: this one has nothing to check
                self._weigh(None)
        elif check_due:
            self._shadow(module, eager_update)
        else:
            self._replay(grads)

    def _replay(self, grads: list[torch.Tensor | None]) -> None:
        assert self._graph is not None, "the optimizer graph replays only once captured"
        with torch.no_grad():
            torch._foreach_copy_(self._static_grads, [g for g in grads if g is not None])
        self.optimizers.refresh()
        self._graph.replay()
        self.report.optimizer_replays += 1

    # ------------------------------------------------------------------ capture and its checks
    def _capture(self, module: Any, optimizer: torch.optim.Optimizer, eager_update: Callable[[], Any]) -> None:
        """Capture the update on the gradients of this step, then check its first replay against the eager update."""
        moved = self.optimizers.moved()
        if moved is not None:  # it moved during the eager steps: it moves every step, and stays eager
            self._turn_off(f"optimizer_not_graphed: {moved.what} between steps")
            eager_update()
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        if any(g.is_sparse for g in grads) or any(not optimizer.state.get(p) for p in with_grad):
            eager_update()  # a parameter's state is made by its first eager update: capture on a later step
            return
        self._params, self._has_grad = params, [p.grad is not None for p in params]
        with torch.no_grad():
            self._static_grads = [g.detach().clone() for g in grads]
        real = [p.grad for p in params]
        state = TrainingState.take(module, [optimizer], self.backend.device)
        self.optimizers.refresh()  # a rate written as a number since the last step is the graph's input, not a constant
        started, error = time.perf_counter(), None
        try:
            for p, static in zip(with_grad, self._static_grads, strict=True):
                p.grad = static
            with self.backend.failure_guard():
                self._graph = self.backend.capture_step(lambda: run_eagerly(eager_update))
        except Exception as err:  # the update stays eager; the regions keep their graphs
            error = err
        finally:
            for p, grad in zip(params, real, strict=True):
                p.grad = grad
            elapsed = (time.perf_counter() - started) * 1e3
            self.report.capture_ms_total += elapsed
        if not self.machine.agreement.all_ok(error is None):
            state.restore()
            self._reset_graph()
            error = error or RuntimeError("the capture failed on another rank")
            reason = f"optimizer_not_graphed: its capture failed: {type(error).__name__}: {error}"
            if self.machine.policy.part_failure_stops_graphs:
                self.machine.rollback(reason, error)
                return
            self._turn_off(reason)
            eager_update()
            return
        self.optimizers.captured()
        self._confirm_left = self.checks.captured()
        self._set_state(CONFIRMING)
        rank_zero_info(f"{self.component}: captured the optimizer step ({len(grads)} parameters) in {elapsed:.1f} ms")
        self._shadow(module, eager_update, state)

    def _shadow(self, module: Any, eager_update: Callable[[], Any], state: TrainingState | None = None) -> None:
        """Replay from a copy of the weights and optimizer state, put it back, run the eager update; compare them.

        Training keeps the eager update, so a graph that fails the check never touched the weights.
        """
        optimizer = self._optimizer
        assert optimizer is not None, "the optimizer graph checks the optimizer it captured"
        if state is None:
            state = TrainingState.take(module, [optimizer], self.backend.device)
        moving = [(value, saved) for _, _, value, saved in state.optimizer_state if isinstance(value, Tensor)]
        self._replay([p.grad for p in self._params])
        graph_params = state.parameters_now()
        graph_state = [value.detach().clone() for value, _ in moving]
        state.restore()
        eager_update()
        params_error = state.update_error_of(graph_params).float()
        error = torch.maximum(params_error, state_error(moving, graph_state).to(params_error.device))
        self._weigh(float(error))  # the decision's one host sync

    def _weigh(self, value: float | None) -> None:
        """Count a check of difference ``value`` (``None``: none on this rank); roll back unless every rank's passed."""
        self._confirm_left -= 1
        if value is not None:
            self.checks.checked(value)
        if not self.machine.agreement.all_ok(value is None or value <= OPTIMIZER_TOL):
            by = "on another rank" if value is None or value <= OPTIMIZER_TOL else f"by {value:.3g}"
            self.machine.rollback(
                f"optimizer_parity: the optimizer graph's update is off the eager update from the same state on the"
                f" same gradients {by} (allowed {OPTIMIZER_TOL:g}); the eager update was kept. A graph that reads a"
                " stale gradient buffer or a frozen setting does this"
            )
        elif self._confirm_left <= 0 and self.state == CONFIRMING:
            self._set_state(REPLAYING)

    def _grads_differ(self, module: Any, grads: list[torch.Tensor | None]) -> str | None:
        """A fallback reason when the parameters with a gradient are not those of the capture (host work only)."""
        if all((g is not None) is had for g, had in zip(grads, self._has_grad, strict=True)):
            return None
        names = {id(p): name for name, p in module.named_parameters()}
        pairs = list(zip(self._params, self._has_grad, strict=True))
        missing = [names.get(id(p), "?") for p, had in pairs if had and p.grad is None]
        new = [names.get(id(p), "?") for p, had in pairs if not had and p.grad is not None]
        what = f"no gradient for {missing[:3]}" if missing else f"a gradient for {new[:3]}, which had none at capture"
        return (
            f"optimizer_grads_differ: the optimizer graph was captured for other parameters ({what}); this step's"
            " update ran eagerly, so no parameter moves on a stale gradient"
        )

    # ------------------------------------------------------------------ eligibility
    def _turn_off_if_unfit(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Turn the graph off for the fit, once, when this step's optimizer cannot be captured as it is."""
        if self._optimizer is optimizer:
            return
        self._optimizer, first = optimizer, self._optimizer is None
        if not self.config.optimizer_graph:
            self.off_reason = OPTION_OFF  # the user's choice: nothing to warn about
            self._set_state(OPTION_OFF)
            return
        problem = unfit_reason(trainer, optimizer) if first else "the fit steps more than one optimizer"
        if problem is not None:
            self._turn_off(f"optimizer_not_graphed: {problem}")
            self.optimizers.restore()
        elif self.state is None:
            self._set_state(WAITING)

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self._set_state(reason)
        self._reset_graph()
        if not reason.startswith("optimizer_not_graphed: manual"):
            warn_user(f"{self.component}: the optimizer step stays eager, the regions keep their graphs: {reason}")

    # ------------------------------------------------------------------ levels, checkpoints, release
    def _reset_graph(self) -> None:
        graph, self._graph = self._graph, None
        self._static_grads = []
        if graph is not None:
            graph.reset()

    def _set_state(self, state: str) -> None:
        self.state = self.report.optimizer_graph = state

    def regions_captured(self) -> None:
        """Regions were captured (another shape, or another level in a new pool): the update is captured after them."""
        self._reset_graph()
        if self.off_reason is None and self.state is not None:
            self._set_state(WAITING)

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        self.optimizers.save_checkpoint(optimizers, checkpoint)

    def release(self) -> None:
        """Free the graph and give the optimizer back as built (idempotent)."""
        try:
            self._reset_graph()
        finally:
            self._params, self._has_grad = [], []
            self.optimizers.restore()

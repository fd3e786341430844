"""Replays of a captured whole step, and the checks of them: shadow steps against eager, the non-finite counter."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_cudagraph._backend.backend import StepGraph
from lightning_cudagraph._backend.watchdog import ReplayWatchdog
from lightning_cudagraph._graphs.accumulation import Place
from lightning_cudagraph._graphs.step_optimizers import StepOptimizers
from lightning_cudagraph._graphs.step_pieces import NonFiniteFlags, WholeStep
from lightning_cudagraph._lightning import set_closure_result, step_loss
from lightning_cudagraph._trust.cadence import GraphChecks
from lightning_cudagraph._trust.failure import GraphFailure
from lightning_cudagraph._trust.shadow import compare
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.stages import StageMachine


class StepReplays:
    """Replays captured whole steps, and checks them with shadow steps, each counted in ``checks``."""

    def __init__(
        self, machine: StageMachine, optimizers: StepOptimizers, flags: NonFiniteFlags, checks: GraphChecks
    ) -> None:
        self.machine, self.optimizers, self.flags, self.checks = machine, optimizers, flags, checks
        self.report = machine.report
        #: Watches replays under several ranks, where a graph holds collectives (``None`` in one process).
        self.watchdog: ReplayWatchdog | None = None
        #: The first step the next non-finite check covers.
        self.checked_until = 0

    def replay(
        self, whole: WholeStep, trainer: pl.Trainer, closure: Any, module: Any, reissue: bool = True, steps: bool = True
    ) -> Any:
        """Replay ``whole`` on its static batch; with ``reissue``, hand Lightning the output and the logs.

        ``steps``: whether the graph holds the optimizer step (a micro-batch that only accumulates has none).
        """
        if steps:
            self.optimizers.refresh()
        self.flags.current_step.fill_(trainer.global_step)
        if whole.graph is None:
            raise RuntimeError("a whole step replays only once it is captured")
        self._watched_replay(whole.graph, trainer.global_step)
        self.report.replays += 1
        self.report.steps_replayed += 1
        output = whole.output_copy()
        if reissue:
            if closure is not None:  # manual optimization has no closure: training_step's output goes to the loop
                set_closure_result(closure, output, trainer.accumulate_grad_batches)
            whole.updates.reissue()
            whole.logs.reissue(module)
        whole.confirm_left -= 1
        return output

    def _watched_replay(self, graph: StepGraph, step: int) -> None:
        """Replay ``graph``; under several ranks the watchdog sees it launch and finish (no host sync)."""
        watchdog = self.watchdog
        if watchdog is None:
            graph.replay()
            return
        watchdog.started(step)
        try:
            graph.replay()
        except Exception as error:
            if watchdog.fired is not None:  # the watchdog aborted the collective this replay was waiting in
                raise GraphFailure(watchdog.fired) from error
            raise
        watchdog.finished()

    def shadow(
        self,
        whole: WholeStep,
        trainer: pl.Trainer,
        closure: Any,
        run_step: Callable[[], Any],
        module: Any,
        state: TrainingState,
        place: Place = Place.SINGLE,
    ) -> Any:
        """Check the graph against the eager step from the same state on the same batch; train on the eager one.

        The graph replays from ``state`` (a copy of everything the step changes); its loss, parameters and (for a
        ``place`` that only accumulates) gradients are kept, the copy is put back and the step runs eagerly, so a
        graph that fails the check never touched the weights.
        """
        whole.shadowed = True
        graphed = self.replay(whole, trainer, closure, module, reissue=False, steps=place.steps)
        graph_loss, graph_params = step_loss(graphed), state.parameters_now()
        graph_grads = None if place.steps else state.gradients_now()
        if graph_loss is not None:  # Lightning's closure hands back the loss divided by the window's length
            graph_loss = graph_loss / trainer.accumulate_grad_batches
        state.restore()
        output = run_eagerly(run_step)
        state.keep_gradient_buffers()
        verdict = compare(trainer, state, graph_params, graph_loss, step_loss(output), graph_grads, place.zeroes)
        self.checks.checked(verdict.error)
        if self.machine.agreement.any_of([not verdict.passed])[0]:  # FSDP2's ranks weigh different shards
            step = trainer.global_step
            elsewhere = f"parity: the whole-step graph failed its shadow check on another rank at step {step}"
            self.machine.rollback(elsewhere if verdict.passed else verdict.reason(step))
        return output

    def check_finite(self, step: int) -> None:
        """Read the in-graph non-finite counter (one host sync); roll back every rank if one saw a non-finite loss."""
        count, first = self.flags.read_and_clear()
        since, self.checked_until = self.checked_until, step
        if count:
            self.report.nonfinite.append((first, count))
        if self.machine.agreement.any_of([count > 0])[0]:  # every rank rolls back, or none
            where = f"first at step {first}" if count else "on another rank"
            self.machine.rollback(f"nonfinite_loss: {count} non-finite loss(es) in steps {since}-{step - 1}, {where}")


def run_eagerly(run_step: Callable[[], Any]) -> Any:
    """Run an optimizer step eagerly; the optimizer is capturable, which PyTorch would warn about on every fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        return run_step()

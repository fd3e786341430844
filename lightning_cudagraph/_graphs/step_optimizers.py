"""The optimizers of a captured whole step: capturable for the fit, their baked-in settings watched, given back.

The whole step captures the optimizer's kernels too, so each optimizer is switched to its capturable form once, at
the start of the fit (its arithmetic never changes mid-run). A graph bakes in every setting but ``lr``: a setting
that moves after the capture is a rollback reason. Checkpoints keep the optimizers as the user built them.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch

from lightning_cudagraph._backend.backend import CaptureBackend, PreparedOptimizer
from lightning_cudagraph._backend.optimizers import OptimizerSettings, describe_step_hooks, step_hooks


class Moved(NamedTuple):
    """What moved since a graph of the optimizer step was captured: a step hook (``hook``) or a setting."""

    hook: bool
    what: str


class StepOptimizers:
    """The optimizers one graph of their step prepared, and their settings when it was captured (or at start).

    Args:
        graph: The graph that bakes the optimizer step in, as messages name it.
        instead: The fix that keeps the optimizer step eager, as messages give it.
    """

    def __init__(self, backend: CaptureBackend, graph: str, instead: str) -> None:
        self._backend, self.graph, self.instead = backend, graph, instead
        self.prepared: dict[int, PreparedOptimizer] = {}
        #: The optimizers as the user holds them.
        self.user: list[torch.optim.Optimizer] = []
        self._settings: dict[int, OptimizerSettings] = {}
        self._hooks: dict[int, tuple[int, int, int, int]] = {}

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Switch ``optimizer`` to its capturable form, once for the fit."""
        if id(optimizer) not in self.prepared:
            self.prepared[id(optimizer)] = self._backend.prepare_optimizer(optimizer)
            self.user.append(optimizer)
            self._settings[id(optimizer)] = OptimizerSettings.of(optimizer)
            self._hooks[id(optimizer)] = step_hooks(optimizer)

    def moved(self) -> Moved | None:
        """What moved since the settings were taken: a step hook or a setting (``None``: nothing)."""
        for optimizer in self.user:
            if step_hooks(optimizer) != self._hooks[id(optimizer)]:
                return Moved(hook=True, what=describe_step_hooks(optimizer) or "an optimizer step hook was removed")
            change = self._settings[id(optimizer)].change(OptimizerSettings.of(optimizer))
            if change is not None:
                return Moved(hook=False, what=f"{type(optimizer).__name__} {change}")
        return None

    def reason(self, moved: Moved) -> str:
        """The rollback reason of what :meth:`moved` since capture (a graph bakes in hooks and every setting but lr)."""
        what = moved.what
        if moved.hook:
            return (
                f"step_python: {what} since {self.graph} was captured, and a replay runs no hook. Fix: register hooks"
                f" before the fit, or {self.instead}"
            )
        return (
            f"optimizer_setting_changed: {what} after {self.graph} was captured; a graph replays the optimizer with the"
            " settings it was captured with (only lr is read from the device). Fix: keep it fixed"
            f" (OneCycleLR/CyclicLR(cycle_momentum=False)), or {self.instead}"
        )

    def captured(self) -> None:
        """A graph was captured: its settings are what later steps are held to."""
        for optimizer in self.user:
            self._settings[id(optimizer)] = OptimizerSettings.of(optimizer)
            self._hooks[id(optimizer)] = step_hooks(optimizer)

    def refresh(self) -> None:
        """Before a replay: take user-assigned hyperparameters (``lr``) into the captured state (no host sync)."""
        for optimizer in self.prepared.values():
            optimizer.refresh()

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Rewrite the saved optimizer states into the form the user built the optimizers in."""
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            prepared = self.prepared.get(id(optimizer))
            if prepared is not None:
                prepared.plain_state_dict(state)

    def restore(self) -> None:
        """Give every optimizer back as it was built (idempotent)."""
        prepared, self.prepared = list(self.prepared.values()), {}
        for optimizer in prepared:
            optimizer.restore()


class Schedule:
    """The learning rates and scheduler positions of a fit, taken before a manual ``training_step`` is captured.

    A manual ``training_step`` may step its schedulers or write a rate itself; inside a whole-step graph that Python
    runs once, at capture, and a replay would keep the rate where the capture left it. :meth:`moved` names such a
    step before any replay, and :meth:`restore` undoes what the capture's Python did.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._groups = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
        self._rates = [group["lr"] for group in self._groups]
        self._schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._states = [copy.deepcopy(scheduler.state_dict()) for scheduler in self._schedulers]

    def moved(self) -> str | None:
        """What the step moved: a scheduler it stepped, or a rate it wrote (``None``: nothing)."""
        for scheduler, state in zip(self._schedulers, self._states, strict=True):
            if getattr(scheduler, "last_epoch", None) != state.get("last_epoch"):
                position = f"last_epoch {state.get('last_epoch')} to {scheduler.last_epoch}"
                return f"stepped {type(scheduler).__name__} ({position})"
        for index, (group, rate) in enumerate(zip(self._groups, self._rates, strict=True)):
            if group["lr"] is not rate:
                return f"wrote the learning rate of parameter group {index} ({group['lr']})"
        return None

    def restore(self) -> None:
        """Put the rates and the schedulers back as they were before the capture."""
        for group, rate in zip(self._groups, self._rates, strict=True):
            group["lr"] = rate
        for scheduler, state in zip(self._schedulers, self._states, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))


def schedule_moved(moved: str, step: int) -> str:
    """The rollback reason of a manual step that moved the schedule (:meth:`Schedule.moved`) at its capture."""
    return (
        f"step_python: training_step {moved} at the captured step {step}; a whole-step graph runs that Python once,"
        " so every replay would keep the rate the capture left. Fix: step schedulers or write rates in"
        " on_train_batch_start or on_train_batch_end, which run every step outside the graph (the graph reads the"
        " rate from the device), or use a scoped level (strategy='cudagraph' or scope=['layer'])"
    )

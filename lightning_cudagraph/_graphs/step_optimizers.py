"""The optimizers of a captured whole step: capturable for the fit, their baked-in settings watched, given back.

The whole step captures the optimizer's kernels too, so each optimizer is switched to its capturable form once, at
the start of the fit (its arithmetic never changes mid-run). A graph bakes in every setting but ``lr``: a setting
that moves after the capture is a rollback reason. Checkpoints keep the optimizers as the user built them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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

"""Every place the package touches Lightning internals, behind one fence, so a Lightning upgrade is one file.

- A replayed step never runs Lightning's closure, yet the loop consumes the closure's result; the result is
  rebuilt from the step's output (NeMo's Lightning callback does the same).
- ``self.log`` calls made by a captured ``training_step`` are recorded instead of run (logging a number copies it
  to the GPU, which a capture forbids), then re-issued after each replay as if ``training_step`` made them.
- A LightningModule's Trainer is read before ``Trainer.lightning_module`` is set; a single-device strategy's
  device is read where Lightning keeps it; anomaly detection is read from the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor

#: A ``self.log`` call recorded during a capture: ``(name, value, args, kwargs)``.
LogCall = tuple[str, Any, tuple[Any, ...], dict[str, Any]]


def step_loss(output: Any) -> Tensor | None:
    """The loss of a ``training_step`` output (a tensor, or a dict with ``"loss"``), or ``None``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss if isinstance(loss, Tensor) else None


def set_closure_result(closure: Any, output: Any, normalize: int) -> None:
    """Hand Lightning's training loop the result of a step that ran as a graph replay."""
    if not isinstance(closure, Closure):
        raise RuntimeError(
            "lightning_cudagraph full_iteration: optimizer_step received a closure of type"
            f" {type(closure).__name__}, not Lightning's training closure. A LightningModule.optimizer_step override"
            " must pass `optimizer_closure` on unchanged: `optimizer.step(closure=optimizer_closure)`."
        )
    closure._result = ClosureResult.from_training_step_output(output, normalize)


@contextlib.contextmanager
def logs_recorded(module: pl.LightningModule, logs: list[LogCall]) -> Iterator[None]:
    """Record ``module.log`` calls into ``logs`` instead of running them."""
    had_attribute = "log" in module.__dict__
    previous = module.__dict__.get("log")

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logs.append((name, value, args, kwargs))

    module.log = record
    try:
        yield
    finally:
        if had_attribute:
            module.log = previous
        else:
            del module.log


def relog(module: pl.LightningModule, logs: list[LogCall]) -> None:
    """Re-issue recorded ``self.log`` calls, attributed to ``training_step`` so they join the same metrics."""
    if not logs:
        return
    previous = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        for name, value, args, kwargs in logs:
            module.log(name, value, *args, **kwargs)
    finally:
        module._current_fx_name = previous


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer a module is attached to, also while ``Strategy.connect`` runs (before the Trainer says so)."""
    return module._trainer


def single_device_root(strategy: SingleDeviceStrategy) -> torch.device:
    """The device a :class:`SingleDeviceStrategy` was built with."""
    return strategy._root_device


def anomaly_detection_on(trainer: pl.Trainer) -> bool:
    """Whether ``Trainer(detect_anomaly=True)`` was passed."""
    return bool(getattr(trainer, "_detect_anomaly", False))

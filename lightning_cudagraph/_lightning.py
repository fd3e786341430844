"""The two places where the package touches Lightning internals, kept here so a Lightning upgrade is one file.

- A replayed step never runs Lightning's closure, yet the loop consumes the closure's result; the result is
  rebuilt from the step's output (NeMo's Lightning callback does the same).
- Re-issued ``self.log`` calls must be attributed to ``training_step``, the hook that made them, so their values
  join the same metric (and epoch aggregate) as in eager steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult


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
def logging_as(module: pl.LightningModule, hook: str) -> Iterator[None]:
    """Let ``module.log`` calls count as made from ``hook``."""
    previous = module._current_fx_name
    module._current_fx_name = hook
    try:
        yield
    finally:
        module._current_fx_name = previous

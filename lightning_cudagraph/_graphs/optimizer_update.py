"""How the optimizer graph meets the user's optimizer: its step replaced, its rules, its settings, its update."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_cudagraph._backend.optimizers import unfit_optimizer

__all__ = ["eager_update_of", "optimizer_step_replaced", "state_error", "unfit_reason"]


@contextlib.contextmanager
def optimizer_step_replaced(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> Iterator[None]:
    """``optimizer.step`` is ``step`` inside the block; on every exit it is what it was (the class's, or the user's)."""
    own = vars(optimizer)  # an instance attribute shadows the class's step; the class is left alone
    had, previous = "step" in own, own.get("step")
    own["step"] = step
    try:
        yield
    finally:
        if had:
            own["step"] = previous
        else:
            own.pop("step", None)


def eager_update_of(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """The optimizer's own update, without a closure (the user's ``step`` when they set one on the instance)."""
    own = vars(optimizer).get("step")
    if own is not None:
        return lambda: own()
    return lambda: type(optimizer).step(optimizer)


def state_error(moving: list[tuple[Tensor, Tensor]], graph_state: list[Tensor]) -> Tensor:
    """Largest relative difference between the graph's and the eager update's optimizer state (no host sync)."""
    errors = []
    for (eager, before), graphed in zip(moving, graph_state, strict=True):
        if not eager.is_floating_point() or not eager.numel():
            continue
        now, start = eager.detach().float(), before.float()
        scale = (now - start).norm().clamp_min(1e-7 * start.norm() + 1e-12)
        errors.append((graphed.float() - now).norm().to(now.device) / scale)
    if not errors:
        return torch.zeros((), device=moving[0][0].device if moving else None)
    return torch.stack([e.to(errors[0].device) for e in errors]).max()


def unfit_reason(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer step cannot be a graph of its own (:func:`unfit_optimizer`), or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
    automatic = trainer.lightning_module.automatic_optimization
    unfit = unfit_optimizer(optimizer, automatic=automatic, grad_scaler=scaler, whole_step=False)
    return None if unfit is None else unfit.what

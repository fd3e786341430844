"""The shadow step: a whole-step graph checked against the eager step from the same state, on the same batch.

The graph replays from a copy of the training state; its loss and parameters are kept, the copy is put back, and the
eager step, which training keeps, runs. The whole-step driver runs it on every capture step and every
``audit_every_n_steps`` replayed steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.tolerance import step_tolerance


@dataclass(frozen=True)
class Verdict:
    """How a shadow step came out."""

    error: float
    tolerance: float
    losses: tuple[float, float] | None = None

    @property
    def passed(self) -> bool:
        """Whether the graph agreed with eager (a NaN never does)."""
        return self.error <= self.tolerance

    def reason(self, step: int) -> str:
        """The rollback reason of a failed shadow step."""
        where = f" (loss {self.losses[0]:.6g} graphed, {self.losses[1]:.6g} eager)" if self.losses else ""
        return (
            f"parity: the whole-step graph is off the eager step from the same state by {self.error:.3g} (allowed"
            f" {self.tolerance:g}) at step {step}{where}; the eager step was kept. A graph that reads a stale"
            " buffer, a frozen setting or a wrong batch does this"
        )


def compare(
    trainer: pl.Trainer,
    state: TrainingState,
    graph_params: list[Tensor],
    graph_loss: Tensor | None,
    eager_loss: Tensor | None,
    graph_grads: list[Tensor | None] | None = None,
    zeroed: bool = True,
) -> Verdict:
    """Weigh the graph's step (``graph_params``, ``graph_loss``) against the eager step now in ``state`` 's tensors.

    The difference is the largest relative one of the parameter update, the loss and, for a micro-batch that only
    accumulates, the gradients (``graph_grads``; all of each gradient counts when the step ``zeroed`` them first).
    One host sync reads it.
    """
    error = state.update_error_of(graph_params).float()
    if graph_grads is not None:
        error = torch.maximum(error, state.gradient_error_of(graph_grads, zeroed).float().to(error.device))
    figures = [error]
    if graph_loss is not None and eager_loss is not None:
        graph, eager = graph_loss.detach().float().to(error.device), eager_loss.detach().float().to(error.device)
        error = torch.maximum(error, ((graph - eager).abs().max() / eager.abs().max().clamp_min(1e-6)).reshape(()))
        figures = [error, graph.mean(), eager.mean()]
    value, *losses = torch.stack(figures).tolist()  # the one host sync
    tolerance = step_tolerance(trainer.precision)
    return Verdict(value, tolerance, (losses[0], losses[1]) if losses else None)


def precision_state(trainer: pl.Trainer) -> list[Tensor]:
    """Device tensors of the precision plugin that a step moves (the grad scaler's scale and growth tracker)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    held = (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
    return [t for t in held if isinstance(t, Tensor)]

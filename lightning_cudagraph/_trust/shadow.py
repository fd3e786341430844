"""The shadow step: a whole-step graph checked against the eager step from the same state, on the same batch.

The graph replays from a copy of the training state; its loss and parameters are kept, the copy is put back, and the
eager step, which training keeps, runs. The whole-step driver runs it on every capture step and every
``audit_every_n_steps`` replayed steps.

A check reads one number back to the host, whatever the model's size: the largest difference, from fused reductions
over every parameter. Only a check that failed reads the per-parameter differences, to name the first one off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_cudagraph._trust.fused import Differences
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.tolerance import step_tolerance


@dataclass(frozen=True)
class Verdict:
    """How a shadow step came out."""

    error: float
    tolerance: float
    losses: tuple[float, float] | None = None
    #: The first parameter (in the module's order) whose update or gradient is off, and by how much; failed checks only.
    culprit: tuple[str, float] | None = None

    @property
    def passed(self) -> bool:
        """Whether the graph agreed with eager (a NaN never does)."""
        return self.error <= self.tolerance

    def reason(self, step: int) -> str:
        """The rollback reason of a failed shadow step."""
        where = f" (loss {self.losses[0]:.6g} graphed, {self.losses[1]:.6g} eager)" if self.losses else ""
        if self.culprit is not None:
            where += f"; first off: {self.culprit[0]}, by {self.culprit[1]:.3g}"
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
    One host sync reads it; a failed check reads the per-parameter differences too, to name the first one off.
    """
    weighed = [state.update_errors(graph_params)]
    error = weighed[0].largest().float()
    if graph_grads is not None:
        weighed.append(state.gradient_errors(graph_grads, zeroed))
        error = torch.maximum(error, weighed[1].largest().float().to(error.device))
    figures = [error]
    if graph_loss is not None and eager_loss is not None:
        graph, eager = graph_loss.detach().float().to(error.device), eager_loss.detach().float().to(error.device)
        error = torch.maximum(error, ((graph - eager).abs().max() / eager.abs().max().clamp_min(1e-6)).reshape(()))
        figures = [error, graph.mean(), eager.mean()]
    value, *losses = torch.stack(figures).tolist()  # the one host sync
    tolerance = step_tolerance(trainer.precision)
    verdict = Verdict(value, tolerance, (losses[0], losses[1]) if losses else None)
    return verdict if verdict.passed else replace(verdict, culprit=first_off(weighed, tolerance))


def first_off(weighed: list[Differences], tolerance: float) -> tuple[str, float] | None:
    """The first parameter whose update (or then gradient) is over ``tolerance``, and its difference (host syncs).

    ``None`` when none is: the loss alone disagreed, or a NaN was only in the loss.
    """
    found = [hit for differences in weighed if (hit := differences.first_over(tolerance)) is not None]
    if not found:
        return None
    _, what, value = min(found, key=lambda hit: hit[0])
    return what, value


def precision_state(trainer: pl.Trainer) -> list[Tensor]:
    """Device tensors of the precision plugin that a step moves (the grad scaler's scale and growth tracker)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    held = (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
    return [t for t in held if isinstance(t, Tensor)]

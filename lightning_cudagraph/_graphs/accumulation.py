"""Gradient accumulation inside the whole step: one graph per place in the accumulation window.

The micro-batches of a window do different work (the first zeroes the gradients, the last steps the optimizer), so each
place of a batch shape gets its own whole-step graph. The graphs of one window must add into the gradient tensors the
first one writes: :class:`GradientBinding` tracks which tensors the parameters' ``.grad`` are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_cudagraph._lightning import upcoming_batch

__all__ = ["GradientBinding", "Place", "Position"]


class Place(enum.Enum):
    """Where a micro-batch sits in its accumulation window, by the work it does."""

    #: Zeroes the gradients and steps the optimizer: no accumulation, or a window of one micro-batch.
    SINGLE = "single"
    FIRST = "first"
    MIDDLE = "middle"
    #: Adds its gradients, then clips and steps.
    LAST = "last"

    @property
    def zeroes(self) -> bool:
        """Whether the micro-batch zeroes the gradients first (it starts a window)."""
        return self in (Place.SINGLE, Place.FIRST)

    @property
    def steps(self) -> bool:
        """Whether the micro-batch ends with the optimizer step."""
        return self in (Place.SINGLE, Place.LAST)


@dataclass(frozen=True)
class Position:
    """A micro-batch's place in its window, and the window's length (a graph bakes in the loss divided by it).

    Example:
        >>> Position.at(index=5, accumulate=4, last_batch=False)
        Position(place=<Place.MIDDLE: 'middle'>, accumulate=4)
        >>> Position.at(index=0, accumulate=1, last_batch=False).place
        <Place.SINGLE: 'single'>
    """

    place: Place
    accumulate: int

    @classmethod
    def at(cls, index: int, accumulate: int, last_batch: bool) -> Position:
        """The position of the micro-batch with index ``index`` in the epoch (Lightning's rule)."""
        zeroes = index % accumulate == 0
        steps = (index + 1) % accumulate == 0 or last_batch  # Lightning steps on an epoch's last batch
        place = {(True, True): Place.SINGLE, (True, False): Place.FIRST, (False, False): Place.MIDDLE}
        return cls(place.get((zeroes, steps), Place.LAST), accumulate)

    @classmethod
    def of(cls, trainer: pl.Trainer) -> Position:
        """The position of the training batch about to run (read in ``batch_to_device``, before Lightning counts it)."""
        index, last_batch = upcoming_batch(trainer)
        return cls.at(index, trainer.accumulate_grad_batches, last_batch)

    def describe(self) -> str:
        """For messages: ``"micro-batch first of 4"``."""
        return f"micro-batch {self.place.value} of {self.accumulate}"


class GradientBinding:
    """Which captured gradient tensors the parameters' ``.grad`` are, so later micro-batches add into the right ones.

    After an eager micro-batch, a later place replays only if the gradients are still the bound set.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = parameters
        self._bound: list[Tensor | None] | None = None
        #: The parameter whose ``.grad`` :meth:`holds` checks: the first with a gradient in the bound set.
        self._spot: int | None = None

    def gradients(self) -> list[Tensor | None]:
        """The parameters' gradient tensors now (what a just-captured first micro-batch writes)."""
        return [p.grad for p in self.parameters]

    @property
    def bound(self) -> list[Tensor | None] | None:
        """The gradient tensors the parameters' ``.grad`` are, as far as this binding knows (``None``: unknown)."""
        return self._bound

    def verify(self) -> bool:
        """Whether every ``.grad`` still is the bound tensor (a loop over the parameters: at capture time only)."""
        self.after_eager()
        return self._bound is not None

    def holds(self, grads: list[Tensor | None] | None) -> bool:
        """Whether the parameters' ``.grad`` are ``grads``.

        The binding is tracked, and one parameter is spot-checked: Lightning's ``zero_grad`` before validation sets
        every ``.grad`` to ``None`` between steps, which the package does not see happen.
        """
        if grads is None or self._bound is not grads:
            return False
        return self._spot is None or self.parameters[self._spot].grad is grads[self._spot]

    def bind(self, grads: list[Tensor | None]) -> None:
        """Point every ``.grad`` at ``grads`` (after a replay of a first micro-batch, when they were elsewhere)."""
        if self.holds(grads):
            return
        for p, grad in zip(self.parameters, grads, strict=True):
            p.grad = grad
        self._bound = grads
        self._spot = next((i for i, grad in enumerate(grads) if grad is not None), None)

    def adopt(self, grads: list[Tensor | None]) -> None:
        """After an eager step that stands for a captured one: move its gradients into ``grads`` and bind them.

        A gradient missing on one side only cannot be moved: the binding is lost, and the window's later micro-batches
        run eagerly.
        """
        with torch.no_grad():
            for p, grad in zip(self.parameters, grads, strict=True):
                if (p.grad is None) != (grad is None):
                    self._bound = None
                    return
                if grad is not None and p.grad is not None and p.grad is not grad:
                    grad.copy_(p.grad)
        self._bound = None
        self.bind(grads)

    def after_eager(self) -> None:
        """An eager micro-batch ran: the binding holds only if every ``.grad`` is still the bound tensor."""
        bound = self._bound
        if bound is not None and any(p.grad is not grad for p, grad in zip(self.parameters, bound, strict=True)):
            self._bound = None

    def forget(self) -> None:
        """The graphs are gone (release, eviction): nothing is bound."""
        self._bound = None

"""The pieces of a whole step: the plan of the next step, a captured step (static batch, output, logs), its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._backend.backend import StepGraph
from lightning_cudagraph._graphs.accumulation import Place, Position
from lightning_cudagraph._lightning import ManualUpdates, StepLogs
from lightning_cudagraph._options.batches import copy_into, describe_batch_key


@dataclass(eq=False)
class WholeStep:
    """One captured training step for one batch signature.

    Attributes:
        static_batch: The batch the graph reads (the package's own tensors); each step's batch is copied into it.
        output: ``training_step`` 's output as captured (static tensors the replays rewrite).
        logs: The ``self.log`` calls ``training_step`` made while captured, re-issued after each replay.
        updates: Under manual optimization, the optimizer steps ``training_step`` took while captured, re-issued to
            Lightning's loop after each replay (they are ``trainer.global_step``).
        confirm_left: Replays still to be checked before this shape's graph is trusted.
        shadowed: Whether a shadow step has checked it.
        grads: The gradient tensors the graph writes (a first micro-batch) or adds into (a later one), per parameter.
    """

    static_batch: Any
    graph: StepGraph | None = None
    output: Any = None
    logs: StepLogs = field(default_factory=StepLogs)
    updates: ManualUpdates = field(default_factory=ManualUpdates)
    confirm_left: int = 0
    shadowed: bool = False
    grads: list[Tensor | None] | None = None

    def stage(self, batch: Any) -> Any:
        """Copy ``batch`` into the static buffers and return them (no host sync)."""
        copy_into(self.static_batch, batch)
        return self.static_batch

    def output_copy(self) -> Any:
        """A copy of the step's output, safe to hand to Lightning (the next replay rewrites the static one)."""
        return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, self.output)

    def reset(self) -> None:
        """Free the graph and its static buffers."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.static_batch = self.output = self.grads = None
        self.logs.clear()
        self.updates.clear()


@dataclass(eq=False)
class StepWindow:
    """The captured steps of one batch shape, one per position in the accumulation window seen so far."""

    parts: dict[Position, WholeStep] = field(default_factory=dict)

    def needed(self, accumulate: int) -> list[Position]:
        """The positions a full window of ``accumulate`` micro-batches runs."""
        if accumulate == 1:
            return [Position(Place.SINGLE, 1)]
        places = [Place.FIRST, *([Place.MIDDLE] if accumulate > 2 else []), Place.LAST]
        return [Position(place, accumulate) for place in places]

    def confirmed(self, accumulate: int) -> bool:
        """Whether every position of a full window is captured, shadow-checked and replayed ``confirm_steps`` times."""
        parts = [self.parts.get(position) for position in self.needed(accumulate)]
        return all(part is not None and part.shadowed and part.confirm_left <= 0 for part in parts)

    def first(self, accumulate: int) -> WholeStep | None:
        """The captured first micro-batch of a window of ``accumulate`` (it sets the gradients later ones add to)."""
        return self.parts.get(Position(Place.FIRST, accumulate))

    def reset(self) -> None:
        """Free every part's graph and static buffers."""
        parts, self.parts = list(self.parts.values()), {}
        for part in parts:
            part.reset()

    def __len__(self) -> int:
        return len(self.parts)


@dataclass(frozen=True)
class EagerStep:
    """Run the step eagerly; ``fallback`` says why while graphs are in use (counted), ``None`` during warmup steps."""

    fallback: str | None = None


@dataclass(frozen=True)
class CaptureStep:
    """Capture the step for this batch signature and position (its batch becomes the static batch), then replay it."""

    key: tuple[Any, ...]
    whole: WholeStep
    #: The batch key whose captured step this capture evicts (``on_shape_change="recapture"``, the cache full).
    evicts: tuple[Any, ...] | None
    #: The shape's captured steps, which this one joins.
    window: StepWindow
    #: The micro-batch's place in its accumulation window.
    position: Position

    def describe(self) -> str:
        """The batch key, its place in the window and what it evicts, for the capture's message."""
        where = f" ({self.position.describe()})" if self.position.accumulate > 1 else ""
        evicted = f"; evicted batch {describe_batch_key(self.evicts)}" if self.evicts is not None else ""
        return f"batch {describe_batch_key(self.key)}{where}{evicted}"


@dataclass(frozen=True)
class ReplayStep:
    """Replay the step captured for this batch signature and position."""

    key: tuple[Any, ...]
    whole: WholeStep
    #: The micro-batch's place in its accumulation window.
    position: Position


#: What the next optimizer step does.
StepPlan = EagerStep | CaptureStep | ReplayStep


class NonFiniteFlags:
    """Device tensors the captured step writes: how many losses were not finite, and the first such step.

    Example:
        >>> import torch
        >>> flags = NonFiniteFlags(torch.device("cpu"))
        >>> flags.current_step.fill_(7) and None
        >>> flags.update(torch.tensor(float("inf")))
        >>> flags.read_and_clear()
        (1, 7)
    """

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.current_step = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, loss: Tensor) -> None:
        """Record whether ``loss`` is finite (graph-safe: no host sync; captured into the step)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self.first_step.copy_(torch.where(bad & (self.first_step < 0), self.current_step, self.first_step))
        self.count.add_(bad.to(torch.int64))

    def read_and_clear(self) -> tuple[int, int]:
        """``(count, first step)`` since the last read; one host sync."""
        count, first = torch.stack([self.count, self.first_step]).tolist()
        if count:
            self.count.zero_()
            self.first_step.fill_(-1)
        return int(count), int(first)

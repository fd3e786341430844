"""The pieces of a whole step: the plan of the next step, a captured step (static batch, output, logs), its flags.

:meth:`~lightning_cudagraph.drivers.whole_step.WholeStepDriver.plan` makes a :data:`StepPlan` before each
training step; :meth:`~lightning_cudagraph.drivers.whole_step.WholeStepDriver.run` carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._lightning import StepLogs
from lightning_cudagraph.batches import copy_into
from lightning_cudagraph.graphs.backend import StepGraph


@dataclass(eq=False)
class WholeStep:
    """One captured training step for one batch signature.

    Attributes:
        static_batch: The batch the graph reads (the package's own tensors, never the user's); each step's batch is
            copied into it.
        graph: The captured step, once captured.
        output: ``training_step`` 's output as captured (static tensors the replays rewrite).
        logs: The ``self.log`` calls ``training_step`` made while captured, re-issued after each replay.
        confirm_left: Replays still to be checked before this shape's graph is trusted.
        shadowed: Whether a shadow step (the graph against the eager step from the same state) has checked it.
    """

    static_batch: Any
    graph: StepGraph | None = None
    output: Any = None
    logs: StepLogs = field(default_factory=StepLogs)
    confirm_left: int = 0
    shadowed: bool = False

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
        self.static_batch = self.output = None
        self.logs.clear()


@dataclass(frozen=True)
class EagerStep:
    """Run the step eagerly; ``fallback`` says why while graphs are in use (counted), ``None`` during warmup steps."""

    fallback: str | None = None


@dataclass(frozen=True)
class CaptureStep:
    """Capture the step for this batch signature (its batch is the graph's static batch), then replay it."""

    key: tuple[Any, ...]
    whole: WholeStep
    #: The batch key whose captured step this capture evicts (``on_shape_change="recapture"``, the cache full).
    evicts: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class ReplayStep:
    """Replay the step captured for this batch signature."""

    key: tuple[Any, ...]
    whole: WholeStep


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

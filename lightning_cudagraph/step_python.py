"""The step's Python, judged: may one graph hold the whole training step?

A whole-step replay runs no Python at all, so the step's Python must do the same thing on every step. The eager
steps before the first capture are observed (:mod:`lightning_cudagraph.observation`), and so is one eager step at
every epoch boundary once the whole step replays (an epoch, a scheduler's epoch step or a callback's epoch hook can
change what the step does). A step that reads a per-step value, draws from Python's ``random``, skips its batch,
changes its module's attributes from one step to the next, launches other operations or other Python numbers than
the step before, or runs optimizer step hooks is not held by a whole-step graph: the fit rolls back (a fixed
``full_iteration``), or ``scope="auto"`` leaves the whole step out and settles on a level that runs that Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_cudagraph._lightning import step_loss
from lightning_cudagraph.observation import Behaviour, Observer, watched_index

__all__ = ["StepPython", "step_python_reason"]

#: Where the graph-safe way to feed a per-step value to a captured step is documented.
DOCS = "docs/python.md"


class StepPython:
    """The observed eager steps of one fit, by batch key, and what they showed (``problem``).

    Args:
        observer: Watches each observed step.
        setup_steps: Observed steps per batch key that may set things up once (a lazy buffer, Lightning's first
            ``self.log``; under DDP also the second, where DDP rebuilds its gradient buckets): their changes and
            operations are not compared.

    Example:
        >>> import torch
        >>> python = StepPython(Observer(trace=False))
        >>> module = torch.nn.Linear(2, 2)
        >>> module.calls = 0
        >>> def step():
        ...     module.calls += 1
        ...     return torch.ones(())
        >>> for _ in range(2):
        ...     _ = python.run(("batch",), module, epoch=0, run_step=step)
        >>> python.problem.split(":")[0]
        'step_python'
    """

    def __init__(self, observer: Observer, setup_steps: int = 1) -> None:
        self.observer, self.setup_steps = observer, setup_steps
        #: Why the step's Python cannot be held by a whole-step graph (``None`` while nothing showed it).
        self.problem: str | None = None
        #: Per batch key: the steps seen, and the first one after the set-up steps (the reference).
        self._seen: dict[Any, int] = {}
        self._reference: dict[Any, Behaviour] = {}
        self._current: Behaviour | None = None
        self._epoch: int | None = None

    @property
    def observing(self) -> bool:
        """Whether an observed step is running now."""
        return self._current is not None

    def recheck_due(self, epoch: int) -> bool:
        """Whether an epoch started since the last observed step (once graphs replay, one eager step re-checks)."""
        return self.problem is None and self._epoch is not None and epoch != self._epoch

    def run(self, key: Any, module: torch.nn.Module, epoch: int, run_step: Callable[[], Any]) -> Any:
        """Run one eager optimizer step under observation; what it shows may set :attr:`problem`."""
        reader = module if isinstance(module, pl.LightningModule) else None
        with self.observer.span([module], reader=reader, paused=True) as seen:
            self._current = seen
            try:
                output = run_step()
            finally:
                self._current = None
        self._epoch = epoch
        self._judge(key, seen)
        return output

    def step_arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``training_step`` 's arguments in an observed step: ``batch_idx`` notes where user code uses it."""
        if self._current is None:
            return args
        self.observer.resume()
        if len(args) < 2 or type(args[1]) is not int:
            return args
        return (args[0], watched_index(args[1], self._current.reads), *args[2:])

    def step_output(self, output: Any) -> None:
        """``training_step`` returned ``output`` in an observed step (``None``: the batch was skipped)."""
        if self._current is not None and step_loss(output) is None:
            self._current.skipped = True

    def pause_trace(self) -> None:
        """The optimizer's update starts (``on_before_optimizer_step``): its settings are watched apart."""
        if self._current is not None:
            self.observer.pause()

    def _judge(self, key: Any, seen: Behaviour) -> None:
        """Weigh one observed step.

        A read, a draw or a skip counts in any step; changes count after the set-up steps, and operations are compared
        with the first step after them.
        """
        count = self._seen[key] = self._seen.get(key, 0) + 1
        reference = self._reference.setdefault(key, seen) if count > self.setup_steps else None
        found = seen.depends()
        if found is None and reference is not None:
            found = seen.changes() or _differs(reference, seen)
        if found is not None and self.problem is None:
            self.problem = step_python_reason(f"training_step {found}", _fix(seen))


def _differs(first: Behaviour, later: Behaviour) -> str | None:
    change = first.differs(later)
    return f"launched other operations than a step before: {change}" if change is not None else None


def _fix(seen: Behaviour) -> str:
    if seen.skipped:
        return (
            "where skipping means leaving the batch out of the loss, mask it instead (multiply the loss by a 0/1"
            " tensor); otherwise use a scoped level (strategy='cudagraph' or scope=['layer']), which runs"
            " training_step every step"
        )
    if seen.random:
        return (
            "draw with torch on the device (torch.rand(..., device=self.device)), which a replay draws anew, or use a"
            " scoped level (strategy='cudagraph' or scope=['layer'])"
        )
    if seen.reads:
        return (
            "keep the per-step value in a device tensor that on_train_batch_start updates in place"
            " (self.register_buffer('weight', torch.tensor(1.0), persistent=False), then"
            f" self.weight.fill_(...)): a replay reads it ({DOCS}); or use a scoped level (strategy='cudagraph' or"
            " scope=['layer']), which runs training_step's Python every step"
        )
    return (
        "keep state changes out of training_step (on_train_batch_end receives the step's outputs), or use a scoped"
        f" level (strategy='cudagraph' or scope=['layer']), which runs training_step's Python every step ({DOCS})"
    )


def step_python_reason(found: str, fix: str) -> str:
    """The rollback (or level-skipping) reason of a step whose Python a whole-step graph would freeze."""
    return (
        f"step_python: {found}; a whole-step graph runs none of the step's Python, so every replay would repeat"
        f" what the captured step decided. Fix: {fix}"
    )

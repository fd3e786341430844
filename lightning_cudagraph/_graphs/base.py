"""What every capture-mode driver shares: the driver interface, its level settings, capture bookkeeping, the budget.

A driver carries out stages 2-7 for one capture mode (scoped regions, or the whole step) and asks the stage machine to
move on, roll back or give up. The rollout and the level runner see only :class:`Driver`, whose defaults spare them
asking which driver they have.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import CUDAGraphReport

#: Eager forward-backward runs per region before its capture. 0: every region already ran eagerly, with the captured
#: shapes, in the eager steps before (Transformer Engine keeps one).
CAPTURE_WARMUP_ITERS = 0


@dataclass(frozen=True)
class LevelSettings:
    """What the level runner tells a driver about the level it runs (one value, replaced as a whole).

    Attributes:
        first_eager_steps: Eager steps before this driver's first capture (``warmup_steps`` for the first level).
        keep_samples: Keep recorded calls after a capture (``scope="auto"`` may capture another level from them).
        measure_pool: Read the pool's size after each capture (an allocator snapshot); ``scope="auto"`` reads it
            once settled, unless ``max_pool_mib`` needs it at every capture.
    """

    first_eager_steps: int
    warmup_iters: int
    keep_samples: bool
    measure_pool: bool

    @classmethod
    def of(cls, config: CUDAGraphConfig) -> LevelSettings:
        """A fixed scope's settings, from the config."""
        return cls(
            first_eager_steps=config.eager_steps,
            warmup_iters=CAPTURE_WARMUP_ITERS,
            keep_samples=False,
            measure_pool=True,
        )


class Driver(ABC):
    """Base of the capture-mode drivers.

    Args:
        component: Named in messages.
        settings: The level's settings (a fixed scope's: :meth:`LevelSettings.of`).
    """

    #: Whether this driver has captured anything yet (the report's counters may come from a checkpoint).
    captured_any = False
    #: Whether the step in progress is an eager reference step (see ``take_reference_step``).
    in_reference_step = False
    #: Run the next planned step eagerly, a fallback with this reason (a re-check of the step's Python).
    eager_next: str | None = None

    def __init__(
        self,
        config: CUDAGraphConfig,
        backend: CaptureBackend,
        machine: StageMachine,
        settings: LevelSettings,
    ) -> None:
        self.config, self.component, self.backend, self.machine = config, config.component, backend, machine
        self.report: CUDAGraphReport = machine.report
        #: The level's settings; the level runner assigns a new value (``driver.settings = replace(...)``).
        self.settings = settings
        #: Called once, right before the first capture (the rollout reads the eager step times there).
        self.before_first_capture: Callable[[], None] = lambda: None
        #: Whether to run an eager step that records nothing where one could run (before the first capture, or between
        #: replays): ``scope="auto"``'s eager reference. The level runner owns the answer; by default never.
        self.take_reference_step: Callable[[], bool] = lambda: False

    def _shape_cache(self, reset: Callable[[Any], None]) -> ShapeCache[Any]:
        return ShapeCache(self.config.graph_set_limit, self.report, self.component, reset)

    @abstractmethod
    def start(self, trainer: pl.Trainer) -> None:
        """Training starts: put in place what eager stabilization needs."""

    # ------------------------------------------------------------------ per batch (defaults: nothing to do)
    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:  # noqa: B027
        """Before every training batch, while graphs are allowed: decide what this batch does."""

    def plan(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Before ``training_step`` (the strategy's ``batch_to_device``): return the batch the step should use."""
        return batch

    def run(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Carry out the optimizer step (the strategy's ``optimizer_step``); by default eagerly."""
        return run_step()

    def run_training_step(self, trainer: pl.Trainer, run_step: Callable[[], Any]) -> Any:
        """Carry out a manual ``training_step`` (it steps the optimizers itself); by default eagerly."""
        return run_step()

    def run_manual_update(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Carry out an optimizer step a manual ``training_step`` takes: as any optimizer step (:meth:`run`)."""
        return self.run(trainer, closure, optimizer, run_step)

    def on_training_step_output(self, output: Any) -> None:  # noqa: B027
        """``training_step`` returned ``output``."""

    def on_backward(self, loss: Any) -> None:  # noqa: B027
        """The step backpropagates ``loss`` (called while :attr:`capturing` only)."""

    @property
    def capturing(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return False

    @property
    def plans_capture(self) -> bool:
        """Whether the step just planned captures the whole step (its Python runs inside the capture)."""
        return False

    # ------------------------------------------------------------------ for the level runner
    def captured_regions(self) -> frozenset[str] | None:
        """The names of the regions this driver captures now (``None``: the whole step, no regions)."""
        return None

    def captured_modules(self) -> list[tuple[str, Any]]:
        """The regions captured now, as ``(name, module)`` (none for the whole step): evaluation graphs them too."""
        return []

    def switch_level(self, names: Sequence[str]) -> bool:
        """Capture another scoped level in place, from the recorded samples; ``False`` when this driver cannot."""
        return False

    def why_not_captured(self) -> str | None:
        """Why no batch shape reached its capture, when the batches themselves say it (``None``: they do not)."""
        return None

    def settle(self) -> None:  # noqa: B027
        """The ladder settled on this driver's level: drop what was kept for other levels."""

    @abstractmethod
    def end_step(self, outputs: Any) -> None:
        """A training batch ended: close it and weigh what confirmation saw in it."""

    @abstractmethod
    def seal(self, self_check: bool) -> None:
        """Close the set of batch shapes (a shape without graphs is an error from now on); optionally re-check them."""

    @property
    @abstractmethod
    def shape_cache(self) -> ShapeCache[Any]:
        """What this driver captured, by batch shape."""

    def take_seal_from(self, other: Driver) -> None:
        """Carry a seal over from the driver this one replaces (``scope="auto"`` moving to another level)."""
        if other.shape_cache.sealed:
            self.shape_cache.seal(other.shape_cache.known)

    @abstractmethod
    def release(self) -> None:
        """Stage 7: free every graph and restore everything patched (idempotent)."""

    def abandon_step(self) -> None:  # noqa: B027
        """A training batch never reached its end (``on_train_batch_start`` returned -1)."""

    def health_check(self, step: int) -> None:  # noqa: B027
        """Once per log interval: read what the graphs count on the device (one host sync), if anything."""

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:  # noqa: B027
        """Keep the checkpoint free of the package's state."""

    # ------------------------------------------------------------------ capture bookkeeping
    def before_capture(self) -> None:
        """Right before a capture: the first one reads the eager step times; the memory before graphs is noted."""
        if not self.captured_any:
            self.before_first_capture()
        if self.report.memory_before_capture is None:
            self.report.memory_before_capture = self.backend.memory_allocated()

    def count_capture(self, started: float, graphs: int, undo: Callable[[], None] | None = None) -> bool:
        """Count a capture and its memory; roll back if the pool is over budget. Returns whether to go on.

        ``undo`` runs before a rollback: it puts back what the capture's Python changed before release gives the
        optimizers back.
        """
        self.report.captures += 1
        self.captured_any = True
        self.report.graphs = graphs
        self.report.capture_ms = (time.perf_counter() - started) * 1e3
        budget = self.config.max_pool_mib
        if budget is None and not self.settings.measure_pool:
            return True
        self.report.pool_mib = self.backend.pool_mib()
        if budget is not None and self.report.pool_mib > budget:
            if undo is not None:
                undo()
            self.machine.rollback(f"memory_budget: graphs hold {self.report.pool_mib:.1f} MiB > {budget} MiB")
            return False
        return True

    def eager_steps_needed(self) -> int:
        """Eager steps a batch shape runs before its capture: ``warmup_steps`` for the first, one for later ones."""
        return 1 if self.captured_any else self.settings.first_eager_steps

"""Evaluation graphs: validation, test and predict steps on forward-only CUDA graphs, on by default.

Each evaluation loop runs one way: the whole evaluation step as one graph per batch shape (through the package's
strategy, at the whole-step level or outside a fit), the trained level's regions (the callback's scoped levels), or
eagerly with the reason. Every graph is checked against eager on its capture batch before it is trusted. During a fit
they share the training graphs' pool: their replays run between training steps on the same stream, never between a
region's forward and backward, and every buffer a graph reads across replays stays referenced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.local import moved_since, tensor_addresses
from lightning_cudagraph._graphs.eval_regions import EvalRegionGraphs
from lightning_cudagraph._graphs.eval_step import EvalStepGraphs
from lightning_cudagraph._options.config import FULL_ITERATION, CUDAGraphConfig
from lightning_cudagraph._options.options import DEFAULT_MAX_GRAPHS
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.guards import EVAL_METHODS, GuardSet
from lightning_cudagraph._trust.tolerance import forward_tolerance, full_precision
from lightning_cudagraph.health import EvaluationRecord

__all__ = ["EVAL_HOOKS", "EvaluationGraphs", "TrainedLevel"]

#: The step hook of each evaluation stage.
EVAL_HOOKS: dict[RunningStage | None, str] = {
    RunningStage.VALIDATING: "validation_step",
    RunningStage.TESTING: "test_step",
    RunningStage.PREDICTING: "predict_step",
}

WHOLE_STEP, REGIONS, EAGER = "whole_step", "regions", "eager"


@dataclass(frozen=True)
class TrainedLevel:
    """What the fit's training graphs are, as evaluation needs to know.

    Attributes:
        name: The level training runs at (``full_iteration``, ``layer``, ...; for a fixed scope its scope names).
        settled: Whether ``scope="auto"`` settled (always, for a fixed scope).
        allowed: Whether graphs are still in use (not rolled back or off).
        regions: The captured regions (qualified name, module) of a scoped level.
    """

    name: str | None
    settled: bool
    allowed: bool
    off_reason: str | None = None
    regions: Sequence[tuple[str, torch.nn.Module]] = field(default_factory=tuple)


class EvaluationGraphs:
    """The evaluation graphs of one Trainer's loops: which way each loop runs, the graphs, their release.

    The graphs of a fit live beside its training graphs (an interleaved ``val_check_interval`` keeps both); a loop
    outside a fit releases its own at its end. ``record`` is ``report.evaluation``.
    """

    def __init__(self, config: CUDAGraphConfig, record: EvaluationRecord) -> None:
        self.config, self.component, self.record = config, config.component, record
        self.policy = FailurePolicy(config.component, config.on_failure)
        self.steps: EvalStepGraphs | None = None
        self.regions: EvalRegionGraphs | None = None
        self.mode = EAGER
        self._backend: CaptureBackend | None = None
        self._standalone = False
        self._said: set[str] = set()
        self._addresses: dict[str, int] = {}
        self._guards: GuardSet | None = None

    # ------------------------------------------------------------------ a loop's start and end
    def loop_start(
        self, trainer: pl.Trainer, backend: CaptureBackend | None, level: TrainedLevel, strategy: bool
    ) -> None:
        """Pick how this evaluation loop runs, and get its graphs ready."""
        self.mode = EAGER
        if trainer.sanity_checking:  # the natural warmup: eager, and nothing to say
            return
        hook = EVAL_HOOKS.get(trainer.state.stage)
        in_fit = trainer.state.fn == TrainerFn.FITTING
        reason = self._why_eager(hook, backend, level, strategy, in_fit)
        if reason is not None:
            self.record.mode, self.record.reason = EAGER, reason
            if self.config.enabled and self.config.eval_graphs and backend is not None and reason not in self._said:
                self._said.add(reason)
                rank_zero_info(f"{self.component}: {hook or 'evaluation'} runs eagerly: {reason}")
            return
        assert backend is not None
        module = trainer.lightning_module
        addresses = tensor_addresses(module)
        changed = self._guards.change() if self._guards is not None else None
        if changed is not None:
            rank_zero_info(f"{self.component}: {hook} captures its graphs again: {changed}")
        if self._backend is not backend or moved_since(self._addresses, addresses) or changed is not None:
            # A new fit, a loop outside one, parameters and buffers rebound since the graphs were captured
            # (``p.data = ...``, a ``.to()``), or a Python value their code read changed between loops: graphs that
            # read the old values go, and are captured again.
            self.release()
            self._backend, self._addresses = backend, addresses
        if self._guards is None:  # the values this loop's captures read
            self._guards = GuardSet("the evaluation graphs", list(module.named_modules()), module, methods=EVAL_METHODS)
        if not in_fit:
            self._standalone = True
            backend.enter()  # eager warmup and capture on one stream, as in training
        tolerance = forward_tolerance(self.config.parity_tol, reduced=not full_precision(trainer.precision))
        limit = self.config.max_graphs or DEFAULT_MAX_GRAPHS
        if in_fit and not (strategy and level.name == FULL_ITERATION):
            if self.regions is None:
                self.regions = EvalRegionGraphs(backend, self.record, self.policy, self.component, tolerance, limit)
            self.regions.install(level.regions)
            self.mode = REGIONS
        else:
            if self.steps is None:
                self.steps = EvalStepGraphs(backend, self.record, self.policy, self.component, tolerance, limit)
            self.mode = WHOLE_STEP if self.steps.off is None else EAGER
        self.record.mode = self.mode
        self.record.reason = self.steps.off if self.mode == EAGER and self.steps is not None else None

    def _why_eager(
        self, hook: str | None, backend: CaptureBackend | None, level: TrainedLevel, strategy: bool, in_fit: bool
    ) -> str | None:
        """Why this loop runs eagerly, or ``None`` when it gets graphs."""
        if not self.config.enabled:
            return "impl_none"
        if not self.config.eval_graphs:
            return "eval_graphs=False"
        if hook is None:
            return "not an evaluation loop"
        if backend is None:
            return "no_cuda: CUDA graphs need a CUDA device"
        if self.config.impl != "local":
            return (
                f"impl={self.config.impl!r}: evaluation graphs are PyTorch graphs (impl='local'); Transformer Engine"
                " keeps its FP8 state per training step"
            )
        if not in_fit:
            if strategy:
                return None
            return (
                "outside a fit, the callback alone has no trained level to graph. Fix: evaluate through"
                " strategy='cudagraph_full' (the whole evaluation step), or inside the fit"
            )
        if not level.allowed:
            return f"the training graphs are off{f' ({level.off_reason})' if level.off_reason else ''}"
        if strategy and level.name == FULL_ITERATION:
            return None
        if not level.settled:
            return "scope='auto' has not settled on a level yet (evaluation graphs follow the level training keeps)"
        if not level.regions:
            return "no region is captured yet (the training warmup steps are still running)"
        return None

    def loop_end(self) -> None:
        """The loop ended: the regions get their forwards back; a loop outside a fit frees its graphs."""
        if self.regions is not None:
            self.regions.restore()
        if self._standalone:
            backend = self._backend
            self.release()
            if backend is not None:
                backend.release()
        self.mode = EAGER

    # ------------------------------------------------------------------ steps (called by the strategy)
    def plan(self, trainer: pl.Trainer, batch: Any) -> Any:
        """``batch_to_device`` of an evaluation batch: the batch its step should read."""
        if self.mode != WHOLE_STEP or self.steps is None or trainer.sanity_checking:
            return batch
        hook = EVAL_HOOKS.get(trainer.state.stage)
        if hook is None:
            return batch
        return self.steps.plan(hook, batch)

    def run(self, module: pl.LightningModule, step: Callable[[], Any]) -> Any:
        """An evaluation step: its graph, or eagerly."""
        if self.mode != WHOLE_STEP or self.steps is None:
            return step()
        output = self.steps.run(module, step)
        if self.steps.off is not None:
            self.mode = self.record.mode = EAGER
        return output

    @property
    def graphs(self) -> int:
        """Evaluation graphs alive now."""
        return (len(self.steps.cache) if self.steps is not None else 0) + (
            len(self.regions.cache) if self.regions is not None else 0
        )

    # ------------------------------------------------------------------ release
    def release(self) -> None:
        """Give every forward back and free every evaluation graph (idempotent; every exit path calls it)."""
        held = self.graphs > 0 or (self.regions is not None and self.regions.installed)
        try:
            if self.regions is not None:
                self.regions.release()
        finally:
            if self.steps is not None:
                self.steps.release()
            self.steps = self.regions = None
            self._backend, self._standalone, self._addresses = None, False, {}
            if self._guards is not None:
                self._guards.release()
                self._guards = None
            self.mode = EAGER
            self.record.graphs = 0
            if held:
                self.record.releases += 1

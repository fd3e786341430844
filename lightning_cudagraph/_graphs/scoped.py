"""The scoped driver: graphs of target regions (attention, MLPs, layers, ...) inside an otherwise eager step.

Stage by stage: recording (:mod:`~lightning_cudagraph._trust.recording`), the shape decision
(:mod:`~lightning_cudagraph._trust.shape_change`), capture (:mod:`~lightning_cudagraph._graphs.region_capture`),
confirmation (:mod:`~lightning_cudagraph._graphs.confirmation`), replay (:mod:`~lightning_cudagraph._graphs.routing`);
release resets every graph and restores every forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

from lightning_cudagraph._backend.backend import CaptureBackend, CaptureMethod
from lightning_cudagraph._backend.compiling import CompiledForwards
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._graphs.confirmation import RegionConfirmation
from lightning_cudagraph._graphs.optimizer_graph import OptimizerGraph
from lightning_cudagraph._graphs.region_capture import NarrowingCapture
from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._graphs.routing import CallRouter, GraphSet, PatchedForwards, StepRoute
from lightning_cudagraph._graphs.scoped_capture import GraphSetCapture
from lightning_cudagraph._options.batches import batch_key, opaque_reason
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust.evidence import StateWatch
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.recording import WarmupRecorder
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.shape_change import ShapeAction, ShapeDecision
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph._trust.tolerance import forward_tolerance
from lightning_cudagraph.health import Stage


class ScopedDriver(Driver):
    """Captures and replays target regions, one graph set per batch signature.

    Args:
        regions: Every patched target, and which of them are captured.
        compiled: ``compile=``: the compiled stand-ins of the targets' forwards (what training steps run and capture).
        observer: Watches the Python of each recorded call (``None``: a fit's own, untraced).
    """

    #: How regions are captured (``None``: the backend's default, PyTorch's forward/backward graph pairs).
    capture_method: CaptureMethod | None = None

    def __init__(
        self,
        regions: RegionSet,
        config: CUDAGraphConfig,
        backend: CaptureBackend,
        machine: StageMachine,
        settings: LevelSettings,
        compiled: CompiledForwards | None = None,
        observer: Observer | None = None,
    ) -> None:
        super().__init__(config, backend, machine, settings)
        self.regions = regions
        self.targets = regions.targets
        self.graph_sets: ShapeCache[GraphSet] = self._shape_cache(GraphSet.reset)
        self.shapes = ShapeDecision(config.on_shape_change, self.graph_sets, machine, config.component)
        self.narrowing = NarrowingCapture(self.config, self.backend, self.machine, regions)
        self.confirmation = RegionConfirmation(config, machine, regions, self.graph_sets, self.parity_tolerance)
        self.state = StateWatch()
        self.router = CallRouter(
            self.report,
            self.shapes.region_mismatch,
            state_problem=self.state.problem,
            preserved=backend.preserved,
            observer=observer or Observer(trace=False),
        )
        self.forwards = PatchedForwards(self.targets, self.router, compiled)
        self.recorder = WarmupRecorder(self.targets, run_of=self.forwards.run_of)
        self.capture = GraphSetCapture(
            self,
            regions,
            self.recorder,
            self.narrowing,
            self.router,
            self.graph_sets,
            self.state,
            self.confirmation.checks,
        )
        self._microbatches = 1
        self._released = False
        self.optimizer_graph = OptimizerGraph(config, backend, machine)

    def start(self, trainer: pl.Trainer) -> None:
        """Patch the targets' forwards: from now on every call goes through the router."""
        self._microbatches = trainer.accumulate_grad_batches  # warmup steps count optimizer steps
        self.forwards.install()

    # ------------------------------------------------------------------ a training batch
    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Route the targets' calls of this training batch: replay, record, capture, or fall back.

        A batch without a key runs eagerly, counted, or turns graphs off when no graph exists yet.
        """
        self.in_reference_step = False
        if not self.machine.graphs_allowed:
            return
        if self.captured_any and self.machine.stage == Stage.REPLAYING and self.take_reference_step():
            self._reference_step()  # the steady-state check of scope="auto": eager steps between replayed ones
            return
        key = batch_key(batch)
        if key is None:
            if self.machine.stage == Stage.WARMUP:
                self.machine.disable("opaque_batch", detail=opaque_reason(batch))
            else:
                self.router.begin(StepRoute(fallback_reason=f"opaque_batch: {opaque_reason(batch)}"))
            return
        graph_set = self._graph_set_for(key)
        if graph_set is not None:
            self.confirmation.audit_when_due(graph_set)
            confirming = graph_set.confirm_left > 0  # an audit's step too: it confirms one region again
            self._begin_graphed_step(graph_set, trainer.global_step, confirming, accumulates_across_steps(trainer))

    def _begin_graphed_step(self, graph_set: GraphSet, step: int, confirming: bool, accumulating: bool) -> None:
        self.router.begin(StepRoute(graph_set=graph_set, confirming=confirming, accumulating=accumulating))

    def _graph_set_for(self, batch: tuple[Any, ...]) -> GraphSet | None:
        """The graph set this batch replays, as the shape decision says; ``None`` for an eager step."""
        needed = 1 if self.captured_any else self.settings.first_eager_steps * self._microbatches
        seen = self.recorder.recorded_steps(batch)
        outcome = self.shapes.decide(batch, seen, needed, uncapturable=batch in self.capture.uncapturable)
        if outcome.action is ShapeAction.REPLAY:
            held: GraphSet = outcome.held
            return held
        if outcome.action is ShapeAction.EAGER:  # this shape's own stabilization
            self.recorder.begin_step(batch, keep_samples=True)
            self.router.begin(StepRoute(recorder=self.recorder, fallback_reason=outcome.reason))
        elif outcome.action is ShapeAction.FALLBACK:
            self.router.begin(StepRoute(fallback_reason=outcome.reason))
        elif outcome.action is ShapeAction.CAPTURE:
            if not self.captured_any and self.take_reference_step():  # eager, nothing recorded: the eager reference
                self._reference_step()
                return None
            graph_set = self.capture.capture_shape(batch, outcome, self.capture_method)
            if graph_set is not None:  # captured into the pool the update's graph shares
                self.optimizer_graph.regions_captured()
            return graph_set
        return None

    def _reference_step(self) -> None:
        """An eager step that records and counts nothing: ``scope="auto"`` times it as eager training."""
        self.in_reference_step = True
        self.router.begin(StepRoute())

    def end_step(self, outputs: Any) -> None:
        """Close the batch and weigh what confirmation saw (stage 5)."""
        route = self.router.end()
        if route is None:
            return
        if route.recorder is not None:
            route.recorder.end_step()
        self._after_step(route)
        self._count_step(route)
        self.confirmation.step_ended(route, outputs)

    def _after_step(self, route: StepRoute) -> None:
        """Extension point for what a capture mode keeps per step (the FP8 weight cache)."""

    def _count_step(self, route: StepRoute) -> None:
        if not self.captured_any:
            return
        if route.graph_set is not None and route.fallbacks == 0 and route.replays > 0:
            self.report.steps_replayed += 1
        else:
            self.report.steps_eager += 1

    def abandon_step(self) -> None:
        """Drop the batch being recorded: it never ran to its end."""
        route = self.router.end()
        if route is not None and route.recorder is not None:
            route.recorder.discard_step()

    def health_check(self, step: int) -> None:
        """Under several ranks, once per log interval: roll back every rank if one found a problem since."""
        self.confirmation.health_check()

    def parity_tolerance(self) -> float:
        """The tolerance of the parity check: the option, or the default of the captured precision."""
        config = self.config
        return forward_tolerance(config.parity_tol, reduced=self.capture.autocast, compiled=config.compile is not None)

    # ------------------------------------------------------------------ shapes and levels
    @property
    def shape_cache(self) -> ShapeCache[GraphSet]:
        return self.graph_sets

    def seal(self, self_check: bool) -> None:
        """Close the set of batch shapes; with ``self_check``, confirm every captured shape again on its next step."""
        self.graph_sets.seal()
        if self_check:
            self.confirmation.recheck()

    def captured_regions(self) -> frozenset[str]:
        return frozenset(target.name for target in self.regions.active_targets)

    def captured_modules(self) -> list[tuple[str, Any]]:
        return [(target.name, target.module) for target in self.regions.active_targets]

    def switch_level(self, names: Sequence[str]) -> bool:
        """From the next batch on, capture these targets (a level of ``scope="auto"``) in place.

        The graphs held now are released; the samples recorded so far serve the new capture, so it needs no eager
        step of its own. ``False`` once this driver is released.
        """
        if self._released:
            return False
        self.router.end()
        for graph_set in self.graph_sets.clear():
            graph_set.reset()
        self.report.graphs = 0
        self.optimizer_graph.regions_captured()
        self.regions.set_active(names)
        return True

    def settle(self) -> None:
        """The ladder settled on this level: drop the samples kept for other levels (they hold device memory)."""
        self.settings = replace(self.settings, keep_samples=False)
        for batch in self.graph_sets.shapes():
            self.recorder.forget(batch)

    # ------------------------------------------------------------------ stage 7: release
    def release(self) -> None:
        """Restore every forward first (what a user would trip over most), then reset every graph."""
        self._released = True
        self.router.end()
        self.forwards.restore()
        self.state.release()
        graph_sets = self.graph_sets.clear()
        try:
            for graph_set in graph_sets:
                graph_set.reset()
        finally:
            self.report.graphs = 0
            self.recorder.clear()  # its sample inputs are device tensors
            self.optimizer_graph.release()

    # ------------------------------------------------------------------ the optimizer step (package strategies only)
    def run(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """The strategy's ``optimizer_step``: the eager step, its update replayed as a graph once regions replay."""
        if self._released:
            return run_step()
        # An eager reference step of scope="auto" times eager training: its update too.
        live = self.captured_any and self.machine.stage != Stage.WARMUP and not self.in_reference_step
        return self.optimizer_graph.run(trainer, optimizer, run_step, graphs_live=live)

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (the optimizer graph runs them in their capturable form)."""
        self.optimizer_graph.save_checkpoint(optimizers, checkpoint)


def accumulates_across_steps(trainer: pl.Trainer) -> bool:
    """Whether gradients may carry over from one training step to the next (then a replay hands autograd copies).

    Under ``accumulate_grad_batches > 1`` they do; under manual optimization they may at any step, as
    ``training_step`` decides when to call ``zero_grad`` (Lightning's manual accumulation steps every N batches).
    """
    return trainer.accumulate_grad_batches > 1 or not trainer.lightning_module.automatic_optimization

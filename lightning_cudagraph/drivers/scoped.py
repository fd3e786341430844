"""The scoped driver: graphs of target regions (attention, MLPs, layers, ...) inside an otherwise eager step.

Stage by stage: eager stabilization records every target call (:mod:`lightning_cudagraph.recording`); the fixed
shapes check plans the capture from those records; capture runs the backend with the targets' hooks stashed;
confirmation weighs parity, addresses, backward order and replays; replay is the router's job
(:mod:`lightning_cudagraph.drivers.routing`); release resets every graph and restores every forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_cudagraph.drivers.base import Driver, shape_change_error
from lightning_cudagraph.drivers.evidence import MetricUpdates, TrainableWatch
from lightning_cudagraph.drivers.routing import CallRouter, GraphSet, PatchedForwards, ReplayEntry, StepRoute
from lightning_cudagraph.graphs.backend import RegionCapture
from lightning_cudagraph.health import Stage
from lightning_cudagraph.hooks import hooks_stashed, inner_hook_count
from lightning_cudagraph.recording import RecordedCall, WarmupRecorder
from lightning_cudagraph.scopes import Target
from lightning_cudagraph.signature import describe_batch_key

#: Relative parity tolerances when ``parity_tol`` is not given: full precision, and under autocast.
DEFAULT_PARITY_TOL = 1e-4
REDUCED_PRECISION_PARITY_TOL = 2e-2
#: Eager forward-backward iterations per region before it is captured.
CAPTURE_WARMUP_ITERS = 3


class ScopedDriver(Driver):
    """Captures and replays target regions, one graph set per batch signature.

    Args:
        targets: The modules to capture, in model order.
        *args: See :class:`~lightning_cudagraph.drivers.base.Driver`.
    """

    #: How regions are captured (``None``: the backend's default, PyTorch's forward/backward graph pairs).
    region_capture: RegionCapture | None = None

    def __init__(self, targets: Sequence[Target], *args: Any) -> None:
        super().__init__(*args)
        self.targets = list(targets)
        self.recorder = WarmupRecorder(self.targets)
        self.trainable = TrainableWatch()
        self.router = CallRouter(
            self.report,
            self.component,
            strict_shapes=self.config.on_shape_change == "error",
            trainable_problem=self.trainable.problem,
            preserved=self.backend.preserved,
        )
        self.forwards = PatchedForwards(self.targets, self.router)
        self.graph_sets: dict[tuple[Any, ...], GraphSet] = {}
        self._index = {target.name: i for i, target in enumerate(self.targets)}
        self._uncapturable: set[tuple[Any, ...]] = set()
        self._autocast = False
        self._replays_since_capture = 0
        self._graphed_step_seen = False

    def start(self, trainer: pl.Trainer) -> None:
        """Patch the targets' forwards: from now on every call goes through the router."""
        self.forwards.install()

    # ------------------------------------------------------------------ a training batch
    def begin_step(self, step: int, batch: tuple[Any, ...], accumulating: bool) -> None:
        """Decide what this batch does with the targets: record, capture, replay, or fall back."""
        if self.machine.recording_due(step):  # stage 2: eager stabilization
            self.recorder.begin_step(batch, keep_samples=self.machine.keep_samples_due(step))
            self.router.begin(StepRoute(recorder=self.recorder))
            return
        if self.machine.capture_due(step) and not self._capture_first(step):
            return
        graph_set = self.graph_sets.get(batch)
        confirming = self.machine.stage == Stage.CONFIRMING
        if graph_set is None:
            graph_set = self._graph_set_for_new_shape(batch)
            confirming = True  # a newly captured shape's first step gets its parity check
        if graph_set is not None:
            self._begin_graphed_step(graph_set, step, confirming, accumulating)

    def _begin_graphed_step(self, graph_set: GraphSet, step: int, confirming: bool, accumulating: bool) -> None:
        self.router.begin(StepRoute(graph_set=graph_set, confirming=confirming, accumulating=accumulating))

    def end_step(self, outputs: Any) -> None:
        """Close the batch and weigh what confirmation saw (stage 5)."""
        route = self.router.end()
        if route is None:
            return
        if route.recorder is not None:
            route.recorder.end_step()
        self._after_step(route)
        if not self.machine.graphs_allowed:
            return
        if route.problem is not None:
            self.machine.rollback(route.problem)
            return
        if route.confirming and not self._confirmed(route):
            return
        self._replays_since_capture += route.replays
        if self.machine.stage == Stage.CONFIRMING:
            self.machine.confirm_losses.observe(outputs)
            self._graphed_step_seen |= bool(route.forward_order) and not route.parity

    def _after_step(self, route: StepRoute) -> None:
        """Extension point for what a capture mode keeps per step (the FP8 weight cache)."""

    def abandon_step(self) -> None:
        """Drop the batch being recorded: it never ran to its end."""
        route = self.router.end()
        if route is not None and route.recorder is not None:
            route.recorder.discard_step()

    # ------------------------------------------------------------------ stages 3 and 4: fixed shapes, capture
    def _capture_first(self, step: int) -> bool:
        if not self.machine.warmup_was_finite():
            return False
        plan = self.recorder.plan(excluded=set())
        if plan.unstable is not None:
            self.machine.disable(
                f"shape_unstable: {plan.unstable}", detail=f"input signatures moved during warmup: {plan.unstable}"
            )
            return False
        if not plan.calls:
            self.machine.disable("no_targets", detail=f"no target module ran in a training step: {plan.skipped}")
            return False
        self._note_skipped(plan.skipped)
        if not self._capture(plan.batch, plan.calls):
            return False
        self.machine.begin_confirmation(step, self.config.confirm_steps)
        self._replays_since_capture, self._graphed_step_seen = 0, False
        self.trainable.watch((f"{t.name}.{n}", p) for t in self.targets for n, p in t.module.named_parameters())
        return True

    def _graph_set_for_new_shape(self, batch: tuple[Any, ...]) -> GraphSet | None:
        captured = ", ".join(describe_batch_key(k) for k in self.graph_sets) or "nothing yet"
        change = f"batch shape {describe_batch_key(batch)} differs from the captured {captured}"
        if batch in self._uncapturable:
            self.router.begin(StepRoute(fallback_reason=f"{change}; it cannot be captured"))
            return None
        if self.config.on_shape_change == "error":
            raise shape_change_error(self.component, change)
        if self.config.on_shape_change != "recapture" or len(self.graph_sets) >= self.config.graph_set_limit:
            self.router.begin(StepRoute(fallback_reason=change))
            return None
        if self.recorder.last_step_for(batch) is None:  # first sighting: record it eagerly, capture on the next
            self.recorder.begin_step(batch, keep_samples=True)
            self.router.begin(StepRoute(recorder=self.recorder, fallback_reason=change))
            return None
        plan = self.recorder.plan(excluded=set(), batch=batch)
        if plan.unstable is None and plan.calls and self._capture(batch, plan.calls):
            return self.graph_sets[batch]
        if self.machine.graphs_allowed:  # not a failed capture (that rolled back loudly): this shape stays eager
            why = f"its input signatures moved: {plan.unstable}" if plan.unstable else "no target ran in it"
            rank_zero_warn(f"{self.component}: batch shape {describe_batch_key(batch)} stays eager: {why}")
            self._uncapturable.add(batch)
            self.router.begin(StepRoute(fallback_reason=f"{change}; it cannot be captured: {why}"))
        return None

    def _capture(self, batch: tuple[Any, ...], calls: list[RecordedCall]) -> bool:
        """Capture a graph set for ``batch`` with the targets' hooks stashed; on failure roll back (or raise)."""
        self._note_memory_before_capture()
        modules = [call.module for call in calls]
        metrics = MetricUpdates((call.name, call.module) for call in calls)
        started = time.perf_counter()
        try:
            with self.backend.preserved(modules), self.backend.failure_guard(), hooks_stashed(modules):
                regions = self.backend.capture_regions(calls, CAPTURE_WARMUP_ITERS, self.region_capture)
        except Exception as err:  # a failed capture must not end training silently, nor leak anything
            self._capture_failed(err)
            return False
        for region in regions:
            region.on_backward = self.router.on_backward
        entries = {self._index[region.name]: ReplayEntry(region) for region in regions}
        self.graph_sets[batch] = GraphSet(batch, entries)
        self._autocast = self._autocast or any(call.signature.autocast[0] for call in calls)
        if not self._captured(started, sum(len(s.entries) for s in self.graph_sets.values())):
            return False
        updated = metrics.changed()
        if updated:
            self.machine.rollback(
                f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside a captured region; a replay"
                " would not count their updates. Fix: update metrics in training_step or on_train_batch_end"
                " from the step's outputs, outside the captured modules"
            )
            return False
        rank_zero_info(
            f"{self.component}: captured {len(calls)} region(s) for batch {describe_batch_key(batch)} in"
            f" {self.report.capture_ms:.0f} ms; graphs hold {self.report.pool_mib:.1f} MiB"
        )
        return True

    # ------------------------------------------------------------------ stage 5: replay confirmation
    def _confirmed(self, route: StepRoute) -> bool:
        """Weigh a confirming step: parity within tolerance, backward in reverse forward order."""
        if route.parity:
            error = max(float(e) for e in route.parity)  # confirmation steps only: their one host sync
            previous = self.report.parity_err
            self.report.parity_err = error if math.isnan(previous) else max(previous, error)
            tolerance = self.parity_tolerance()
            if not error <= tolerance:
                self.machine.rollback(
                    f"parity: graphed forward differs from eager by {error:.3g} (tolerance {tolerance:g})"
                )
                return False
        expected = [name for name in reversed(route.forward_order) if name in set(route.backward_order)]
        if route.backward_order and route.backward_order != expected:
            self.machine.rollback(
                "backward_order: regions ran backward in another order than the reverse of their forward"
                f" ({route.backward_order} vs {expected}); they cannot share one memory pool"
            )
            return False
        return True

    def parity_tolerance(self) -> float:
        """The tolerance of the parity check: the option, or the default of the captured precision."""
        if self.config.parity_tol is not None:
            return self.config.parity_tol
        return REDUCED_PRECISION_PARITY_TOL if self._autocast else DEFAULT_PARITY_TOL

    def finish_confirmation(self) -> None:
        """Confirm once a step ran on graphs forward and backward (steps that checked parity trained eagerly)."""
        if self._replays_since_capture == 0:
            self.machine.rollback("not_replayed: no graph replayed during confirmation (the targets were bypassed)")
        elif self._graphed_step_seen:
            self.machine.confirm(graphs=self.report.graphs)

    # ------------------------------------------------------------------ stage 7: release
    def release(self) -> None:
        """Restore every forward first (what a user would trip over most), then reset every graph."""
        self.router.end()
        self.forwards.restore()
        graph_sets, self.graph_sets = list(self.graph_sets.values()), {}
        try:
            for graph_set in graph_sets:
                graph_set.reset()
        finally:
            self.report.graphs = 0
            self.recorder.clear()  # its sample inputs are device tensors

    def _note_skipped(self, skipped: dict[str, str]) -> None:
        for name, why in skipped.items():
            rank_zero_info(f"{self.component}: {name} stays eager: {why}")
        for target in self.targets:
            hooks = inner_hook_count(target.module)
            if hooks:
                rank_zero_warn(
                    f"{self.component}: {hooks} hook(s) on modules inside {target.name} fire during eager steps only,"
                    " not while it replays as a graph (hooks on the region itself keep firing)."
                )

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
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_cudagraph.batches import batch_key, describe_batch_key, opaque_reason
from lightning_cudagraph.compiling import CompiledForwards
from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.drivers.base import Driver, LevelSettings, shape_change_error
from lightning_cudagraph.drivers.evidence import StateWatch
from lightning_cudagraph.drivers.region_capture import NarrowingCapture
from lightning_cudagraph.drivers.regions import RegionSet
from lightning_cudagraph.drivers.routing import CallRouter, GraphSet, PatchedForwards, ReplayEntry, StepRoute
from lightning_cudagraph.drivers.shape_cache import ShapeCache
from lightning_cudagraph.graphs.backend import CaptureBackend, CaptureMethod, RecordedCall
from lightning_cudagraph.health import Stage
from lightning_cudagraph.hooks import inner_hook_count
from lightning_cudagraph.recording import WarmupRecorder
from lightning_cudagraph.scopes import Target
from lightning_cudagraph.stages import StageMachine

#: Relative parity tolerances when ``parity_tol`` is not given: full precision, and under autocast.
DEFAULT_PARITY_TOL = 1e-4
REDUCED_PRECISION_PARITY_TOL = 2e-2
#: Full precision with ``compile=``: fused kernels reorder float sums (the graphed forward is compiled, the
#: reference eager), which moves results by about 1e-6..1e-5 relative; a wrong graph is off by far more.
COMPILED_PARITY_TOL = 1e-3


class ScopedDriver(Driver):
    """Captures and replays target regions, one graph set per batch signature.

    Args:
        regions: Every patched target, and which of them are captured (see
            :class:`~lightning_cudagraph.drivers.regions.RegionSet`).
        config, component, backend, machine, settings: See :class:`~lightning_cudagraph.drivers.base.Driver`.
        compiled: ``compile=``: the compiled stand-ins of the targets' forwards (what training steps run and capture).
    """

    #: How regions are captured (``None``: the backend's default, PyTorch's forward/backward graph pairs).
    capture_method: CaptureMethod | None = None

    def __init__(
        self,
        regions: RegionSet,
        config: CUDAGraphConfig,
        component: str,
        backend: CaptureBackend,
        machine: StageMachine,
        settings: LevelSettings | None = None,
        compiled: CompiledForwards | None = None,
    ) -> None:
        super().__init__(config, component, backend, machine, settings)
        self.regions = regions
        self.targets = regions.targets
        self.recorder = WarmupRecorder(self.targets)
        self.narrowing = NarrowingCapture(self.config, self.backend, self.machine, regions)
        self.state = StateWatch()
        self.router = CallRouter(
            self.report,
            self.component,
            strict_shapes=self.config.on_shape_change == "error",
            state_problem=self.state.problem,
            preserved=self.backend.preserved,
        )
        self.forwards = PatchedForwards(self.targets, self.router, compiled)
        self.graph_sets: ShapeCache[GraphSet] = self._shape_cache(GraphSet.reset)
        self._index = regions.index
        self._uncapturable: set[tuple[Any, ...]] = set()
        self._autocast = False
        self._microbatches = 1
        self._pending_problem: str | None = None
        self._since_audit = 0
        self._released = False

    @property
    def keep_samples(self) -> bool:
        """Whether recorded samples are kept after a capture (see :class:`~.base.LevelSettings`)."""
        return self.settings.keep_samples

    @keep_samples.setter
    def keep_samples(self, keep: bool) -> None:
        self.settings = replace(self.settings, keep_samples=keep)

    @property
    def warmup_iters(self) -> int:
        """Capture warmup iterations per region before its capture (fewer once the regions are warm)."""
        return self.settings.warmup_iters

    @warmup_iters.setter
    def warmup_iters(self, iters: int) -> None:
        self.settings = replace(self.settings, warmup_iters=iters)

    def start(self, trainer: pl.Trainer) -> None:
        """Patch the targets' forwards: from now on every call goes through the router."""
        self._microbatches = trainer.accumulate_grad_batches  # warmup counts optimizer steps
        self.forwards.install()

    # ------------------------------------------------------------------ a training batch
    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Decide what this training batch does with the targets, from its key (nothing once graphs are off)."""
        if not self.machine.graphs_allowed:
            return
        key = batch_key(batch)
        opaque = opaque_reason(batch) if key is None else ""
        self.begin_step(trainer.global_step, key, trainer.accumulate_grad_batches > 1, opaque)

    def begin_step(self, step: int, batch: tuple[Any, ...] | None, accumulating: bool, opaque: str = "") -> None:
        """Decide what this batch does with the targets: replay, record, capture, or fall back.

        ``batch`` is the batch's key; ``None`` for a batch the package cannot see into (``opaque`` says why): its
        step runs eagerly, counted, or graphs are off when no graph exists yet.
        """
        if batch is None:
            if self.machine.stage == Stage.WARMUP:
                self.machine.disable("opaque_batch", detail=opaque)
            else:
                self.router.begin(StepRoute(fallback_reason=f"opaque_batch: {opaque}"))
            return
        graph_set = self.graph_sets.get(batch)
        if graph_set is None:
            graph_set = self._graph_set_for(batch)
        if graph_set is not None:
            self._audit_when_due(graph_set)
            self._begin_graphed_step(graph_set, step, graph_set.confirm_left > 0, accumulating)

    def _audit_when_due(self, graph_set: GraphSet) -> None:
        """Every ``audit_every_n_steps`` replayed steps, check one region again (round-robin) as confirmation did.

        The region's forward graph replays beside the eager forward on the step's real inputs (parity), and the
        step checks addresses and backward order; a region that fails is excluded (or the fit rolls back), loudly.
        """
        every = self.config.audit_every_n_steps
        if not every or self.machine.stage != Stage.REPLAYING or graph_set.confirm_left > 0 or not graph_set.entries:
            return
        self._since_audit += 1
        if self._since_audit < every:
            return
        indices = sorted(graph_set.entries)
        graph_set.entries[indices[self.report.audits % len(indices)]].parity_checked = False
        graph_set.confirm_left = 1
        self._since_audit = 0
        self.report.audits += 1

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
        self._count_step(route)
        if not self.machine.graphs_allowed:
            return
        if self._problem_rolls_back(route):
            return
        graph_set = route.graph_set
        if graph_set is None or not route.confirming or not self._confirmed(route):
            return
        graph_set.replays += route.replays
        graph_set.graphed_step_seen |= bool(route.forward_order) and not route.parity
        graph_set.confirm_left -= 1
        if self.machine.stage == Stage.CONFIRMING:
            self.machine.confirm_losses.observe(outputs)
            if graph_set.confirm_left <= 0:
                self._finish_confirmation(graph_set)

    def _problem_rolls_back(self, route: StepRoute) -> bool:
        """Roll back on a problem the step found (parameters changed), taken for every rank at once.

        A confirming step ends at a decision point on every rank: the problem is agreed there. A replaying step
        is not one: alone, the rollout rolls back now; under several ranks the problem waits for the next health
        check (its steps fall back to eager on this rank until then, which keeps them right).
        """
        agreement = self.machine.agreement
        if route.confirming:
            if agreement.any_of([route.problem is not None])[0]:
                self.machine.rollback(route.problem or "address_changed: a parameter was rebound on another rank")
                return True
            return False
        if route.problem is None:
            return False
        if agreement.world_size == 1:
            self.machine.rollback(route.problem)
        else:
            self._pending_problem = self._pending_problem or route.problem
        return True

    def health_check(self, step: int) -> None:
        """Under several ranks, once per log interval: roll back every rank if one found a problem since."""
        if self.machine.agreement.world_size == 1 or not self.machine.graphs_allowed:
            return
        problem, self._pending_problem = self._pending_problem, None
        if self.machine.agreement.any_of([problem is not None])[0]:
            self.machine.rollback(problem or "parameters changed on another rank since capture")

    def _after_step(self, route: StepRoute) -> None:
        """Extension point for what a capture mode keeps per step (the FP8 weight cache)."""

    def _count_step(self, route: StepRoute) -> None:
        if not self.captured_any:
            return
        graphed = route.graph_set is not None and route.fallbacks == 0 and route.replays > 0
        if graphed:
            self.report.steps_replayed += 1
        else:
            self.report.steps_eager += 1

    def abandon_step(self) -> None:
        """Drop the batch being recorded: it never ran to its end."""
        route = self.router.end()
        if route is not None and route.recorder is not None:
            route.recorder.discard_step()

    # ------------------------------------------------------------------ stages 2-4: stabilization, shapes, capture
    def _graph_set_for(self, batch: tuple[Any, ...]) -> GraphSet | None:
        """A shape without graphs: record it eagerly until stable, then capture it (or fall back, counted)."""
        captured = ", ".join(describe_batch_key(k) for k in self.graph_sets.shapes()) or "nothing yet"
        change = f"batch shape {describe_batch_key(batch)} differs from the captured {captured}"
        in_use = self.machine.stage != Stage.WARMUP  # graphs of other shapes exist: an eager step is a fallback
        if in_use:
            if not self.graph_sets.admits(batch):
                raise self.graph_sets.sealed_error(batch)
            if self.config.on_shape_change == "error":
                raise shape_change_error(self.component, change)
            if self.config.on_shape_change == "eager" or batch in self._uncapturable:
                why = "; it cannot be captured" if batch in self._uncapturable else ""
                self.router.begin(StepRoute(fallback_reason=change + why))
                return None
        needed = 1 if self.captured_any else self.settings.first_eager_steps * self._microbatches
        if self.recorder.recorded_steps(batch) < needed:  # this shape's own stabilization
            self.recorder.begin_step(batch, keep_samples=True)
            self.router.begin(StepRoute(recorder=self.recorder, fallback_reason=change if in_use else None))
            return None
        if not in_use and not self.machine.warmup_was_finite():
            return None
        plan = self.recorder.plan(excluded=self.regions.left_out(), batch=batch)
        if plan.unstable is not None or not plan.calls:
            return self._not_capturable(batch, plan.unstable, plan.skipped, change, in_use)
        _say_what_stays_eager(self.component, self.regions.active_targets, plan.skipped)
        if not self._capture(batch, plan.calls):
            return None
        if not in_use:
            self.machine.begin_confirmation()
            self.state.watch(
                (f"{t.name}.{n}", tensor)
                for t in self.regions.active_targets
                for n, tensor in (*t.module.named_parameters(), *t.module.named_buffers())
            )
        return self.graph_sets.get(batch)

    def _not_capturable(
        self, batch: tuple[Any, ...], unstable: str | None, skipped: dict[str, str], change: str, in_use: bool
    ) -> None:
        if not in_use:  # the first shape: graphs are not for this fit
            if unstable is not None:
                self.machine.disable(
                    f"shape_unstable: {unstable}", detail=f"input signatures moved during warmup: {unstable}"
                )
            else:
                self.machine.disable("no_targets", detail=f"no target module ran in a training step: {skipped}")
            return
        why = f"its input signatures moved: {unstable}" if unstable else "no target ran in it"
        rank_zero_warn(f"{self.component}: batch shape {describe_batch_key(batch)} stays eager: {why}")
        self._uncapturable.add(batch)
        self.recorder.forget(batch)
        self.router.begin(StepRoute(fallback_reason=f"{change}; it cannot be captured: {why}"))

    def _capture(self, batch: tuple[Any, ...], calls: list[RecordedCall]) -> bool:
        """Capture a graph set for ``batch`` with the targets' hooks stashed; on failure roll back (or raise)."""
        self._before_first_capture()
        self._note_memory_before_capture()
        started = time.perf_counter()
        regions = self.narrowing.capture(
            calls,
            lambda: self.recorder.plan(self.regions.left_out(), batch).calls,
            self.settings.warmup_iters,
            self.capture_method,
        )
        if regions is None:
            return False
        for region in regions:
            region.on_backward = self.router.on_backward
        entries = {self._index[region.name]: ReplayEntry(region) for region in regions}
        self.graph_sets.add(batch, GraphSet(batch, entries, confirm_left=self.config.confirm_steps))
        if not self.settings.keep_samples:
            self.recorder.forget(batch)
        self._autocast = self._autocast or any(region.signature.autocast[0] for region in regions)
        if not self._captured(started, sum(len(s.entries) for s in self.graph_sets.values())):
            return False
        updated = self.narrowing.updated
        if updated:
            self.machine.rollback(
                f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside a captured region; a replay"
                " would not count their updates. Fix: update metrics in training_step or on_train_batch_end"
                " from the step's outputs, outside the captured modules"
            )
            return False
        held = f"; graphs hold {self.report.pool_mib:.1f} MiB" if self.settings.measure_pool else ""
        rank_zero_info(
            f"{self.component}: captured {len(regions)} region(s) for batch {describe_batch_key(batch)} in"
            f" {self.report.capture_ms:.0f} ms{held}"
        )
        return True

    # ------------------------------------------------------------------ stage 5: replay confirmation
    def _confirmed(self, route: StepRoute) -> bool:
        """Weigh a confirming step: parity within tolerance, backward in reverse forward order."""
        if route.parity and not self._parity_holds(route):
            return False
        expected = [name for name in reversed(route.forward_order) if name in set(route.backward_order)]
        if route.backward_order and route.backward_order != expected:
            self.machine.rollback(
                "backward_order: regions ran backward in another order than the reverse of their forward"
                f" ({route.backward_order} vs {expected}); they cannot share one memory pool"
            )
            return False
        return True

    def _parity_holds(self, route: StepRoute) -> bool:
        """Regions whose graphed forward differs from eager stay eager, the same ones on every rank.

        With no region left, or a fixed scope under ``on_failure="raise"``, the rollout rolls back instead.
        """
        tolerance = self.parity_tolerance()
        errors = [(index, float(error)) for index, error in route.parity]  # confirmation only: host syncs allowed
        agreed = self.machine.agreement.any_of([not error <= tolerance for _, error in errors])
        bad = {index: error for (index, error), failed in zip(errors, agreed, strict=True) if failed}
        kept = [error for index, error in errors if index not in bad]
        if kept:
            previous = self.report.parity_err
            self.report.parity_err = max(kept) if math.isnan(previous) else max(previous, *kept)
        if not bad:
            return True
        worst = max(bad.values())
        reason = f"parity: graphed forward differs from eager by {worst:.3g} (tolerance {tolerance:g})"
        left = route.graph_set.entries.keys() - bad.keys()
        if not left or (self.config.on_failure == "raise" and not self.config.auto_scope):
            self.machine.rollback(reason)
            return False
        for index, error in bad.items():
            where = f" by {error:.3g}" if not error <= tolerance else f" on another rank (here by {error:.3g})"
            self.regions.exclude(
                self.targets[index].name, f"parity: graphed forward differs from eager{where} (tolerance {tolerance:g})"
            )
            for graph_set in self.graph_sets.values():
                entry = graph_set.entries.pop(index, None)
                if entry is not None:
                    entry.region.reset()
        self.report.graphs = sum(len(s.entries) for s in self.graph_sets.values())
        return True

    def parity_tolerance(self) -> float:
        """The tolerance of the parity check: the option, or the default of the captured precision."""
        if self.config.parity_tol is not None:
            return self.config.parity_tol
        if self._autocast:
            return REDUCED_PRECISION_PARITY_TOL
        return COMPILED_PARITY_TOL if self.config.compile is not None else DEFAULT_PARITY_TOL

    def _finish_confirmation(self, graph_set: GraphSet) -> None:
        """Confirm once a step ran on graphs forward and backward (steps that checked parity trained eagerly)."""
        if graph_set.replays == 0:
            self.machine.rollback("not_replayed: no graph replayed during confirmation (the targets were bypassed)")
        elif graph_set.graphed_step_seen:
            self.machine.confirm(graphs=self.report.graphs)
        else:
            graph_set.confirm_left = 1  # one more step, on the graphs

    @property
    def shape_cache(self) -> ShapeCache[GraphSet]:
        """The graph sets by batch shape."""
        return self.graph_sets

    def captured_regions(self) -> frozenset[str]:
        """The names of the regions captured now (the active targets)."""
        return frozenset(target.name for target in self.regions.active_targets)

    def switch_level(self, names: Sequence[str]) -> bool:
        """From the next batch on, capture these targets in place (``False`` once released: build a new driver)."""
        if self._released:
            return False
        self.capture_level(names)
        return True

    def settle(self) -> None:
        """The ladder settled on this level: drop the samples kept for other levels."""
        self.forget_samples()

    def capture_level(self, names: Sequence[str]) -> None:
        """From the next batch on, capture these targets (a level of ``scope="auto"``).

        The graphs held now are released; the samples recorded so far serve the new capture, so it needs no eager
        step of its own.
        """
        self.router.end()
        for graph_set in self.graph_sets.clear():
            graph_set.reset()
        self.report.graphs = 0
        self.regions.set_active(names)

    def forget_samples(self) -> None:
        """Drop recorded samples kept for later levels (they hold device memory)."""
        self.settings = replace(self.settings, keep_samples=False)
        for batch in self.graph_sets.shapes():
            self.recorder.forget(batch)

    def seal(self, self_check: bool) -> None:
        """Close the set of batch shapes; with ``self_check``, confirm every captured shape again on its next step.

        The check replays each region's forward and runs the eager forward on the same inputs (parity), and checks
        addresses and the backward order, as the first confirmation did.
        """
        self.graph_sets.seal()
        if self_check:
            for graph_set in self.graph_sets.values():
                graph_set.confirm_left = max(graph_set.confirm_left, 1)
                for entry in graph_set.entries.values():
                    entry.parity_checked = False

    # ------------------------------------------------------------------ stage 7: release
    def release(self) -> None:
        """Restore every forward first (what a user would trip over most), then reset every graph."""
        self._released = True
        self.router.end()
        self.forwards.restore()
        graph_sets = self.graph_sets.clear()
        try:
            for graph_set in graph_sets:
                graph_set.reset()
        finally:
            self.report.graphs = 0
            self.recorder.clear()  # its sample inputs are device tensors


def _say_what_stays_eager(component: str, targets: Sequence[Target], skipped: dict[str, str]) -> None:
    """Targets left out of a capture, and hooks inside captured regions (they fire in eager steps only)."""
    for name, why in skipped.items():
        rank_zero_info(f"{component}: {name} stays eager: {why}")
    for target in targets:
        hooks = inner_hook_count(target.module)
        if hooks:
            rank_zero_warn(
                f"{component}: {hooks} hook(s) on modules inside {target.name} fire during eager steps only,"
                " not while it replays as a graph (hooks on the region itself keep firing)."
            )

"""Stages 3-4 of the scoped driver: a batch shape's capture plan from its recorded steps, then its graph set.

The captured regions become a graph set, counted and checked against the memory budget and the metrics inside them.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import CaptureMethod
from lightning_cudagraph._graphs.base import Driver
from lightning_cudagraph._graphs.region_capture import NarrowingCapture, say_what_stays_eager
from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._graphs.routing import CallRouter, GraphSet, ReplayEntry, StepRoute
from lightning_cudagraph._options.batches import describe_batch_key
from lightning_cudagraph._options.hooks import inner_backward_hooks
from lightning_cudagraph._trust.cadence import GraphChecks
from lightning_cudagraph._trust.evidence import StateWatch
from lightning_cudagraph._trust.guards import GuardSet
from lightning_cudagraph._trust.recording import CapturePlan, WarmupRecorder
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.shape_change import ShapeOutcome
from lightning_cudagraph._warnings import warn_user
from lightning_cudagraph.health import Stage


def backward_hooks_inside(region: str, hooked: list[str]) -> str:
    """Why a region with backward hooks inside it stays eager."""
    return (
        f"backward hook(s) on {region}.{hooked[0]} inside it would not fire while it replays, and a replayed backward"
        " is not compared with eager. Fix: register the hook on the region itself, or remove it for the fit"
    )


#: What a user can do about a value a region's forward read that changes between steps.
GUARD_FIX = (
    "set it before the fit or during the warmup steps, or keep a value that changes in a device tensor the forward"
    " reads (register_buffer, then fill_ between steps), which a replay reads anew (docs/python.md)"
)


class GraphSetCapture:
    """Captures the graph set of one batch shape for a scoped driver.

    Args:
        driver: The scoped driver (its options, settings, stage machine and capture bookkeeping).
        router: Routes the targets' calls (told about each region's backward).
        state: Watches the captured regions' tensors from the first capture on.
        checks: The regions' checks against eager (a new graph set owes its confirmation).
    """

    def __init__(
        self,
        driver: Driver,
        regions: RegionSet,
        recorder: WarmupRecorder,
        narrowing: NarrowingCapture,
        router: CallRouter,
        graph_sets: ShapeCache[GraphSet],
        state: StateWatch,
        checks: GraphChecks,
    ) -> None:
        self.driver, self.regions, self.recorder, self.narrowing = driver, regions, recorder, narrowing
        self.router, self.graph_sets, self.state, self.checks = router, graph_sets, state, checks
        self.machine, self.report, self.component = driver.machine, driver.report, driver.component
        #: Batch shapes found not capturable (their steps fall back to eager, counted).
        self.uncapturable: set[tuple[Any, ...]] = set()
        #: Whether a captured region runs under autocast (the parity tolerance of reduced precision).
        self.autocast = False

    def capture_shape(
        self, batch: tuple[Any, ...], outcome: ShapeOutcome, method: CaptureMethod | None
    ) -> GraphSet | None:
        """Plan the capture from the shape's recorded steps and capture it; the first shape starts confirmation."""
        first = self.machine.stage == Stage.WARMUP
        for target in self.regions.active_targets:
            hooked = inner_backward_hooks(target.module)
            if hooked:
                self.regions.exclude(target.name, backward_hooks_inside(target.name, hooked))
        plan = self.recorder.plan(excluded=self.regions.left_out(), batch=batch)
        for name, why in plan.python.items():  # the same forward would vary again: eager for the rest of the fit
            self.regions.exclude(name, why)
        if plan.unstable is not None or not plan.calls:
            self._not_capturable(batch, plan, outcome.reason)
            return None
        left_out = {name: why for name, why in plan.skipped.items() if name not in plan.python}  # those warned above
        say_what_stays_eager(self.component, self.regions.active_targets, left_out)
        if not self._capture(batch, plan, outcome, method):
            return None
        if first:
            self.machine.begin_confirmation()
            targets = self.regions.active_targets
            inside = [(f"{t.name}.{n}" if n else t.name, m) for t in targets for n, m in t.module.named_modules()]
            self.state.watch(  # a region's own mode and hooks act around its replay: the modules inside it are watched
                ((f"{t.name}.{n}", tensor) for t in targets for n, tensor in _tensors_of(t.module)),
                ((f"{t.name}.{n}", m, t.module) for t in targets for n, m in t.module.named_modules() if n),
                GuardSet("the regions", inside, fix=GUARD_FIX),
            )
        return self.graph_sets.get(batch)

    def _not_capturable(self, batch: tuple[Any, ...], plan: CapturePlan, change: str | None) -> None:
        """The first shape: graphs are off for this fit. A later one: it stays eager, loudly."""
        if change is None:  # under scope="auto", another level may not have the problem: the ladder moves on
            if plan.unstable is not None:
                detail = f"input signatures moved during the warmup steps: {plan.unstable}"
                reason = f"shape_unstable: {plan.unstable}"
            else:
                why = _why_none(plan.skipped)
                reason, detail = f"no_targets: {why}", f"{why}: {plan.skipped}"
            if not self.machine.level_failed(reason):
                self.machine.disable(reason, detail=detail)
            return
        why = f"its input signatures moved: {plan.unstable}" if plan.unstable else "no target ran in it"
        warn_user(f"{self.component}: batch shape {describe_batch_key(batch)} stays eager: {why}")
        self.uncapturable.add(batch)
        self.recorder.forget(batch)
        self.router.begin(StepRoute(fallback_reason=f"{change}; it cannot be captured: {why}"))

    def _capture(
        self, batch: tuple[Any, ...], plan: CapturePlan, outcome: ShapeOutcome, method: CaptureMethod | None
    ) -> bool:
        """Capture a graph set for ``batch`` with the targets' hooks stashed; on failure roll back (or raise)."""
        settings = self.driver.settings
        self.driver.before_capture()
        started = time.perf_counter()
        replan = lambda: self.recorder.plan(self.regions.left_out(), batch).calls  # noqa: E731
        regions = self.narrowing.capture(plan.calls, replan, settings.warmup_iters, method)
        if regions is None:
            return False
        for region in regions:
            region.on_backward = self.router.on_backward
        entries = {self.regions.index[region.name]: ReplayEntry(region) for region in regions}
        self.graph_sets.add(batch, GraphSet(batch, entries, confirm_left=self.checks.captured()))
        if not settings.keep_samples:
            self.recorder.forget(batch)
        self.autocast = self.autocast or any(region.signature.autocast[0] for region in regions)
        if not self.driver.count_capture(started, sum(len(s.entries) for s in self.graph_sets.values())):
            return False
        if self.narrowing.updated:
            self.machine.rollback(
                f"metric_in_graph: torchmetrics metric(s) {self.narrowing.updated} are updated inside a captured"
                " region; a replay would not count their updates. Fix: update metrics in training_step or"
                " on_train_batch_end from the step's outputs, outside the captured modules"
            )
            return False
        held = f"; graphs hold {self.report.pool_mib:.1f} MiB" if settings.measure_pool else ""
        evicted = f"; evicted batch {describe_batch_key(outcome.evicts)}" if outcome.evicts is not None else ""
        rank_zero_info(
            f"{self.component}: captured {len(regions)} region(s) for batch {describe_batch_key(batch)} in"
            f" {self.report.capture_ms:.0f} ms{held}{evicted}"
        )
        return True


def _why_none(skipped: dict[str, str]) -> str:
    """Why no target of a batch shape can be captured, from why each was left out."""
    reasons = set(skipped.values())
    if len(reasons) == 1:
        (reason,) = reasons
        return f"every target was left eager: {reason}"
    return "no target module ran once per training step, with grad, in training mode"


def _tensors_of(module: Any) -> list[tuple[str, Any]]:
    return [*module.named_parameters(), *module.named_buffers()]

"""Capture passes of scoped regions, narrowed around the regions that cannot be captured.

A pass captures the planned calls in execution order into one pool; every rank agrees its outcome. A pass that fails
as a whole rolls back. A region that fails is left eager (under ``scope="auto"`` a layer gives way to its parts), and
the pass runs again without it into a new pool: the allocator cannot capture into a pool after a failed capture.
A pass runs the regions' Python several times (warmup iterations, capture): what it changed, the random generators kept
on the regions' modules included, is put back; a region that drew from one fails, since its graph would hold the draw.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import (
    CaptureBackend,
    CaptureMethod,
    CapturePassResult,
    RecordedCall,
    RegionGraphs,
)
from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.hooks import global_hooks_warning, hooks_stashed, inner_hook_count
from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._trust.capture_hints import capture_failure
from lightning_cudagraph._trust.evidence import MetricUpdates
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph._warnings import warn_user


class NarrowingCapture:
    """Runs capture passes until the regions left can all be captured, or nothing is left.

    Args:
        regions: Which targets are captured; exclusions and replacements are recorded there.
    """

    def __init__(
        self, config: CUDAGraphConfig, backend: CaptureBackend, machine: StageMachine, regions: RegionSet
    ) -> None:
        self.config, self.backend, self.machine, self.regions = config, backend, machine, regions
        #: Update counts of the metrics inside the last pass's regions, taken before it.
        self.metrics = MetricUpdates([])
        #: The metrics inside the regions that the last pass updated (warmup iterations and capture; then put back).
        self.updated: list[str] = []
        #: The generators held inside each region that the last pass drew from (then put back).
        self.drew: dict[str, list[str]] = {}

    def capture(
        self,
        calls: list[RecordedCall],
        replan: Callable[[], list[RecordedCall]],
        warmup_iters: int,
        how: CaptureMethod | None = None,
    ) -> list[RegionGraphs] | None:
        """The regions captured, or ``None`` when the capture failed as a whole (then it has rolled back).

        Args:
            calls: The planned calls, in execution order.
            replan: The calls left to capture once the regions that failed are out.
            warmup_iters: Eager forward-backward runs per region before its capture.
            how: How regions are captured (``None``: the backend's default).
        """
        captured = self._pass(calls, warmup_iters, how)
        while captured is not None and captured.failed:
            if not self._narrow(captured):
                return None
            if captured.warmed:  # else a model whose every layer fails would warm up n + (n - 1) + ... layers
                warmup_iters = 0
            self.backend.renew_pool()
            captured = self._pass(replan(), warmup_iters, how)
        return None if captured is None else captured.regions

    def _pass(
        self, calls: list[RecordedCall], warmup_iters: int, how: CaptureMethod | None
    ) -> CapturePassResult | None:
        """One capture pass, its outcome agreed by every rank; ``None`` when it failed as a whole (rolled back)."""
        modules = [call.module for call in calls]
        self.metrics = MetricUpdates((call.name, call.module) for call in calls)
        # Capture warmup iterations and the capture run the regions' Python: metric updates and counters are put back.
        before = {id(module): TrainingState.take(module) for module in modules}
        error: Exception | None = None
        started = time.perf_counter()
        try:
            with self.backend.preserved(modules), self.backend.failure_guard() as guard, hooks_stashed(modules):
                captured = self.backend.capture_regions(calls, warmup_iters, how)
                if captured.failed and guard is not None:  # reported, not raised: the generator is still put back
                    guard.mark_failed()
        except Exception as err:  # a failed capture must not end training silently, nor leak anything
            error, captured = err, CapturePassResult()
        finally:
            self.machine.report.capture_ms_total += (time.perf_counter() - started) * 1e3
            self.updated = self.metrics.changed()
            # A draw the warmup steps did not show (a condition they could not see): the graph would hold it.
            self.drew = {call.name: drew for call in calls if (drew := before[id(call.module)].drawn())}
            for state in before.values():
                state.restore()
        for name in self.drew.keys() - captured.failed.keys():
            captured.failed[name] = RuntimeError(f"its forward drew from {', '.join(self.drew[name])}")
        # One collective: did the pass fail as a whole on any rank, and which regions failed on any rank.
        whole, *agreed = self.machine.agreement.any_of([error is not None, *(c.name in captured.failed for c in calls)])
        if whole:
            for region in captured.regions:
                region.reset()
            self._failed(error or RuntimeError("the capture failed on another rank"))
            return None
        captured.failed = {
            call.name: captured.failed.get(call.name) or RuntimeError("its capture failed on another rank")
            for call, failed in zip(calls, agreed, strict=True)
            if failed
        }
        return captured

    def _narrow(self, captured: CapturePassResult) -> bool:
        """Leave the regions that failed eager (a layer: its parts instead); ``False`` if nothing is left to try."""
        for region in captured.regions:  # one pass, one pool: the others are captured again
            region.reset()
        reasons = {name: self._failure_reason(name, e) for name, e in captured.failed.items()}
        if self.machine.policy.part_failure_stops_graphs:
            name = next(iter(reasons))
            self.machine.rollback(f"{name}: {reasons[name]}", captured.failed[name])
            return False
        replaced = {name for name in reasons if self.regions.replace_with_parts(name, reasons[name])}
        left = [t for t in self.regions.active_targets if t.name not in reasons]
        for name in reasons.keys() - replaced:
            self.regions.exclude(name, reasons[name], warn=bool(left))
        if not left:
            first = next(iter(reasons.values()))
            if first.startswith("metric_in_graph"):  # the cause the user can act on, with its fix
                self.machine.rollback(first, captured.failed[next(iter(reasons))])
                return False
            self._failed(
                RuntimeError(f"no region could be captured; {len(self.regions.excluded)} failed, last: {first}")
            )
            return False
        return True

    def _failure_reason(self, name: str, error: Exception) -> str:
        """Why a region's capture failed: a torchmetrics update inside it (its host sync) comes first, with the fix."""
        inside = [metric for metric in self.updated if metric.startswith(f"{name}.")]
        if inside:
            return (
                f"metric_in_graph: torchmetrics metric(s) {inside} are updated inside the captured region {name}"
                f" (its capture failed: {type(error).__name__}: {error}); a replay would not count their updates."
                " Fix: update metrics in training_step or on_train_batch_end from the step's outputs, outside the"
                " captured modules"
            )
        if name in self.drew:
            return (
                f"step_python: its forward drew from {', '.join(self.drew[name])} while it was captured, which a graph"
                " would freeze (a replay draws nothing). Fix: draw with torch on the device (torch.rand(...,"
                " device=x.device)), which a replay draws anew"
            )
        return capture_failure(error, self.regions.targets[self.regions.index[name]].module)

    def _failed(self, error: Exception) -> None:
        self.machine.rollback(f"capture_failed: {type(error).__name__}: {error}", error)


def say_what_stays_eager(component: str, targets: Sequence[Target], skipped: dict[str, str]) -> None:
    """Before a capture: the targets left out of it, and hooks inside captured regions (they fire in eager steps)."""
    for name, why in skipped.items():
        rank_zero_info(f"{component}: {name} stays eager: {why}")
    if note := global_hooks_warning(component, [target.name for target in targets]):
        warn_user(note)
    for target in targets:
        hooks = inner_hook_count(target.module)
        if hooks:
            warn_user(
                f"{component}: {hooks} hook(s) on modules inside {target.name} fire during eager steps only,"
                " not while it replays as a graph (hooks on the region itself keep firing)."
            )

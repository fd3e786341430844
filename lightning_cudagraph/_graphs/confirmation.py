"""Confirmation and audits of scoped regions: the checks a confirming step ran, weighed once the step ends.

The router (:mod:`lightning_cudagraph._graphs.routing`) records parity, addresses and backward order. Here a region
that disagrees with eager is excluded (the same ones on every rank), a wrong backward order or a moved parameter
rolls back, and the stage machine confirms once a step ran on graphs forward and backward. An audit is the same
check of one region again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._graphs.routing import GraphSet, StepRoute
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust.cadence import GraphChecks
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import Stage


class RegionConfirmation:
    """Weighs what confirming and audited steps saw, and turns it into exclusions, rollbacks or a confirmation.

    ``tolerance`` gives the parity tolerance of the captured precision, read when a step is weighed.
    """

    def __init__(
        self,
        config: CUDAGraphConfig,
        machine: StageMachine,
        regions: RegionSet,
        graph_sets: ShapeCache[GraphSet],
        tolerance: Callable[[], float],
    ) -> None:
        self.config, self.machine, self.regions, self.graph_sets = config, machine, regions, graph_sets
        self.report = machine.report
        self._tolerance = tolerance
        self._pending_problem: str | None = None
        self.checks = GraphChecks(config.confirm_steps, config.audit_every_n_steps, self.report)
        self._turn = 0  # the region the next audit checks, in turn

    def audit_when_due(self, graph_set: GraphSet) -> None:
        """When an audit is due (:class:`~lightning_cudagraph._trust.cadence.GraphChecks`), check one region again.

        The regions take their turns; the step then checks it as a confirming step does.
        """
        if self.machine.stage != Stage.REPLAYING or graph_set.confirm_left > 0 or not graph_set.entries:
            return
        if not self.checks.audit_due():
            return
        indices = sorted(graph_set.entries)
        graph_set.entries[indices[self._turn % len(indices)]].parity_checked = False
        graph_set.confirm_left = 1
        self._turn += 1

    def recheck(self) -> None:
        """Confirm every captured shape again on its next step (the seal's self-check)."""
        for graph_set in self.graph_sets.values():
            graph_set.confirm_left = max(graph_set.confirm_left, 1)
            for entry in graph_set.entries.values():
                entry.parity_checked = False

    def step_ended(self, route: StepRoute, outputs: Any) -> None:
        """Weigh what the step saw (stage 5): a problem, the checks of a confirming step, the confirmation itself."""
        if not self.machine.graphs_allowed or self._problem_rolls_back(route):
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
                self._finish(graph_set)

    def health_check(self) -> None:
        """Under several ranks, once per log interval: roll back every rank if one found a problem since."""
        if self.machine.agreement.world_size == 1 or not self.machine.graphs_allowed:
            return
        problem, self._pending_problem = self._pending_problem, None
        if self.machine.agreement.any_of([problem is not None])[0]:
            self.machine.rollback(problem or "parameters changed on another rank since capture")

    def _problem_rolls_back(self, route: StepRoute) -> bool:
        """Roll back on a problem the step found (parameters changed), taken for every rank at once.

        A confirming step ends at a decision point on every rank, so the problem is agreed there. A replaying step is
        not one: under several ranks the problem waits for the next health check (this rank's steps run eagerly).
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
        tolerance = self._tolerance()
        errors = [(index, float(error)) for index, error in route.parity]  # confirmation only: host syncs allowed
        agreed = self.machine.agreement.any_of([not error <= tolerance for _, error in errors])
        bad = {index: error for (index, error), failed in zip(errors, agreed, strict=True) if failed}
        self.checks.checked(*[error for index, error in errors if index not in bad])
        if not bad:
            return True
        worst = max(bad.values())
        reason = f"parity: graphed forward differs from eager by {worst:.3g} (tolerance {tolerance:g})"
        left = route.graph_set.entries.keys() - bad.keys() if route.graph_set is not None else set()
        if not left or self.machine.policy.part_failure_stops_graphs:
            self.machine.rollback(reason)
            return False
        for index, error in bad.items():
            where = f" by {error:.3g}" if not error <= tolerance else f" on another rank (here by {error:.3g})"
            self.regions.exclude(
                self.regions.targets[index].name,
                f"parity: graphed forward differs from eager{where} (tolerance {tolerance:g})",
            )
            for graph_set in self.graph_sets.values():
                entry = graph_set.entries.pop(index, None)
                if entry is not None:
                    entry.region.reset()
        self.report.graphs = sum(len(s.entries) for s in self.graph_sets.values())
        return True

    def _finish(self, graph_set: GraphSet) -> None:
        """Confirm once a step ran on graphs forward and backward (steps that checked parity trained eagerly)."""
        if graph_set.replays == 0:
            self.machine.rollback("not_replayed: no graph replayed during confirmation (the targets were bypassed)")
        elif graph_set.graphed_step_seen:
            self.machine.confirm(graphs=self.report.graphs)
        else:
            graph_set.confirm_left = 1  # one more step, on the graphs

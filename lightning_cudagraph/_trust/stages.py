"""The stage machine of the staged rollout: where a fit is, the transitions, and how graphs are given up.

The report is written from it, never read back. A decision on the losses takes one host sync when it is due: the
steps before fold theirs into one device flag (:class:`LossWatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._lightning import step_loss
from lightning_cudagraph._trust.agreement import RankAgreement
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._warnings import warn_user
from lightning_cudagraph.health import CUDAGraphReport, Stage


class LossWatch:
    """Folds ``~isfinite(loss)`` of every step into one device flag; :meth:`any_nonfinite` is the one host sync.

    Example:
        >>> import torch
        >>> watch = LossWatch()
        >>> watch.observe(torch.tensor(1.0)); watch.observe({"loss": torch.tensor(float("nan"))})
        >>> watch.any_nonfinite()
        True
    """

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None

    def observe(self, output: Any) -> None:
        """Add a ``training_step`` output (no host sync); outputs without a loss tensor are ignored."""
        loss = step_loss(output)
        if loss is not None:
            bad = ~torch.isfinite(loss.detach()).all()
            self._flag = bad if self._flag is None else self._flag | bad

    def any_nonfinite(self) -> bool:
        """Whether any observed loss was not finite; clears the watch."""
        flag, self._flag = self._flag, None
        return flag is not None and bool(flag)


class StageMachine:
    """Stages of one fit and their transitions (see :class:`~lightning_cudagraph.Stage`).

    ``WARMUP`` -> ``CONFIRMING`` (the first captured shape's replays, checked) -> ``REPLAYING``; from any of them to
    ``DISABLED`` by :meth:`disable` (graphs are not for this fit) or :meth:`rollback` (a check failed), both after
    ``release`` frees every graph and restores everything patched. Shapes captured later are confirmed by their
    driver while the fit stays ``REPLAYING``.

    Example:
        >>> from lightning_cudagraph.health import CUDAGraphReport
        >>> from lightning_cudagraph._trust.failure import FailurePolicy
        >>> policy = FailurePolicy("CUDAGraphCallback", "eager")
        >>> machine = StageMachine(CUDAGraphReport(), policy, release=lambda: None)
        >>> machine.begin_confirmation(); machine.confirm(graphs=2); machine.stage
        <Stage.REPLAYING: 2>
    """

    def __init__(self, report: CUDAGraphReport, policy: FailurePolicy, release: Callable[[], None]) -> None:
        self.report = report
        self.policy = policy
        self.component = policy.component
        self._release = release
        #: Every decision below is taken once for all ranks (a no-op in a single process).
        self.agreement = RankAgreement(torch.device("cpu"))
        #: Offered a failure before it becomes a rollback; returns whether it handled it (``scope="auto"`` goes
        #: back to the best level confirmed before the one that failed).
        self.on_level_failure: Callable[[str], bool] | None = None
        self.warmup_losses = LossWatch()
        self.confirm_losses = LossWatch()
        self._write(Stage.WARMUP)

    @property
    def stage(self) -> Stage:
        """The current stage."""
        return self._stage

    @property
    def graphs_allowed(self) -> bool:
        """Whether graphs may still be captured or replayed in this fit."""
        return self._stage != Stage.DISABLED

    # ------------------------------------------------------------------ stage 2: eager stabilization
    def warmup_was_finite(self) -> bool:
        """The decision that ends the warmup steps (one host sync): were the eager losses finite? If not, stay eager."""
        if self.agreement.all_ok(not self.warmup_losses.any_nonfinite()):
            return True
        self.disable(
            "nonfinite_warmup",
            detail="a loss was not finite during the eager warmup steps; graphs are not captured over an unstable"
            " start (raise warmup_steps, or fix the divergence first)",
        )
        return False

    # ------------------------------------------------------------------ stage 5: replay confirmation
    def begin_confirmation(self) -> None:
        """The first graphs were captured: their driver checks the next steps before they are trusted."""
        self.confirm_losses = LossWatch()
        self._write(Stage.CONFIRMING)

    def confirm(self, graphs: int, nonfinite_first_step: int | None = None) -> None:
        """End confirmation (one host sync for the losses): replay from now on, or roll back."""
        finite = nonfinite_first_step is None and not self.confirm_losses.any_nonfinite()
        if not self.agreement.all_ok(finite):
            where = f" (first at step {nonfinite_first_step})" if nonfinite_first_step is not None else ""
            self.rollback(f"nonfinite_loss: a loss was not finite during confirmation{where}")
            return
        self._write(Stage.REPLAYING)
        rank_zero_info(f"{self.component}: replays confirmed; {graphs} graph(s) in steady state")

    # ------------------------------------------------------------------ giving graphs up
    def level_failed(self, reason: str) -> bool:
        """Offer a failure to the ladder (``scope="auto"``); whether it moved on to another level."""
        return self.on_level_failure is not None and self.on_level_failure(reason)

    def rollback(self, reason: str, error: BaseException | None = None) -> None:
        """A check failed: release, count it, then warn and go on eagerly, or raise (``on_failure="raise"``)."""
        if self.level_failed(reason):
            return
        self.report.rollbacks += 1
        self.report.rollback_reasons.append(reason)
        self._give_up(f"rollback: {reason}")
        self.policy.fail(
            f"CUDA graphs failed: {reason}",
            error,
            eager_message=f"{self.component}: rolled back to eager training: {reason}. Graphs, pool and patched"
            " forwards are released; training continues eagerly (cudagraph/stage=-1). Pass on_failure='raise' to stop"
            " instead.",
        )

    def disable(self, reason: str, detail: str | None = None, warn: bool = True) -> None:
        """Graphs are not for this fit (no CUDA, no targets, shapes that move, ...): release and say why."""
        self._give_up(reason)
        if warn:
            warn_user(f"{self.component}: CUDA graphs off ({reason}): {detail or reason}.")

    def _give_up(self, reason: str) -> None:
        self._stage = Stage.DISABLED
        self.report.stage, self.report.reason = Stage.DISABLED, reason
        self._release()

    def begin_level(self) -> None:
        """``scope="auto"`` moves to another level: its capture is ahead, as at the end of the warmup steps."""
        self.warmup_losses = LossWatch()
        self._write(Stage.WARMUP)

    def _write(self, stage: Stage) -> None:
        self._stage = stage
        self.report.stage = stage

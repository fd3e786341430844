"""The fit's log interval: the package's metrics through Lightning, and a last interval at the end.

Once per interval (``log_every_n_steps`` optimizer steps, and the step the Trainer stops at) the health check and the
metrics each read the device with one host sync, never one per step.
"""

from __future__ import annotations

import math
from typing import Any, cast

import lightning.pytorch as pl

from lightning_cudagraph._rollout.climb import Climb
from lightning_cudagraph._rollout.reporting import ProgressBarItems, log_through_lightning, log_to_loggers
from lightning_cudagraph.health import CUDAGraphReport

#: Steps between health checks and step-time reads when logging is off (Lightning's default ``log_every_n_steps``).
READ_EVERY_WITHOUT_LOGGING = 50


class FitLog:
    """Writes ``report`` as ``cudagraph/*`` once per log interval and shows the stage on the progress bar."""

    def __init__(self, report: CUDAGraphReport) -> None:
        self.report = report
        self._last_logged = -1
        self._bar = ProgressBarItems(self.bar_items)

    def interval_ended(self, trainer: pl.Trainer) -> bool:
        """Whether this batch ends an interval (at most once per optimizer step)."""
        step, every = trainer.global_step, _log_every(trainer) or READ_EVERY_WITHOUT_LOGGING
        if step == self._last_logged or (step % every and not trainer.should_stop):
            return False
        self._last_logged = step
        return True

    def write(self, trainer: pl.Trainer, module: pl.LightningModule, climb: Climb) -> None:
        """At the end of an interval: read its step times, log the metrics, show the stage on the bar."""
        metrics = self._interval_metrics(climb)
        if self._logs_metrics(trainer, climb):
            # One log_dict, from on_train_batch_end: the rows Lightning writes for the user's metrics at this step.
            log_through_lightning(module, metrics)
        if climb.attached:
            self._bar.show_on(trainer.progress_bar_callback)

    def flush(self, trainer: pl.Trainer, climb: Climb) -> None:
        """At ``on_train_end``: take the stage off the bar; log a last interval that Lightning's cadence did not write.

        Lightning refuses ``self.log`` in ``on_train_end``: those metrics go to the loggers directly, at the step
        Lightning would have used.
        """
        self._bar.remove()
        step = trainer.global_step
        if step == self._last_logged:
            return
        self._last_logged = step
        metrics = self._interval_metrics(climb)
        if self._logs_metrics(trainer, climb):
            log_to_loggers(trainer, metrics, step=max(step - 1, 0))

    def _interval_metrics(self, climb: Climb) -> dict[str, float]:
        """Read the interval's step times (one host sync on CUDA, none per step) and return the report's metrics."""
        climb.read_step_times()
        return self.report.metrics()

    @staticmethod
    def _logs_metrics(trainer: pl.Trainer, climb: Climb) -> bool:
        """Whether ``cudagraph/*`` metrics are logged: not with ``log_every_n_steps=0``, nor without a driver.

        A fit whose graphs were off before training (``no_cuda``, ``impl_none``, ``no_targets``) would log zeros that
        mean nothing: it logs what it would without the package.
        """
        return climb.attached and _log_every(trainer) > 0

    def bar_items(self) -> dict[str, str]:
        """``graphs=replaying``: the stage by name, the level under ``scope="auto"``, the speedup once measured."""
        shown = self.report.stage.label
        if self.report.level:
            shown += f" {self.report.level}"
        if not math.isnan(self.report.speedup):
            shown += f" {self.report.speedup:.2f}x"
        return {"graphs": shown}


def _log_every(trainer: pl.Trainer) -> int:
    """``Trainer(log_every_n_steps=...)``: Lightning sets it on the Trainer at init, out of its type's sight."""
    return int(cast(Any, trainer).log_every_n_steps)

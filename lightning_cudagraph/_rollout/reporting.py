"""How the report reaches the user during a fit: logged metrics, loggers, the progress bar, the last reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_cudagraph._graphs.base import Driver
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph.health import CUDAGraphReport, Stage

__all__ = ["ProgressBarItems", "log_through_lightning", "log_to_loggers", "why_not_engaged"]


def log_through_lightning(module: pl.LightningModule, metrics: dict[str, float]) -> None:
    """Log plain floats with one ``log_dict`` from a training-batch hook (``on_train_batch_end``).

    They land in the rows of the user's metrics, ``trainer.logged_metrics`` and ``trainer.callback_metrics``.
    Each value becomes a CPU tensor: no copy to the GPU, no host sync.
    """
    trainer = module.trainer
    if not metrics or trainer.barebones:  # barebones: Lightning refuses self.log (with a warning)
        return
    values = {key: torch.tensor(value, dtype=torch.float64) for key, value in metrics.items()}
    module.log_dict(values, on_step=True, on_epoch=False, logger=bool(trainer.loggers))


@rank_zero_only
def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Send plain floats to every logger of the Trainer, on rank zero: for hooks where ``self.log`` is refused."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class ProgressBarItems:
    """Extra items on a Lightning progress bar: strings too (``self.log(prog_bar=True)`` takes numbers only).

    This wraps the bar's ``get_metrics`` (the documented place that decides what it shows) on the one bar instance,
    and :meth:`remove` puts back what was there. ``items`` is read at every refresh (plain values, no host sync).

    Example:
        >>> from lightning.pytorch.callbacks import TQDMProgressBar
        >>> bar, items = TQDMProgressBar(), ProgressBarItems(lambda: {"graphs": "replaying"})
        >>> items.show_on(bar)
        >>> bar.get_metrics.__call__  # doctest: +ELLIPSIS
        <bound method _WithItems.__call__ of ...>
        >>> items.remove()
        >>> "get_metrics" in vars(bar)
        False
    """

    def __init__(self, items: Callable[[], dict[str, str]]) -> None:
        self._items = items
        self._bar: Any = None

    def show_on(self, bar: Any) -> None:
        """Add the items to ``bar`` (``trainer.progress_bar_callback``); no-op for ``None`` or the bar shown on."""
        if bar is None or bar is self._bar:
            return
        self.remove()
        _unwrap(bar)  # items left by a fit that ended on an exception
        bar.get_metrics = _WithItems(bar.get_metrics, vars(bar).get("get_metrics"), self._items)
        self._bar = bar

    def remove(self) -> None:
        """Give the bar back the ``get_metrics`` it had (idempotent)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            _unwrap(bar)


class _WithItems:
    """A bar's ``get_metrics`` with the package's items added after its own.

    ``replaced``: what the bar instance itself held as ``get_metrics`` before (``None``: only its class's method).
    """

    def __init__(
        self, get_metrics: Callable[..., dict[str, Any]], replaced: Any, items: Callable[[], dict[str, str]]
    ) -> None:
        self.get_metrics, self.replaced, self.items = get_metrics, replaced, items

    def __call__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {**self.get_metrics(trainer, pl_module), **self.items()}


def _unwrap(bar: Any) -> None:
    wrapper = vars(bar).get("get_metrics")
    if not isinstance(wrapper, _WithItems):
        return
    if wrapper.replaced is None:
        del bar.get_metrics
    else:
        bar.get_metrics = wrapper.replaced


def why_not_engaged(report: CUDAGraphReport, stage: Stage, steps: int, driver: Driver, config: CUDAGraphConfig) -> str:
    """Why a fit that ends after ``steps`` optimizer steps, in ``stage``, never replayed graphs in steady state."""
    level = f" at level {report.level!r}" if report.level else ""
    if stage == Stage.CONFIRMING:
        return (
            f"the fit ended during replay confirmation{level} after {steps} optimizer step(s); the graphs were"
            f" never trusted (confirm_steps={config.confirm_steps}: raise max_steps)"
        )
    eager = driver.settings.first_eager_steps
    if steps <= eager:
        return (
            f"the fit ended after {steps} optimizer step(s), within the {eager} eager warmup step(s) before"
            f" capture{level} (raise max_steps or lower warmup_steps)"
        )
    unkeyed = driver.why_not_captured()
    if unkeyed is not None:
        return unkeyed
    if report.captures:
        running = f"level {report.level!r}" if report.level else "a level"
        return (
            f"the fit ended after {steps} optimizer step(s) while {running} ran its eager steps before its"
            f" capture; {report.captures} capture(s) of other levels came before (raise max_steps)"
        )
    return f"no graph was captured{level} in {steps} optimizer step(s) (the targets did not run in a training step)"

"""Every place the package touches Lightning internals, behind one fence, so a Lightning upgrade is one file.

A replayed step never runs Lightning's closure, yet the loop consumes its result: it is rebuilt from the step's
output (NeMo's Lightning callback does the same).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor

#: A ``self.log`` call recorded during a capture: ``(name, value, args, kwargs)``.
LogCall = tuple[str, Any, tuple[Any, ...], dict[str, Any]]


def step_loss(output: Any) -> Tensor | None:
    """The loss of a ``training_step`` output (a tensor, or a dict with ``"loss"``), or ``None``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss if isinstance(loss, Tensor) else None


def set_closure_result(closure: Any, output: Any, normalize: int) -> None:
    """Hand Lightning's training loop the result of a step that ran as a graph replay."""
    if not isinstance(closure, Closure):
        raise RuntimeError(
            "lightning_cudagraph full_iteration: optimizer_step received a closure of type"
            f" {type(closure).__name__}, not Lightning's training closure. A LightningModule.optimizer_step override"
            " must pass `optimizer_closure` on unchanged: `optimizer.step(closure=optimizer_closure)`."
        )
    closure._result = ClosureResult.from_training_step_output(output, normalize)


def upcoming_batch(trainer: pl.Trainer) -> tuple[int, bool]:
    """The index in the epoch of the training batch about to run, and whether it is the epoch's last.

    Read in ``batch_to_device``: Lightning has fetched the batch (and knows whether it was the last) but not counted it.
    """
    loop = trainer.fit_loop.epoch_loop
    index = loop.batch_progress.current.ready
    return index, bool(loop.batch_progress.is_last_batch) or index + 1 == trainer.num_training_batches


def accumulation_sync_blocked(strategy: Any) -> contextlib.AbstractContextManager[None]:
    """Lightning's context for a micro-batch that only accumulates: DDP skips the gradient all-reduce (``no_sync``)."""
    return _block_parallel_sync_behavior(strategy, block=True)


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step)."""
    return trainer.fit_loop._should_accumulate()


def last_ready_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch being run is the epoch's last (Lightning then steps, whatever the window)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


@dataclass(frozen=True)
class _Feed:
    """Where a re-issued ``self.log`` call lands: its key, the metric registered for it, its ``batch_size``."""

    name: str
    key: str
    metric: Any
    batch_size: int | None


class StepLogs:
    """The ``self.log`` calls of a captured ``training_step``: recorded instead of run, re-issued after each replay.

    Lightning's ``self.log`` costs about half a millisecond of host time per call, as much as the rest of a replayed
    small step. So a call goes through ``self.log`` the first time (and after the epoch's metrics were reset), then
    feeds the metric it registered directly (``update_metrics``, where ``self.log`` ends), which keeps the same
    reduction, ``batch_size``, ``sync_dist`` and ``on_step``/``on_epoch`` handling. A value that is not a tensor, a
    graph-enabled value, a dataloader suffix or a LightningModule that overrides ``log`` always takes ``self.log``.

    Example:
        >>> import lightning.pytorch as pl
        >>> logs = StepLogs()
        >>> module = pl.LightningModule()
        >>> with logs.recorded(module):
        ...     module.log("train_loss", 0.5)
        >>> [name for name, *_ in logs.calls]
        ['train_loss']
    """

    def __init__(self, hook: str = "training_step") -> None:
        #: The step hook whose ``self.log`` calls these are (``validation_step`` for an evaluation graph).
        self.hook = hook
        self.calls: list[LogCall] = []
        self._feeds: list[_Feed | None] = []

    @contextlib.contextmanager
    def recorded(self, module: pl.LightningModule) -> Iterator[None]:
        """Record ``module.log`` calls instead of running them (logging a number copies it to the GPU: no capture)."""
        self.calls.clear()
        had_attribute = "log" in module.__dict__
        previous = module.__dict__.get("log")

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            self.calls.append((name, value, args, kwargs))

        # On the instance, so the class's ``log`` is back untouched afterwards.
        module.__dict__["log"] = record
        try:
            yield
        finally:
            if had_attribute:
                module.__dict__["log"] = previous
            else:
                del module.__dict__["log"]

    def reissue(self, module: pl.LightningModule) -> None:
        """Re-issue the recorded calls, attributed to :attr:`hook` so they join the same metrics."""
        if not self.calls:
            return
        trainer = module.trainer
        results = trainer._results
        if results is None:  # no fit loop is running: there is no metric to feed
            return
        if len(self._feeds) != len(self.calls):
            self._feeds = [None] * len(self.calls)
        direct = type(module).log is pl.LightningModule.log and not trainer._logger_connector.should_reset_tensors(
            self.hook
        )
        previous = module._current_fx_name
        module._current_fx_name = self.hook
        try:
            for index, (name, value, args, kwargs) in enumerate(self.calls):
                feed = self._feeds[index]
                metric = results.get(feed.key) if feed is not None else None
                if direct and feed is not None and feed.name == name and metric is not None and metric is feed.metric:
                    batch_size = results._extract_batch_size(metric, feed.batch_size, metric.meta)
                    results.update_metrics(feed.key, value.detach(), batch_size)
                else:
                    module.log(name, value, *args, **kwargs)
                    self._feeds[index] = _feed(module, results, (name, value, args, kwargs), self.hook)
        finally:
            module._current_fx_name = previous
        trainer._logger_connector._current_fx = self.hook

    def clear(self) -> None:
        """Forget the calls and where they landed."""
        self.calls = []
        self._feeds = []


class ManualUpdates:
    """The optimizer steps a manual ``training_step`` took while captured, re-issued to Lightning's loop after replays.

    Under manual optimization, ``optimizer.step()`` tells the loop through the ``LightningOptimizer`` 's
    ``_on_before_step`` and ``_on_after_step`` (the optimizer-step progress, which is ``trainer.global_step``, and
    the profiler). A replay runs no Python, so the capture records which optimizers stepped, in order, instead of
    counting them, and each replay tells the loop the same.

    Example:
        >>> import torch
        >>> from lightning.pytorch.core.optimizer import LightningOptimizer
        >>> optimizer = LightningOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        >>> seen = []
        >>> optimizer._on_before_step = lambda: seen.append("before")
        >>> updates = ManualUpdates()
        >>> with updates.recorded([optimizer]):
        ...     optimizer._on_before_step()
        >>> seen, len(updates.calls)
        ([], 1)
        >>> updates.reissue()
        >>> seen
        ['before']
    """

    def __init__(self) -> None:
        self.calls: list[LightningOptimizer] = []

    @contextlib.contextmanager
    def recorded(self, optimizers: list[LightningOptimizer]) -> Iterator[None]:
        """Record the optimizer steps ``optimizers`` take instead of telling the loop (the capture trains nothing)."""
        self.calls = []
        hooks = [(optimizer, optimizer._on_before_step, optimizer._on_after_step) for optimizer in optimizers]
        for optimizer in optimizers:
            optimizer._on_before_step = functools.partial(self.calls.append, optimizer)
            optimizer._on_after_step = do_nothing_closure
        try:
            yield
        finally:
            for optimizer, before, after in hooks:
                optimizer._on_before_step, optimizer._on_after_step = before, after

    def reissue(self) -> None:
        """Tell the loop about each recorded step, as ``LightningOptimizer.step`` would around it."""
        for optimizer in self.calls:
            optimizer._on_before_step()
            optimizer._on_after_step()

    def clear(self) -> None:
        """Forget the recorded steps."""
        self.calls = []


class GradToggles:
    """Which parameters require gradients, and Lightning's record of a ``toggle_optimizer`` still open.

    A manual ``training_step`` toggles them (``toggle_optimizer``, then ``untoggle_optimizer``); a capture that fails
    between the two would leave the other optimizers' parameters frozen, so it puts them back.

    Example:
        >>> import torch
        >>> import lightning.pytorch as pl
        >>> module = pl.LightningModule()
        >>> module.layer = torch.nn.Linear(2, 2)
        >>> toggles = GradToggles(module)
        >>> _ = module.layer.weight.requires_grad_(False)
        >>> toggles.restore()
        >>> module.layer.weight.requires_grad
        True
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module
        self._flags = [(parameter, parameter.requires_grad) for parameter in module.parameters()]
        self._open = dict(getattr(module, "_param_requires_grad_state", {}))

    def restore(self) -> None:
        """Put every flag and the record back."""
        for parameter, flag in self._flags:
            parameter.requires_grad_(flag)
        self._module._param_requires_grad_state = self._open


def manual_optimizers(trainer: pl.Trainer) -> list[LightningOptimizer]:
    """The ``LightningOptimizer`` s a manual ``training_step`` steps (``self.optimizers()``)."""
    return list(trainer.strategy._lightning_optimizers)


def _feed(module: pl.LightningModule, results: Any, call: LogCall, hook: str) -> _Feed | None:
    """Where ``call`` landed after ``self.log`` ran it, or ``None`` when it must always go through ``self.log``."""
    name, value, args, kwargs = call
    if not isinstance(value, Tensor) or results.dataloader_idx is not None:
        return None
    key = f"{hook}.{name}"
    metric = results.get(key)
    if metric is None or not metric.is_tensor or metric.meta.enable_graph:
        return None
    arguments = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs).arguments
    return _Feed(name, key, metric, arguments.get("batch_size"))


_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer a module is attached to, also while ``Strategy.connect`` runs (before the Trainer says so)."""
    return module._trainer


def single_device_root(strategy: SingleDeviceStrategy) -> torch.device:
    """The device a :class:`SingleDeviceStrategy` was built with."""
    return strategy._root_device


def anomaly_detection_on(trainer: pl.Trainer) -> bool:
    """Whether ``Trainer(detect_anomaly=True)`` was passed."""
    return bool(getattr(trainer, "_detect_anomaly", False))


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's callbacks, a list that may be added to (the callback connector sets it in ``Trainer.__init__``)."""
    return trainer.callbacks  # type: ignore[attr-defined]

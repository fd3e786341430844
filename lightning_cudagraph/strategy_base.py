"""What both strategies of the package share: the graph options and the whole-step override points.

The override points a whole-step graph needs: ``batch_to_device`` (static batch buffers), ``training_step`` (the
captured output; under manual optimization the step captured and replayed), ``optimizer_step`` (capture and replay),
``backward`` (a manual step's losses checked for non-finite values), ``teardown`` and ``on_exception`` (release before
the model leaves the GPU). On connect, the strategy adds :class:`~lightning_cudagraph.CUDAGraphCallback` with its
options when the user did not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_cudagraph._backend.backend_setting import HoldsCaptureBackend
from lightning_cudagraph._lightning import (
    accumulating,
    accumulation_sync_blocked,
    last_ready_batch,
    trainer_callbacks,
    trainer_of,
)
from lightning_cudagraph._options.config import CUDAGraphConfig, config_error
from lightning_cudagraph._options.environment import ensure_graph_safe_allocator
from lightning_cudagraph._options.normalization import plain
from lightning_cudagraph._rollout.rollout import Rollout
from lightning_cudagraph._warnings import warn_user
from lightning_cudagraph.callback import CUDAGraphCallback

__all__ = ["CUDAGraphStrategyBase", "attach_callback"]

# A mixin, not a Strategy subclass at run time: jsonargparse 4.27 (the floor) lists a class once per path to Strategy in
# its subclasses, so a second path makes `--trainer.strategy=CUDAGraphStrategy` ambiguous. Type checkers see Strategy.
if TYPE_CHECKING:
    _Strategy = Strategy
else:
    _Strategy = object


class CUDAGraphStrategyBase(HoldsCaptureBackend, _Strategy):
    """The graph options and the whole-step override points, shared by the single-device and DDP strategies.

    It comes first among the bases of a strategy (``class S(CUDAGraphStrategyBase, SingleDeviceStrategy)``), so
    its hooks run around those of the Lightning strategy that follows it.
    """

    supports_full_iteration = True

    #: Seconds a replayed whole step may run under several ranks before the replay watchdog ends the process
    #: (``None``: 100 eager steps, at least 2 minutes; :mod:`lightning_cudagraph._backend.watchdog`).
    replay_timeout_s: float | None = None

    def _init_graph_options(self, config: CUDAGraphConfig, replay_timeout_s: float | None = None) -> None:
        replay_timeout_s = plain(replay_timeout_s)  # np.float32(600) as 600.0
        seconds = isinstance(replay_timeout_s, (int, float)) and not isinstance(replay_timeout_s, bool)
        if replay_timeout_s is not None and not (seconds and replay_timeout_s > 0):
            raise config_error(
                type(self).__name__,
                "replay_timeout_s",
                replay_timeout_s,
                "a number of seconds above 0, or None",
                "pass e.g. replay_timeout_s=600, or None for the default bound (100 eager steps, at least 2 minutes)",
            )
        self.replay_timeout_s = replay_timeout_s
        self.cudagraph_config = config
        if config.enabled:
            ensure_graph_safe_allocator(type(self).__name__)
        self._callback: CUDAGraphCallback | None = None

    @property
    def rollout(self) -> Rollout | None:
        """The rollout of the callback this strategy drives (``None`` before the Trainer connects)."""
        return self._callback.rollout if self._callback is not None else None

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        trainer = trainer_of(model)
        if trainer is not None:
            self._callback = attach_callback(trainer, self)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        rollout = self.rollout
        if rollout is not None and self.lightning_module is not None:  # whole steps: fixed, or a level of auto
            trainer = self.lightning_module.trainer
            batch = rollout.plan_whole_step(trainer, batch)
            if not trainer.training:  # evaluation steps: their own graphs' static batches
                batch = rollout.plan_evaluation_step(trainer, batch)
        return batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        rollout = self.rollout
        if rollout is None:
            return super().training_step(*args, **kwargs)

        def step() -> Any:
            output = super(CUDAGraphStrategyBase, self).training_step(*rollout.training_step_arguments(args), **kwargs)
            rollout.on_training_step_output(output)
            return output

        module = self.lightning_module
        if module is not None and not module.automatic_optimization:  # it steps the optimizers: the whole step
            return rollout.run_training_step(module.trainer, step)
        return step()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        rollout = self.rollout
        if rollout is not None:
            rollout.on_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(lambda: super(CUDAGraphStrategyBase, self).validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(lambda: super(CUDAGraphStrategyBase, self).test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(lambda: super(CUDAGraphStrategyBase, self).predict_step(*args, **kwargs))

    def _evaluation_step(self, step: Callable[[], Any]) -> Any:
        """An evaluation step, on its forward-only graph where there is one (``_rollout/evaluation.py``)."""
        rollout, module = self.rollout, self.lightning_module
        if rollout is None or module is None:
            return step()
        return rollout.run_evaluation_step(module.trainer, step)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """Whether every micro-batch comes to :meth:`optimizer_step`, so that the whole step can graph it too.

        True while a whole-step level is planned and ``accumulate_grad_batches > 1``. Lightning then calls
        ``optimizer_step`` for the micro-batches that only accumulate as well (it still counts only real optimizer
        steps, and steps the schedulers and loggers as usual); :meth:`optimizer_step` runs their closure as Lightning
        would, under DDP's ``no_sync``. On an epoch's last batch it is False: Lightning steps there, as it always does.
        """
        rollout = self.rollout
        if rollout is None or not rollout.whole_step_accumulation or self.lightning_module is None:
            return False
        trainer = self.lightning_module.trainer
        return trainer.accumulate_grad_batches > 1 and not last_ready_batch(trainer)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        rollout = self.rollout
        module = self.lightning_module
        if module is not None and self.handles_gradient_accumulation and accumulating(module.trainer):
            run_step = lambda: self._accumulate(closure)  # noqa: E731
        else:
            run_step = lambda: super(CUDAGraphStrategyBase, self).optimizer_step(optimizer, closure, model, **kwargs)  # noqa: E731
        if rollout is None or module is None:
            return run_step()
        if not module.automatic_optimization:  # called by training_step, which is the whole step
            return rollout.run_manual_update(module.trainer, closure, optimizer, run_step)
        return rollout.run_whole_step(module.trainer, closure, optimizer, run_step)

    def _accumulate(self, closure: Callable[[], Any]) -> Any:
        """A micro-batch that only accumulates, as Lightning runs it: the closure, without DDP's all-reduce."""
        with accumulation_sync_blocked(self):
            return closure()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._release()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._release()  # before the model moves to the CPU
        super().teardown()

    def _release(self) -> None:
        if self.rollout is not None:
            self.rollout.release()


def attach_callback(trainer: pl.Trainer, strategy: CUDAGraphStrategyBase) -> CUDAGraphCallback:
    """The Trainer's CUDAGraphCallback, added with the strategy's options when the user did not add one."""
    config, backend = strategy.cudagraph_config, strategy.capture_backend
    existing = [cb for cb in trainer_callbacks(trainer) if isinstance(cb, CUDAGraphCallback)]
    if existing:
        if existing[0].config != config and config != CUDAGraphConfig():
            warn_user(
                "CUDAGraphCallback was given both as a callback and through the strategy's options; the callback's"
                " options apply."
            )
        if existing[0].capture_backend is None:
            existing[0].capture_backend = backend
        return existing[0]
    callback = CUDAGraphCallback(**config.options())
    callbacks = trainer_callbacks(trainer)
    callback.capture_backend, callback.config = backend, config  # the same options, named after the strategy
    # Lightning keeps checkpoint callbacks last, so they save every other callback's state of the step.
    first_checkpoint = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), None)
    callbacks.insert(len(callbacks) if first_checkpoint is None else first_checkpoint, callback)
    return callback

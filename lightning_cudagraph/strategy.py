"""Lightning strategies that carry the graph options and the whole-step override points.

Strategies that carry the graph options as Trainer flags (``Trainer(strategy="cudagraph_attn_mlp")``,
``--trainer.strategy=...`` in LightningCLI), add :class:`~lightning_cudagraph.CUDAGraphCallback` when the user did
not, and provide the public override points the whole-step graph needs: ``batch_to_device`` (static batch
buffers), ``training_step`` (the captured output), ``optimizer_step`` (capture and replay), ``teardown`` and
``on_exception`` (release before the model leaves the GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_cudagraph._lightning import single_device_root, trainer_of
from lightning_cudagraph.callback import CUDAGraphCallback, checked_capture_backend
from lightning_cudagraph.config import CUDAGraphConfig, config_error, documents_graph_options, takes_graph_options
from lightning_cudagraph.environment import ensure_graph_safe_allocator
from lightning_cudagraph.graphs.backend import CaptureBackend
from lightning_cudagraph.preflight import DDP_FULL_ITERATION_MIN_WARMUP, ddp_warmup_error
from lightning_cudagraph.rollout import Rollout


class _CUDAGraphStrategyMixin:
    """The graph options and the whole-step override points, shared by the single-device and DDP strategies."""

    supports_full_iteration = True

    def _init_graph_options(self, config: CUDAGraphConfig) -> None:
        self.cudagraph_config = config
        self._capture_backend: CaptureBackend | None = None
        if config.enabled:
            ensure_graph_safe_allocator(type(self).__name__)
        self._callback: CUDAGraphCallback | None = None

    @property
    def capture_backend(self) -> CaptureBackend | None:
        """Handed to the callback this strategy attaches (see :attr:`CUDAGraphCallback.capture_backend`)."""
        return getattr(self, "_capture_backend", None)

    @capture_backend.setter
    def capture_backend(self, backend: CaptureBackend | None) -> None:
        self._capture_backend = checked_capture_backend(type(self).__name__, backend)

    @property
    def rollout(self) -> Rollout | None:
        """The rollout of the callback this strategy drives (``None`` before the Trainer connects)."""
        return self._callback.rollout if self._callback is not None else None

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        trainer = trainer_of(model)
        if trainer is not None:
            self._callback = _attach_callback(trainer, self)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        rollout = self.rollout
        if rollout is not None and self.lightning_module is not None:  # whole steps: fixed, or a level of auto
            batch = rollout.plan_full_step(self.lightning_module.trainer, batch)
        return batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        rollout = self.rollout
        if rollout is not None and rollout.capturing_full_step:
            rollout.on_training_step_output(output)
        return output

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        rollout = self.rollout
        run_step = lambda: super(_CUDAGraphStrategyMixin, self).optimizer_step(optimizer, closure, model, **kwargs)  # noqa: E731
        if rollout is None:
            return run_step()
        return rollout.run_full_step(self.lightning_module.trainer, closure, optimizer, run_step)

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


@documents_graph_options
class CUDAGraphStrategy(_CUDAGraphStrategyMixin, SingleDeviceStrategy):
    """Single-device training with CUDA graphs; takes the options of :class:`~lightning_cudagraph.CUDAGraphCallback`.

    Registered names pick the scope as a Trainer flag: ``cudagraph`` (``scope="auto"``), ``cudagraph_attn``,
    ``cudagraph_mlp``, ``cudagraph_attn_mlp``, ``cudagraph_layer`` and ``cudagraph_full`` (the whole training step).
    LightningCLI reads a registered name as a plain string, so it takes no options there: to change one, give the
    class with its options, e.g. ``--trainer.strategy=CUDAGraphStrategy --trainer.strategy.scope=[layer]
    --trainer.strategy.max_pool_mib=512``.

    Args:
        **options: The options of :class:`~lightning_cudagraph.CUDAGraphCallback`, described once in
            :data:`~lightning_cudagraph.config.OPTION_DOCS` (written here at import).
        device: The device to train on; by default the one the Trainer's ``accelerator``/``devices`` resolve to.
        accelerator: See :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        checkpoint_io: See :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        precision_plugin: See :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    Example::

        >>> import lightning.pytorch as pl
        >>> import lightning_cudagraph
        >>> trainer = pl.Trainer(strategy="cudagraph_attn_mlp", accelerator="cpu", logger=False)
        >>> trainer.strategy.cudagraph_config.scope
        ('attn', 'mlp')
    """

    @takes_graph_options
    def __init__(
        self,
        config: CUDAGraphConfig,
        device: str | torch.device | int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Declared so that Lightning's accelerator connector fills in the device a string strategy resolves to.
        self.parallel_devices: list[torch.device] = [torch.device(device)] if device is not None else []
        self._init_graph_options(config)

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else single_device_root(self)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if len(self.parallel_devices) > 1:  # Lightning would train on the first device alone, silently
            scope = "auto" if self.cudagraph_config.auto_scope else list(self.cudagraph_config.scope)
            raise config_error(
                type(self).__name__,
                "Trainer(devices=...)",
                len(self.parallel_devices),
                "one device (a single-device strategy); DDPCUDAGraphStrategy for several",
                f"pass strategy='ddp_cudagraph' (or DDPCUDAGraphStrategy(scope={scope!r})), or devices=1",
            )
        super().connect(model)


@documents_graph_options
class DDPCUDAGraphStrategy(_CUDAGraphStrategyMixin, DDPStrategy):
    """DDP training with CUDA graphs (one process per GPU); takes the callback's options plus DDP's.

    Scoped graphs keep DDP's gradient all-reduce outside the graphs. With ``scope=["full_iteration"]`` the
    all-reduce is captured inside the step graph: DDP is built on the package's side stream, and at least 11 eager
    warmup steps are required (NCCL's requirement). Registered as ``ddp_cudagraph`` and ``ddp_cudagraph_full``.

    Args:
        **options: The options of :class:`~lightning_cudagraph.CUDAGraphCallback`, described once in
            :data:`~lightning_cudagraph.config.OPTION_DOCS` (written here at import).
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Example::

        >>> from lightning_cudagraph import DDPCUDAGraphStrategy
        >>> DDPCUDAGraphStrategy(scope=["full_iteration"], warmup_steps=11).cudagraph_config.full_iteration
        True
    """

    @takes_graph_options
    def __init__(self, config: CUDAGraphConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_graph_options(config)
        if config.full_iteration and config.warmup_steps < DDP_FULL_ITERATION_MIN_WARMUP:
            raise ddp_warmup_error(type(self).__name__, config.warmup_steps)

    @override
    def teardown(self) -> None:
        super().teardown()
        _warn_on_grad_stream_mismatch(True)  # torch's default (it has no getter to read the previous value)

    @override
    def configure_ddp(self) -> None:
        backend = self.rollout.backend if self.rollout is not None else None
        if self.root_device.type != "cuda" or backend is None or backend.stream is None:
            super().configure_ddp()
            return
        _warn_on_grad_stream_mismatch(False)  # DDP keeps eager steps' autograd nodes alive: expected, not a bug
        # Built on the stream training and capture run on, so DDP's retained autograd nodes never name another one.
        with torch.cuda.stream(backend.stream):
            super().configure_ddp()


def _warn_on_grad_stream_mismatch(enabled: bool) -> None:
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(enabled)


def _attach_callback(trainer: pl.Trainer, strategy: _CUDAGraphStrategyMixin) -> CUDAGraphCallback:
    """The Trainer's CUDAGraphCallback, added with the strategy's options when the user did not add one."""
    config, backend = strategy.cudagraph_config, strategy.capture_backend
    existing = [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)]
    if existing:
        if existing[0].config != config and config != CUDAGraphConfig():
            rank_zero_warn(
                "CUDAGraphCallback was given both as a callback and through the strategy's options; the callback's"
                " options apply."
            )
        if existing[0].capture_backend is None:
            existing[0].capture_backend = backend
        return existing[0]
    callback = CUDAGraphCallback(**config.options())
    callback.capture_backend, callback.component = backend, type(strategy).__name__
    # Lightning keeps checkpoint callbacks last, so they save every other callback's state of the step.
    first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), None)
    trainer.callbacks.insert(len(trainer.callbacks) if first_checkpoint is None else first_checkpoint, callback)
    return callback


_REGISTERED = {
    "cudagraph": (
        CUDAGraphStrategy,
        {},
        "CUDA graphs at the fastest level that works: attn, attn+mlp, layer or the whole step (scope='auto')",
    ),
    "cudagraph_attn": (CUDAGraphStrategy, {"scope": ["attn"]}, "CUDA graphs on attention modules"),
    "cudagraph_mlp": (CUDAGraphStrategy, {"scope": ["mlp"]}, "CUDA graphs on MLP modules"),
    "cudagraph_attn_mlp": (CUDAGraphStrategy, {"scope": ["attn", "mlp"]}, "CUDA graphs on attention and MLPs"),
    "cudagraph_layer": (CUDAGraphStrategy, {"scope": ["layer"]}, "CUDA graphs on whole transformer layers"),
    "cudagraph_full": (CUDAGraphStrategy, {"scope": ["full_iteration"]}, "The whole training step as one CUDA graph"),
    "ddp_cudagraph": (DDPCUDAGraphStrategy, {}, "DDP with scoped CUDA graphs (scope='auto')"),
    "ddp_cudagraph_full": (
        DDPCUDAGraphStrategy,
        {"scope": ["full_iteration"], "warmup_steps": 11},
        "DDP with the whole training step as one CUDA graph",
    ),
}


def register_strategies() -> None:
    """Register the strategy names with Lightning (done on import of the package)."""
    for name, (cls, options, description) in _REGISTERED.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **options)


register_strategies()

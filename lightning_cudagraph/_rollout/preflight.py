"""Preflight: the configuration checked against the Trainer, the model and the optimizers, before any capture.

Each rule raises ``ValueError`` (component, value, allowed values, fix). The Trainer and model rules run in ``setup``;
the optimizer rules in ``on_fit_start``, as Lightning builds the optimizers in ``strategy.setup``.
"""

from __future__ import annotations

import dataclasses
import math

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
)
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_cudagraph._backend.optimizers import unfit_optimizer
from lightning_cudagraph._lightning import anomaly_detection_on
from lightning_cudagraph._options.compile_options import inductor_graphs_in
from lightning_cudagraph._options.config import FULL_ITERATION, CUDAGraphConfig, Verbatim, config_error
from lightning_cudagraph._options.hooks import hooked_modules
from lightning_cudagraph._rollout.sharding import check_sharded, instead_of_the_whole_step, scoped_graphs

__all__ = [
    "DDP_WHOLE_STEP_WARMUP_STEPS",
    "check_ddp_warmup",
    "check_optimizers",
    "check_trainer",
    "check_whole_step_hooks",
    "eager_steps_before_whole_step",
    "whole_step_optimizer_problem",
]

#: Eager DDP steps NCCL needs before its all-reduce can be captured (PyTorch's CUDA-graph notes).
DDP_WHOLE_STEP_WARMUP_STEPS = 11
_SUPPORTED_PRECISION = (MixedPrecision, HalfPrecision, DoublePrecision, TransformerEnginePrecision)


def check_trainer(config: CUDAGraphConfig, trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Strategy, precision and loop settings that graphs cannot work with."""
    _check_strategy(config, trainer)
    _check_precision(config, trainer)
    _check_seal(config, trainer)
    _check_compile(config, trainer, module)
    if anomaly_detection_on(trainer):
        raise config_error(
            config.component,
            "Trainer(detect_anomaly=...)",
            True,
            "detect_anomaly=False while CUDA graphs are on",
            "anomaly mode checks every backward output on the host, which a captured backward cannot do; turn it"
            " off while training with graphs, or pass impl='none' to debug eagerly",
        )
    if not config.full_iteration:
        return
    if trainer.accumulate_grad_batches > 1 and is_overridden("optimizer_step", module):
        raise config_error(
            config.component,
            "LightningModule.optimizer_step",
            Verbatim(f"{type(module).__name__}.optimizer_step (overridden)"),
            "Lightning's own optimizer_step with scope=['full_iteration'] and accumulate_grad_batches > 1",
            "the whole step graphs every micro-batch, so Lightning would call the override for the micro-batches"
            " that only accumulate as well; move its work to a scheduler or on_before_optimizer_step, pass"
            f" accumulate_grad_batches=1 with a larger batch, or {instead_of_the_whole_step(trainer)}",
        )
    if not module.automatic_optimization and not isinstance(trainer.strategy, SingleDeviceStrategy):
        # One device only: under DDP and FSDP2 a manual step's toggles and no_sync windows are not yet shown in graphs.
        keeps = (
            ", which runs training_step's own manual_backward, optimizer and zero_grad calls as written"
            if scoped_graphs(trainer)
            else ""
        )
        raise config_error(
            config.component,
            "automatic_optimization",
            False,
            "manual optimization with scope=['full_iteration'] on one device (a single-device strategy)",
            f"{type(trainer.strategy).__name__} runs several processes, where a manual whole step is not supported"
            " yet; train on one device, use automatic optimization, or"
            f" {instead_of_the_whole_step(trainer, ['attn', 'mlp'])}{keeps}",
        )


def whole_step_optimizer_problem(config: CUDAGraphConfig, trainer: pl.Trainer) -> str | None:
    """Check the optimizers for the whole step once they exist: ``scope="auto"`` gets the reason to skip it by.

    A fixed ``scope=["full_iteration"]`` raises instead. ``None``: no problem, or no whole step planned.
    """
    if config.full_iteration:
        check_optimizers(config, trainer)
    if not config.auto_scope:
        return None
    try:
        check_optimizers(dataclasses.replace(config, scope=(FULL_ITERATION,), component="scope='auto'"), trainer)
    except ValueError as error:
        return str(error)
    return None


def check_whole_step_hooks(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    """Refuse module hooks on the whole step: they would run once, at capture, and be replayed as captured."""
    if not config.full_iteration:
        return
    hooked = hooked_modules(trainer.lightning_module)
    if hooked:
        keeps = ", which keeps hooks on the captured regions firing" if scoped_graphs(trainer) else ""
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "full_iteration on modules without forward or backward hooks",
            f"{', '.join(hooked[:5])} carry hooks, whose Python would run once at capture and never again; remove"
            f" them (hook.remove()) for the fit, or {instead_of_the_whole_step(trainer)}{keeps}",
        )


def check_optimizers(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    """For the whole step: every optimizer can run its step inside a graph (and under a grad scaler if 16-mixed)."""
    if not config.full_iteration:
        return
    scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
    automatic = trainer.lightning_module.automatic_optimization
    for optimizer in trainer.optimizers:
        unfit = unfit_optimizer(optimizer, automatic=automatic, grad_scaler=scaler, whole_step=True)
        if unfit is not None:
            fix = f"{unfit.what}; {unfit.fix}"
            raise config_error(config.component, "optimizer", type(optimizer).__name__, unfit.allowed, fix)


def _check_strategy(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    strategy = trainer.strategy
    sharded = isinstance(strategy, ModelParallelStrategy) and getattr(strategy, "supports_full_iteration", False)
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)) or not (
        sharded or isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
    ):
        offload = getattr(strategy, "cpu_offload", None) or "offload" in str(getattr(strategy, "config", ""))
        why = "CPU offloading moves parameters between host and device" if offload else "parameters move or reshard"
        raise config_error(
            config.component,
            "Trainer(strategy=...)",
            Verbatim(f"{type(strategy).__name__}(...)"),
            "a single-device, DDP or FSDP2 strategy (e.g. 'cudagraph', 'ddp_cudagraph', 'fsdp2_cudagraph_full')",
            f"{why} between steps outside any graph, so a graph would read stale addresses; for sharding, apply"
            " fully_shard in configure_model and pass strategy='fsdp2_cudagraph_full' (FSDP2, whole step), or use"
            " DDP, or turn CUDA graphs off",
        )
    if config.full_iteration and not getattr(strategy, "supports_full_iteration", False):
        raise config_error(
            config.component,
            "Trainer(strategy=...)",
            Verbatim(f"{type(strategy).__name__}(...)"),
            "CUDAGraphStrategy or DDPCUDAGraphStrategy with scope=['full_iteration']",
            "pass Trainer(strategy='cudagraph_full') (or 'ddp_cudagraph_full'): the whole-step graph needs the"
            " strategy's batch and optimizer-step hooks",
        )
    if sharded:
        check_sharded(config, trainer)
    if isinstance(strategy, DDPStrategy):
        check_ddp_warmup(config)


def check_ddp_warmup(config: CUDAGraphConfig) -> None:
    """Under DDP: the whole step runs :data:`DDP_WHOLE_STEP_WARMUP_STEPS` eager steps before its capture."""
    if config.full_iteration and config.warmup_steps < DDP_WHOLE_STEP_WARMUP_STEPS:
        raise config_error(
            config.component,
            "warmup_steps",
            config.warmup_steps,
            f">= {DDP_WHOLE_STEP_WARMUP_STEPS} when full_iteration runs under DDP",
            f"pass warmup_steps={DDP_WHOLE_STEP_WARMUP_STEPS}: NCCL needs that many eager DDP steps before its"
            " all-reduce can be captured",
        )


def eager_steps_before_whole_step(trainer: pl.Trainer) -> int:
    """Eager steps a whole-step level reached later in the fit runs before its capture.

    One (the optimizers' first step in their capturable form), or under DDP as many as NCCL still needs.
    """
    if isinstance(trainer.strategy, DDPStrategy):
        return max(1, DDP_WHOLE_STEP_WARMUP_STEPS - trainer.global_step)
    return 1


def _check_seal(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    max_steps = trainer.max_steps
    if config.seal_after_steps is not None and max_steps is not None and 0 <= max_steps < config.seal_after_steps:
        raise config_error(
            config.component,
            "seal_after_steps",
            config.seal_after_steps,
            f"at most Trainer(max_steps={max_steps}), or None",
            f"the fit ends before step {config.seal_after_steps}, so the set of shapes would never be sealed; pass"
            f" seal_after_steps={max_steps} or less, or None (no seal)",
        )


def check_seal_within_the_fit(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    """Once the data is known (fit start): a seal past the last step of a fit bounded by epochs would never come."""
    if config.seal_after_steps is None or not (trainer.max_steps is None or trainer.max_steps < 0):
        return
    total = trainer.estimated_stepping_batches
    if math.isfinite(total) and config.seal_after_steps > total:
        raise config_error(
            config.component,
            "seal_after_steps",
            config.seal_after_steps,
            f"at most the fit's {int(total)} optimizer steps (max_epochs={trainer.max_epochs}), or None",
            f"the fit ends before step {config.seal_after_steps}, so the set of shapes would never be sealed; pass"
            f" seal_after_steps={int(total)} or less, or None (no seal)",
        )


def _check_precision(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    plugin = trainer.precision_plugin
    if type(plugin) is not Precision and not isinstance(plugin, _SUPPORTED_PRECISION):
        raise config_error(
            config.component,
            "Trainer(precision=...)",
            getattr(plugin, "precision", type(plugin).__name__),
            "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true', 'transformer-engine'",
            "pick one of those precisions",
        )
    if isinstance(plugin, TransformerEnginePrecision) and config.impl != "transformer_engine":
        raise config_error(
            config.component,
            "impl",
            config.impl,
            "'transformer_engine' with TransformerEnginePrecision",
            "pass impl='transformer_engine' so graphs capture FP8 with the Trainer's recipe",
        )
    if config.full_iteration and isinstance(plugin, TransformerEnginePrecision):
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "scoped capture with Transformer Engine",
            "pass scope=['layer']",
        )


def _check_compile(config: CUDAGraphConfig, trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Graphs in graphs (inductor's own CUDA graphs inside a capture), and ``compile=`` under DDP."""
    problem = inductor_graphs_in(module)
    if problem is not None:
        raise config_error(
            config.component,
            "torch.compile(mode='reduce-overhead')",
            problem,
            "compiled modules without inductor's CUDA graphs",
            "inductor's CUDA graphs cannot run inside the package's graphs (graphs in graphs); compile with the default"
            " mode, or let the package compile what it captures: compile=True",
        )
    if config.compile is not None and not isinstance(trainer.strategy, SingleDeviceStrategy):
        raise config_error(
            config.component,
            "compile",
            config.compile.as_option(),
            "compile= on one device",
            "not yet supported across devices: under DDP dynamo's DDPOptimizer splits compiled graphs at"
            " gradient-bucket boundaries, and compiled autograd (DDP, FSDP2) has not been tried inside a captured"
            " step; drop compile=, or compile the model yourself (default mode) and let the package capture it",
        )

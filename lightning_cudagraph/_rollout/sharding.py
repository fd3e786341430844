"""The rules of FSDP2 (:class:`~lightning_cudagraph.ModelParallelCUDAGraphStrategy`): the whole step alone.

Scoped graphs are refused under FSDP2 (:data:`SCOPED_UNDER_FSDP2`), in preflight for a fixed scope and in the
ladder's plan under ``scope="auto"``; a fix elsewhere in preflight that would offer one offers eager training instead.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_cudagraph._options.config import CUDAGraphConfig, config_error

__all__ = ["SCOPED_UNDER_FSDP2", "check_sharded", "instead_of_the_whole_step", "scoped_graphs"]

#: Why scoped levels are refused under FSDP2.
SCOPED_UNDER_FSDP2 = (
    "scoped graphs are refused under FSDP2: each region would hold its own unsharded copy of the parameters it reads,"
    " the memory FSDP2 exists to save"
)


def check_sharded(config: CUDAGraphConfig, trainer: pl.Trainer) -> None:
    """FSDP2: the whole step alone, one optimizer step per batch."""
    if not config.auto_scope and not config.full_iteration:
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "['full_iteration'] or 'auto' under FSDP2",
            f"{SCOPED_UNDER_FSDP2}; pass scope=['full_iteration'] (strategy='fsdp2_cudagraph_full')",
        )
    if trainer.accumulate_grad_batches > 1:
        raise config_error(
            config.component,
            "Trainer(accumulate_grad_batches=...)",
            trainer.accumulate_grad_batches,
            "1 under FSDP2 with CUDA graphs",
            "a micro-batch that only accumulates must skip FSDP2's reduce-scatter (set_requires_gradient_sync), which"
            " a captured step cannot switch; pass accumulate_grad_batches=1 with a larger batch, or train eagerly"
            " (impl='none')",
        )


def scoped_graphs(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's strategy allows scoped graphs (FSDP2 does not: :data:`SCOPED_UNDER_FSDP2`)."""
    return bool(getattr(trainer.strategy, "supports_scoped_graphs", True))


def instead_of_the_whole_step(trainer: pl.Trainer, scope: list[str] | None = None) -> str:
    """What a fix offers in place of the whole step: a scoped capture, or eager training where none is allowed."""
    if scoped_graphs(trainer):
        return f"use a scoped capture (scope={scope or ['layer']!r})"
    return "train eagerly (impl='none'): scoped graphs are refused under FSDP2 too"

"""Shared test helpers: quiet Trainers, a fit that records its losses, callbacks that observe or break training,
and checks of what the package leaves behind (patched forwards, parameters, GPU memory).

The models and data the tests train live in :mod:`tests.models`.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback
from tests.fake_backend import FakeBackend

#: What every test Trainer turns off: no logger, checkpoints, progress bar, summary, sanity check or validation.
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


# =================================================================== Trainers and fits
def trainer(max_steps: int, callbacks: Sequence[pl.Callback] = (), **options: Any) -> pl.Trainer:
    """A quiet Trainer (see :data:`QUIET`); ``options`` override any Trainer argument."""
    return pl.Trainer(**{**QUIET, "max_steps": max_steps, "callbacks": list(callbacks), **options})


def cpu_trainer(root: Path | str, max_steps: int, callbacks: Sequence[pl.Callback] = (), **options: Any) -> pl.Trainer:
    """A quiet Trainer on one CPU device that writes (logs, checkpoints) under ``root``."""
    return trainer(max_steps, callbacks, **{"accelerator": "cpu", "devices": 1, "default_root_dir": root, **options})


class Run(NamedTuple):
    """What :func:`fit` returns: per-step losses, the final parameters (float32 CPU copies), the Trainer, the model."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    trainer: pl.Trainer
    model: pl.LightningModule


def fit(
    model: pl.LightningModule, data: Any, max_steps: int, callbacks: Sequence[pl.Callback] = (), **options: Any
) -> Run:
    """Fit ``model`` on ``data`` (a data module or a train loader) with a quiet Trainer.

    A :class:`LossRecorder` runs ahead of ``callbacks``; ``options`` go to the Trainer.
    """
    losses = LossRecorder()
    run = trainer(max_steps, [losses, *callbacks], **options)
    run.fit(model, data)
    return Run(losses.losses, parameters_of(model), run, model)


def fit_cuda(
    model: pl.LightningModule, data: Any, max_steps: int, callbacks: Sequence[pl.Callback] = (), **options: Any
) -> Run:
    """:func:`fit` on one CUDA device."""
    return fit(model, data, max_steps, callbacks, **{"accelerator": "cuda", "devices": 1, **options})


def graph_callbacks(trainer: pl.Trainer) -> list[CUDAGraphCallback]:
    """The Trainer's CUDAGraphCallbacks (one the user passed, or the one a cudagraph strategy added at fit)."""
    return [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)]


def graph_callback(trainer: pl.Trainer) -> CUDAGraphCallback:
    """The Trainer's one CUDAGraphCallback."""
    callbacks = graph_callbacks(trainer)
    assert len(callbacks) == 1, f"expected one CUDAGraphCallback, found {len(callbacks)}"
    return callbacks[0]


# =================================================================== callbacks
class LossRecorder(pl.Callback):
    """Per-step training losses as Python floats (a host sync per step: fine in a test)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class RaiseAtStep(pl.Callback):
    """Fails the fit at the start of optimizer step ``step`` with ``error`` (a ``RuntimeError`` by default)."""

    def __init__(self, step: int, message: str | None = None, error: type[Exception] = RuntimeError) -> None:
        self.step, self.message, self.error = step, message or f"user error at step {step}", error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise self.error(self.message)


class RebindAt(pl.Callback):
    """At the end of step ``step``, gives a parameter new storage (``p.data = p.data.clone()``: same values)."""

    def __init__(self, step: int, parameter: str) -> None:
        self.step, self.parameter = step, parameter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            weight = pl_module.get_parameter(self.parameter)
            weight.data = weight.data.clone()


class StepHookedAt(pl.Callback):
    """Registers an optimizer step post-hook at the start of step ``step``; ``calls`` counts the steps it ran on."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.optimizers[0].register_step_post_hook(lambda *_: setattr(self, "calls", self.calls + 1))


class StepCounter(pl.Callback):
    """Counts the training batches that started (zero when the fit failed before training)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


def dense_audits(replayed: int, every: int | None) -> int:
    """Audits in the first ``replayed`` replayed steps after a capture, as documented: the first after 2 steps, then
    every interval twice the one before, up to ``every`` (``audit_every_n_steps``)."""
    if not every:
        return 0
    count, interval, at = 0, min(2, every), 0
    while at + interval <= replayed:
        at, count, interval = at + interval, count + 1, min(2 * interval, every)
    return count


# =================================================================== what training leaves behind
def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Float32 CPU copies of the parameters, by name."""
    return {name: p.detach().float().cpu().clone() for name, p in module.named_parameters()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def patched_forwards(module: torch.nn.Module) -> list[str]:
    """Modules that carry an instance attribute ``forward`` (a patched forward left behind)."""
    return [name or "<root>" for name, m in module.named_modules() if "forward" in m.__dict__]


def assert_losses_close(expected: list[float], actual: list[float], tolerance: float) -> None:
    """Per-step losses agree within ``tolerance``; on failure, show both runs step by step."""
    assert len(expected) == len(actual), (len(expected), len(actual))
    worst = max(abs(a - b) for a, b in zip(expected, actual, strict=True))
    rows = "\n".join(
        f"{i:3d} {a:.7f} {b:.7f} {a - b:+.2e}" for i, (a, b) in enumerate(zip(expected, actual, strict=True))
    )
    assert worst < tolerance, (
        f"largest per-step difference {worst:.3g} >= {tolerance:g}\nstep eager graphed diff\n{rows}"
    )


def settled_memory() -> int:
    """``memory_allocated()`` once garbage and library workspaces are cleared."""
    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def graph_pool_bytes() -> int:
    """Bytes still allocated in private (graph) memory pools: zero once every graph is released."""
    return sum(
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )


# =================================================================== scope="auto" on the fake backend
#: Step times (ms) per level that ladder tests give the fake timer: each wider level is faster.
LEVEL_MS = {"eager": 10.0, "attn": 8.0, "attn+mlp": 6.0, "layer": 4.0, "model": 3.0, "full_iteration": 2.0}


def level_of(backend: FakeBackend) -> str:
    """The level of :func:`~tests.models.decoder` the step that just ended ran at, from what was alive then."""
    if not backend.step_replayed:  # graphs alive, but the step ran eagerly (scope="auto"'s eager reference)
        return "eager"
    names = backend.live_region_names
    if not names and any(graph.live for graph in backend.step_graphs):  # a scoped level's optimizer graph has regions
        return "full_iteration"
    if "model" in names:  # the decoder's one submodule
        return "model"
    if any(re.fullmatch(r"model\.blocks\.\d+", name) for name in names):
        return "layer"
    if any(name.endswith((".mlp", ".router")) for name in names):
        return "attn+mlp"
    return "attn" if names else "eager"


def timed_by_level(table: dict[str, float]) -> Callable[[FakeBackend], float]:
    """A fake timer's ``step_ms``: the step time of the level each step ran at."""
    return lambda backend: table[level_of(backend)]


def older_than(package: str, version: str) -> bool:
    """Whether the installed ``package`` is older than ``version`` (CI also runs the suite at the declared floors)."""
    from importlib.metadata import version as installed

    from packaging.version import Version

    return Version(installed(package).split("+")[0]) < Version(version)


#: At the floors (torch 2.6, lightning 2.4) a few behaviours of the libraries themselves differ; their tests say which.
OLD_TORCH = older_than("torch", "2.7")
OLD_LIGHTNING = older_than("lightning", "2.5")
#: FSDP2 (``fully_shard``) runs on a CPU device mesh: torch 2.6 lacks the CPU stream events its collectives record.
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
#: A fit under FSDP2 on a CPU device mesh needs it; refusals before the fit do not.
needs_fsdp2 = pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch cannot run FSDP2 on a CPU device mesh")

"""Where a step's GPU time goes: kernel time per step by class, from a short profiler window inside a fit.

``compile=`` fuses the elementwise, normalization and reduction kernels around the matrix multiplies; it leaves the
GEMMs (cuBLAS), attention (SDPA's flash / cuDNN / memory-efficient kernels) and the fused optimizer as they are. The
time of those three classes is a floor under what compiled kernels can reach on a model: a ratio goal that needs a
step shorter than that floor is out of reach by compiling, whatever the fusion.

Kernels are classed by name (:func:`kernel_class`), which is how the profiler reports them; a kernel of none of the
named classes counts as ``other``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch

#: Kernel classes, in the order a name is tested against them (attention first: its kernels are cutlass ones too).
CLASS_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("multi_tensor_apply", "fusedoptimizer", "adam")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")),
)
#: The classes ``compile=`` leaves as they are: their time is the floor.
FLOOR_CLASSES = ("gemm", "attention", "optimizer")


def kernel_class(name: str) -> str:
    """The class of a kernel by its name: ``optimizer``, ``attention``, ``gemm`` or ``other``.

    Example:
        >>> kernel_class("nvjet_sm90_tst_64x48_64x15_2x4_h_bz_NNT")
        'gemm'
        >>> kernel_class("fmha_cutlassB_f32_aligned_64x64_k64_sm80")
        'attention'
        >>> kernel_class("triton_per_fused_native_layer_norm_backward_0")
        'other'
    """
    lowered = name.lower()
    for kind, markers in CLASS_MARKERS:
        if any(marker in lowered for marker in markers):
            return kind
    return "other"


def kernel_summary(kernels: Iterable[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per step: kernels launched, kernel ms, ms by class, and the floor (ms of :data:`FLOOR_CLASSES`).

    Args:
        kernels: ``(name, microseconds)`` of every kernel the window ran.
        steps: The steps of the window.

    Example:
        >>> summary = kernel_summary([("nvjet_gemm", 300.0), ("triton_poi_fused_add", 100.0)], steps=2)
        >>> summary["kernel_ms"], summary["floor_ms"], summary["kernels"]
        (0.2, 0.15, 1.0)
    """
    if steps < 1:
        raise ValueError(f"kernel_summary: steps must be at least 1 (got {steps})")
    by_class = dict.fromkeys((*FLOOR_CLASSES, "other"), 0.0)
    count, total = 0, 0.0
    for name, microseconds in kernels:
        by_class[kernel_class(name)] += microseconds
        count += 1
        total += microseconds
    per_step_ms = {kind: round(us / steps / 1e3, 4) for kind, us in by_class.items()}
    return {
        "steps": steps,
        "kernels": count / steps,
        "kernel_ms": round(total / steps / 1e3, 4),
        "floor_ms": round(sum(per_step_ms[kind] for kind in FLOOR_CLASSES), 4),
        "by_class_ms": per_step_ms,
    }


class KernelWindow(pl.Callback):
    """Profiles the GPU kernels of ``steps`` training steps from step ``start`` (0-based), then stops the profiler.

    Put the window before the timed steps: the profiler's own work never lands in the timing. ``summary`` is
    :func:`kernel_summary` of the window, or ``None`` when the fit ended before it closed.
    """

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.summary: dict[str, Any] | None = None
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.start:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()
        elif trainer.global_step == self.start + self.steps and self._profiler is not None:
            torch.cuda.synchronize()  # one sync, outside the timed steps: every kernel of the window has run
            self._profiler.__exit__(None, None, None)
            kernels = [(e.name, e.device_time) for e in self._profiler.events() if e.device_type.name == "CUDA"]
            self.summary = kernel_summary(kernels, self.steps)
            self._profiler = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:  # the fit ended inside the window: no summary
            self._profiler.__exit__(None, None, None)
            self._profiler = None

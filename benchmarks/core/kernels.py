"""A kernel profile of a few training steps: kernel ms per step, by class, and the floor ``compile=`` leaves."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

#: Kernel classes, in the order a name is tested (attention first: its kernels are cutlass ones too).
CLASS_MARKERS = (
    ("optimizer", ("multi_tensor_apply", "fusedoptimizer", "adam")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")),
)
#: The classes ``compile=`` leaves as they are: their time is the floor.
FLOOR_CLASSES = ("gemm", "attention", "optimizer")


def kernel_class(name: str) -> str:
    """The class of a kernel by its name: ``optimizer``, ``attention``, ``gemm`` or ``other``.

    Example:
        >>> kernel_class("fmha_cutlassB_f32_aligned_64x64_k64_sm80"), kernel_class("triton_poi_fused_add_0")
        ('attention', 'other')
    """
    lowered = name.lower()
    return next((kind for kind, markers in CLASS_MARKERS if any(m in lowered for m in markers)), "other")


def kernel_summary(kernels: Iterable[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per step: kernels launched, kernel ms, ms by class and the floor, from ``(name, microseconds)`` pairs.

    Example:
        >>> summary = kernel_summary([("nvjet_gemm", 300.0), ("triton_poi_fused_add", 100.0)], steps=2)
        >>> summary["kernel_ms"], summary["floor_ms"], summary["kernels"]
        (0.2, 0.15, 1.0)
    """
    if steps < 1:
        raise ValueError(f"kernel_summary: steps must be at least 1 (got {steps})")
    by_class = dict.fromkeys((*FLOOR_CLASSES, "other"), 0.0)
    count = 0
    for name, microseconds in kernels:
        by_class[kernel_class(name)] += microseconds
        count += 1
    per_step = {kind: round(us / steps / 1e3, 4) for kind, us in by_class.items()}
    return {
        "steps": steps,
        "kernels": count / steps,
        "kernel_ms": round(sum(by_class.values()) / steps / 1e3, 4),
        "floor_ms": round(sum(per_step[kind] for kind in FLOOR_CLASSES), 4),
        "by_class_ms": per_step,
    }


class KernelWindow(pl.Callback):
    """Profiles the kernels of ``steps`` steps from step ``start``: put it before the timed steps."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.summary: dict[str, Any] | None = None
        self._profiler: Any = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.start:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()
        elif trainer.global_step == self.start + self.steps and self._profiler is not None:
            torch.cuda.synchronize()  # one sync, outside the timed steps
            self._profiler.__exit__(None, None, None)
            events = self._profiler.events()
            self.summary = kernel_summary(
                [(e.name, e.device_time) for e in events if e.device_type.name == "CUDA"], self.steps
            )
            self._profiler = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:  # the fit ended inside the window: no summary
            self._profiler.__exit__(None, None, None)
            self._profiler = None

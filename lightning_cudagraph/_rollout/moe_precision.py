"""MoE experts whose grouped GEMMs a graph cannot hold in the Trainer's precision, found before any capture.

transformers' ``grouped_mm`` experts cast their input to the weights' dtype and call ``torch._grouped_mm``. Its
bfloat16 kernel (sm_90, sm_100) stays on the device. Its other dtypes take a path that reads the group offsets on the
host, so a capture fails with ``Cannot copy between CPU and CUDA tensors``. The dtype follows from the precision: the
weights' own dtype under ``32-true`` and the mixed precisions, the converted dtype under ``*-true``, and autocast's
dtype on the package's path (:func:`lightning_cudagraph.experts.use_autocast_experts`).

``scope="auto"`` skips the levels holding such experts with :func:`experts_precision_problem` as the reason. A fixed
whole step is refused by :func:`check_experts_precision`. A fixed scope of regions holding them is warned about by
:func:`warn_experts_precision`, and their capture then fails with the cause and the fix (``capture_hints``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_cudagraph._options.errors import config_error
from lightning_cudagraph._options.experts_layout import (
    AUTOCAST_GROUPED_MM,
    expert_weights,
    experts_implementation,
    experts_modules,
)
from lightning_cudagraph._warnings import warn_user

__all__ = [
    "ExpertsProblem",
    "check_experts_precision",
    "experts_precision_problem",
    "find_experts_problem",
    "warn_experts_precision",
]

#: Precisions whose plugin converts the weights before the fit, and the dtype the weights get.
_CONVERTED = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
#: Precisions that run the step under autocast, and autocast's dtype.
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
#: The one dtype ``torch._grouped_mm`` runs on the device (CUTLASS, sm_90 and sm_100).
_ON_DEVICE = torch.bfloat16
#: The experts implementations that run ``torch._grouped_mm``.
_GROUPED = ("grouped_mm", AUTOCAST_GROUPED_MM)
_PATH = "lightning_cudagraph.experts.use_autocast_experts(model) before the fit"


@dataclass(frozen=True)
class ExpertsProblem:
    """Experts modules whose grouped GEMMs run in a dtype ``torch._grouped_mm`` computes with the host's help.

    Attributes:
        names: The experts modules' qualified names in the LightningModule, in model order.
        implementation: The experts implementation they run (``grouped_mm`` or the package's autocast path).
        dtype: The dtype their grouped GEMMs run in.
        precision: The Trainer's precision.

    Example:
        >>> problem = ExpertsProblem(("model.layers.0.mlp.experts",), "grouped_mm", torch.float32, "bf16-mixed")
        >>> problem.reason.startswith("moe_precision: model.layers.0.mlp.experts runs transformers' grouped_mm")
        True
    """

    names: tuple[str, ...]
    implementation: str
    dtype: torch.dtype
    precision: str

    @property
    def cause(self) -> str:
        """What runs in which dtype, and why a graph cannot hold it."""
        more = f" (and {len(self.names) - 1} more experts modules)" if len(self.names) > 1 else ""
        dtype = _dtype_name(self.dtype)
        if self.implementation == AUTOCAST_GROUPED_MM:
            runs = f"runs the package's autocast experts path in {dtype} under precision={self.precision!r}"
            why = "autocast's dtype" if self.precision in _AUTOCAST else "no autocast: the path is grouped_mm"
        else:
            runs = f"runs transformers' grouped_mm experts in {dtype} under precision={self.precision!r}"
            why = "transformers casts the experts' input to the weights' dtype"
        return (
            f"{self.names[0]}{more} {runs} ({why}), and torch._grouped_mm's {dtype} path reads the group offsets on"
            " the host, which a graph cannot hold"
        )

    @property
    def fix(self) -> str:
        """The precision, or the package's path, under which the grouped GEMMs run in bfloat16."""
        if self.implementation == AUTOCAST_GROUPED_MM:
            return "precision='bf16-mixed' (the path then runs the grouped GEMMs in bfloat16), or precision='bf16-true'"
        if self.precision == "bf16-mixed":
            return (
                f"precision='bf16-true', or {_PATH}, which runs the grouped GEMMs in autocast's bfloat16"
                " (opt-in: eager training with it runs bfloat16 experts, where this run's eager training has float32)"
            )
        return f"precision='bf16-true', or precision='bf16-mixed' with {_PATH} (the grouped GEMMs then run in bfloat16)"

    @property
    def reason(self) -> str:
        """The reason a level holding the experts is skipped: ``moe_precision:``, the cause, the fix."""
        return f"moe_precision: {self.cause}. Fix: {self.fix}"


def find_experts_problem(
    module: torch.nn.Module, precision: str, regions: Sequence[torch.nn.Module] | None = None
) -> ExpertsProblem | None:
    """The experts inside ``regions`` (all of ``module`` when ``None``) a graph cannot hold under ``precision``.

    Only the experts of the first implementation and dtype found are named; ``None`` when there are none.
    """
    inside = None if regions is None else {id(inner) for region in regions for inner in region.modules()}
    found: dict[tuple[str, torch.dtype], list[str]] = {}
    for name, experts in experts_modules(module):
        if inside is not None and id(experts) not in inside:
            continue
        implementation = experts_implementation(experts)
        dtype = _gemm_dtype(experts, implementation, precision)
        if dtype is not None and dtype != _ON_DEVICE:
            found.setdefault((str(implementation), dtype), []).append(name)
    if not found:
        return None
    (implementation, dtype), names = next(iter(found.items()))
    return ExpertsProblem(tuple(names), implementation, dtype, precision)


def experts_precision_problem(
    module: torch.nn.Module, precision: str, regions: Sequence[torch.nn.Module] | None = None
) -> str | None:
    """Why a graph of ``regions`` (the whole step when ``None``) cannot hold the experts inside it, or ``None``.

    Example:
        >>> import torch
        >>> experts_precision_problem(torch.nn.Linear(2, 2), "bf16-mixed") is None
        True
    """
    problem = find_experts_problem(module, precision, regions)
    return None if problem is None else problem.reason


def check_experts_precision(component: str, module: torch.nn.Module, precision: str) -> None:
    """A fixed whole step: refuse the fit when the model holds such experts.

    Raises:
        ValueError: The package's one error format, with the precision, the experts module and the fix.
    """
    problem = find_experts_problem(module, precision)
    if problem is None:
        return
    raise config_error(
        component,
        "Trainer(precision=...)",
        precision,
        "a precision whose MoE experts run their grouped GEMMs in bfloat16 when the scope holds transformers'"
        " grouped_mm experts",
        f"{problem.cause}; pass {problem.fix}, or a scope without the experts",
    )


def warn_experts_precision(
    component: str, module: torch.nn.Module, precision: str, regions: Sequence[torch.nn.Module]
) -> None:
    """A fixed scope of regions: warn at setup when some hold such experts, whose capture will then fail.

    The regions are not refused: a region a capture cannot hold is left out as it fails, with the cause and the fix.
    """
    problem = find_experts_problem(module, precision, regions)
    if problem is not None:
        warn_user(f"{component}: the scope's regions hold MoE experts a graph cannot hold: {problem.reason}")


def _gemm_dtype(experts: torch.nn.Module, implementation: str | None, precision: str) -> torch.dtype | None:
    """The dtype an experts module's grouped GEMMs run in under ``precision``; ``None`` if it runs no grouped GEMM."""
    weights = expert_weights(experts)
    if implementation not in _GROUPED or weights is None or not weights.is_floating_point():
        return None
    if implementation == AUTOCAST_GROUPED_MM and precision in _AUTOCAST:
        return _AUTOCAST[precision]
    return _CONVERTED.get(precision, weights.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` as ``float32``."""
    return str(dtype).removeprefix("torch.")

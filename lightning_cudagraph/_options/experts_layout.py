"""Hugging Face MoE experts modules as a layout: where they are, which implementation they run, their weights.

transformers 5.x marks its experts modules with ``@use_experts_implementation``; the model's config names the
implementation they run (``grouped_mm``, ``batched_mm``, ``eager``, or a registered one such as the package's
:data:`AUTOCAST_GROUPED_MM`). The package reads this to say, before a capture, which precision a graph can hold them in.
"""

from __future__ import annotations

import torch

__all__ = ["AUTOCAST_GROUPED_MM", "EXPERT_WEIGHTS", "expert_weights", "experts_implementation", "experts_modules"]

#: The name of the package's experts path in transformers' experts registry (``config._experts_implementation``).
AUTOCAST_GROUPED_MM = "autocast_grouped_mm"
#: The expert tensors transformers' ``grouped_mm`` reads.
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The Hugging Face experts modules in ``model`` (``@use_experts_implementation``), with their qualified names."""
    return [(name, module) for name, module in model.named_modules() if _is_experts(module)]


def experts_implementation(experts: torch.nn.Module) -> str | None:
    """The implementation a Hugging Face experts module runs (``config._experts_implementation``)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)


def expert_weights(experts: torch.nn.Module) -> torch.Tensor | None:
    """The first expert weight of an experts module (its dtype is the dtype ``grouped_mm`` runs in), or ``None``."""
    return next((w for name in EXPERT_WEIGHTS if isinstance(w := getattr(experts, name, None), torch.Tensor)), None)


def _is_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module: ``@use_experts_implementation`` gives it ``has_gate`` and its model's config."""
    return hasattr(module, "has_gate") and hasattr(getattr(module, "config", None), "_experts_implementation")

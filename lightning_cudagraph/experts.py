"""An experts path for Hugging Face MoE models that runs the grouped GEMMs in the autocast dtype.

transformers' ``grouped_mm`` experts cast their input to the weights' dtype. Under ``precision='bf16-mixed'`` the
weights stay in float32, so the experts' grouped GEMMs run in float32 while autocast runs every other GEMM in bfloat16.
``torch._grouped_mm`` has a bfloat16 kernel on sm_90 and sm_100 that stays on the device. Its other paths read the group
offsets on the host, which a CUDA graph cannot hold. :func:`use_autocast_experts` switches the experts to a path that
casts the weights to autocast's dtype first, so the whole step can be captured under ``bf16-mixed``.

The path changes the experts' arithmetic against transformers' default: bfloat16 GEMMs where ``grouped_mm`` ran them
in float32. It is opt-in. Compare a graphed run with eager training that uses the path too.

transformers is imported when the path is used, never when this module is imported.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lightning_cudagraph._options.experts_layout import AUTOCAST_GROUPED_MM, EXPERT_WEIGHTS, experts_modules

__all__ = ["AUTOCAST_GROUPED_MM", "use_autocast_experts"]


def use_autocast_experts(model: torch.nn.Module) -> list[str]:
    """Run every Hugging Face experts module in ``model`` on the autocast path, and return their qualified names.

    Under autocast the path casts the expert weights to autocast's dtype and runs transformers' ``grouped_mm`` experts
    on the copies: the grouped GEMMs run in bfloat16 under ``precision='bf16-mixed'``. Gradients flow back through the
    casts to the float32 weights, as for any GEMM under autocast. Without autocast the path is transformers'
    ``grouped_mm`` unchanged.

    Call it before the fit, on the LightningModule or the transformers model. It replaces the experts implementation
    the model had (``grouped_mm`` by default). Eager training with the path is the reference a graphed run matches.

    Args:
        model: A module holding transformers experts modules (``@use_experts_implementation``).

    Returns:
        The qualified names of the experts modules switched, in model order.

    Raises:
        ValueError: ``model`` holds no transformers experts module.

    Example:
        >>> import transformers
        >>> from lightning_cudagraph.experts import AUTOCAST_GROUPED_MM, use_autocast_experts
        >>> config = transformers.Qwen3MoeConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        ...     num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        >>> model = transformers.Qwen3MoeForCausalLM(config)
        >>> use_autocast_experts(model)
        ['model.layers.0.mlp.experts']
        >>> model.config._experts_implementation == AUTOCAST_GROUPED_MM
        True
    """
    found = experts_modules(model)
    if not found:
        raise ValueError(
            f"lightning_cudagraph.experts.use_autocast_experts: {type(model).__name__} holds no Hugging Face experts"
            " module (a class decorated with transformers' @use_experts_implementation); nothing to switch"
        )
    _register()
    for _, experts in found:
        cast(Any, experts).config._experts_implementation = AUTOCAST_GROUPED_MM
    return [name for name, _ in found]


def autocast_grouped_mm_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``grouped_mm`` experts of transformers, on copies of the weights in autocast's dtype while autocast is on."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    device = hidden_states.device.type
    if not torch.is_autocast_enabled(device):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    view = _InDtype(self, torch.get_autocast_dtype(device))
    return grouped_mm_experts_forward(view, hidden_states, top_k_index, top_k_weights)  # type: ignore[arg-type]


class _InDtype:
    """An experts module seen with its floating expert tensors cast to ``dtype``; every other attribute is its own."""

    def __init__(self, experts: torch.nn.Module, dtype: torch.dtype) -> None:
        copies = {}
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name, None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                copies[name] = weight.to(dtype)
        self.__dict__["_experts"] = experts
        self.__dict__["_copies"] = copies

    def __getattr__(self, name: str) -> Any:
        copies = self.__dict__["_copies"]
        return copies[name] if name in copies else getattr(self.__dict__["_experts"], name)


def _register() -> None:
    """Add the path to transformers' experts registry (idempotent), so its configs and checks accept the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(AUTOCAST_GROUPED_MM, autocast_grouped_mm_experts_forward)

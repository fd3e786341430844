"""The strategy names the package registers with Lightning: ``Trainer(strategy="cudagraph_full")``.

Importing the package registers them. Each name is a strategy class with options, as Lightning's own names are.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_cudagraph.model_parallel import ModelParallelCUDAGraphStrategy
from lightning_cudagraph.strategy import CUDAGraphStrategy, DDPCUDAGraphStrategy

__all__ = ["register_strategies"]

#: Registered name: (class, options, description).
_REGISTERED: dict[str, tuple[type[Strategy], dict[str, Any], str]] = {
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
    "fsdp2_cudagraph": (
        ModelParallelCUDAGraphStrategy,
        {"tensor_parallel_size": 1},
        "FSDP2 (fully_shard in configure_model) with the whole step as one CUDA graph where it is faster",
    ),
    "fsdp2_cudagraph_full": (
        ModelParallelCUDAGraphStrategy,
        {"scope": ["full_iteration"], "tensor_parallel_size": 1},
        "FSDP2 (fully_shard in configure_model) with the whole training step as one CUDA graph",
    ),
}


def register_strategies() -> None:
    """Register the strategy names with Lightning (done on import of the package)."""
    for name, (cls, options, description) in _REGISTERED.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **options)


register_strategies()

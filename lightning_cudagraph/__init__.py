"""CUDA graphs for PyTorch Lightning training, rolled out in safe stages.

Importing the package registers the strategy names ``cudagraph``, ``cudagraph_attn``, ``cudagraph_mlp``,
``cudagraph_attn_mlp``, ``cudagraph_layer``, ``cudagraph_full``, ``ddp_cudagraph``, ``ddp_cudagraph_full``,
``fsdp2_cudagraph`` and ``fsdp2_cudagraph_full``.
"""

from importlib.metadata import PackageNotFoundError, version

from lightning_cudagraph._trust.failure import GraphFailure
from lightning_cudagraph._warnings import CUDAGraphWarning
from lightning_cudagraph.bucketing import PadToBucket
from lightning_cudagraph.callback import CUDAGraphCallback
from lightning_cudagraph.health import CUDAGraphReport, Stage
from lightning_cudagraph.model_parallel import ModelParallelCUDAGraphStrategy
from lightning_cudagraph.strategy import CUDAGraphStrategy, DDPCUDAGraphStrategy
from lightning_cudagraph.strategy_names import register_strategies

register_strategies()  # idempotent: the module registered them on import already

try:
    __version__ = version("lightning-cudagraph")
except PackageNotFoundError:  # running from a checkout without installing
    __version__ = "0.1.0"

__all__ = [
    "CUDAGraphCallback",
    "CUDAGraphReport",
    "CUDAGraphStrategy",
    "CUDAGraphWarning",
    "DDPCUDAGraphStrategy",
    "GraphFailure",
    "ModelParallelCUDAGraphStrategy",
    "PadToBucket",
    "Stage",
    "__version__",
]

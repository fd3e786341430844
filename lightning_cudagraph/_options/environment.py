"""The process environment graphs need: the allocator and NCCL settings that must agree before NCCL starts.

The callback and the strategies apply it when they are built, before Lightning starts a process group.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._options.config import config_error


def ensure_graph_safe_allocator(component: str) -> None:
    """Set ``NCCL_GRAPH_REGISTER=0`` where expandable segments need it, or refuse a setting that conflicts.

    Expandable segments with NCCL buffer registration in graphs cause illegal memory accesses.
    """
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if "expandable_segments:true" not in alloc_conf:
        return
    register = os.environ.get("NCCL_GRAPH_REGISTER")
    if register is None:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"
        rank_zero_info(
            f"{component}: set NCCL_GRAPH_REGISTER=0 because PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True"
            " (NCCL's graph buffer registration faults on expandable segments)."
        )
    elif register != "0":
        raise config_error(
            component,
            "NCCL_GRAPH_REGISTER",
            register,
            "'0' while PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True",
            "export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF",
        )

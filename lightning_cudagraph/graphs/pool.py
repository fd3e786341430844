"""How much device memory a graph memory pool holds."""

from __future__ import annotations

from typing import Any

import torch

from lightning_cudagraph.graphs import device_index


def pool_memory_mib(pool: Any, device: torch.device) -> float:
    """MiB of device memory in the allocator segments that belong to ``pool`` (one allocator snapshot).

    ``pool`` is the handle from ``torch.cuda.graph_pool_handle()`` that every graph was captured into.
    """
    index = device_index(device)
    total = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") == index and tuple(segment.get("segment_pool_id", ())) == tuple(pool):
            total += segment["total_size"]
    return total / 2**20

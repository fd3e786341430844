"""Graph mechanics: scoped regions (``local``), whole steps (``full``), Transformer Engine (``te``), their owner."""

import torch


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()

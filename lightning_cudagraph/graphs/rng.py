"""Random-number and buffer state around a capture.

Warmup iterations before a scoped capture run the modules for real: they draw from the CUDA generator (dropout)
and update buffers (BatchNorm statistics). Both are put back so that capture leaves no trace on training. A
capture that fails midway leaves the generator in capture mode (its next eager draw raises "Offset increment
outside graph capture encountered unexpectedly"); the generator then gets back the state it had before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from lightning_cudagraph.graphs import device_index


@contextlib.contextmanager
def generator_guard(device: torch.device) -> Iterator[None]:
    """On an exception, give the device's default CUDA generator back its pre-capture state, then re-raise."""
    generator = torch.cuda.default_generators[device_index(device)]
    snapshot = generator.clone_state() if hasattr(generator, "clone_state") else None
    try:
        yield
    except BaseException:
        if snapshot is not None:
            generator.graphsafe_set_state(snapshot)
        raise


@contextlib.contextmanager
def training_state_preserved(device: torch.device, modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Restore CUDA and CPU RNG states and the modules' buffers on exit, whether the body succeeded or not."""
    index = device_index(device)
    cuda_state, cpu_state = torch.cuda.get_rng_state(index), torch.get_rng_state()
    with torch.no_grad():
        buffers = [(buffer, buffer.clone()) for module in modules for buffer in module.buffers()]
    try:
        yield
    finally:
        torch.cuda.set_rng_state(cuda_state, index)
        torch.set_rng_state(cpu_state)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)

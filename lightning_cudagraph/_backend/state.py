"""Random-number and buffer state around a capture.

Warmups draw from the generators (dropout) and update buffers (BatchNorm); both are put back. A CUDA capture that fails
midway leaves the CUDA generator in capture mode (its next eager draw raises "Offset increment outside graph capture
encountered unexpectedly").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def module_state_preserved(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Restore the CPU generator and the modules' buffers on exit, whether the body succeeded or not."""
    cpu_state = torch.get_rng_state()
    with torch.no_grad():
        buffers = [(buffer, buffer.clone()) for module in modules for buffer in module.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


@contextlib.contextmanager
def cuda_rng_preserved(device: torch.device) -> Iterator[None]:
    """Restore the device's CUDA generator state on exit."""
    index = device_index(device)
    state = torch.cuda.get_rng_state(index)
    try:
        yield
    finally:
        torch.cuda.set_rng_state(state, index)


class GeneratorGuard:
    """What :func:`cuda_generator_guard` yields: a capture that failed without raising marks it here."""

    def __init__(self) -> None:
        self.failed = False

    def mark_failed(self) -> None:
        """A capture in the guarded block failed and reported it (a region capture pass does not raise)."""
        self.failed = True


@contextlib.contextmanager
def cuda_generator_guard(device: torch.device) -> Iterator[GeneratorGuard]:
    """After a failed capture, give the device's default CUDA generator back its pre-capture state.

    A failure is an exception out of the block (re-raised) or one marked on the yielded guard. A capture that worked
    keeps the generator as it is: its graph advances it on replay.
    """
    generator = torch.cuda.default_generators[device_index(device)]
    snapshot = generator.clone_state() if hasattr(generator, "clone_state") else None
    guard = GeneratorGuard()
    try:
        yield guard
    except BaseException:
        if snapshot is not None:
            generator.graphsafe_set_state(snapshot)
        raise
    if guard.failed and snapshot is not None:
        generator.graphsafe_set_state(snapshot)

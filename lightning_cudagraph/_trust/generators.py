"""Random generators a user keeps on a module: found, fingerprinted, and their states saved and put back.

Besides the global generators, a step may draw from a private one held as a module attribute (``self.rng =
random.Random(0)``, a NumPy ``RandomState`` or ``Generator``, a CPU ``torch.Generator``). A replay draws nothing from
it, and every extra run of the step's Python (a capture, a shadow step) advances it: both must be seen and undone.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["HeldGenerator", "held_generators", "is_generator"]


class HeldGenerator:
    """A random generator held on a module, and how to read and set its state.

    Args:
        name: Where it is held: ``self.rng`` on the root module, ``net.0.rng`` on a submodule.
        generator: The generator (see :func:`is_generator` for the kinds).

    Example:
        >>> import random
        >>> held = HeldGenerator("self.rng", random.Random(0))
        >>> saved, first = held.state(), held.generator.random()
        >>> held.restore(saved)
        >>> held.generator.random() == first
        True
    """

    def __init__(self, name: str, generator: Any) -> None:
        self.name, self.generator = name, generator

    def state(self) -> Any:
        """The generator's whole state (a copy), for :meth:`restore`."""
        generator = self.generator
        if isinstance(generator, random.Random):
            return generator.getstate()
        if isinstance(generator, torch.Generator):
            return generator.get_state()  # a new tensor each call
        if hasattr(generator, "bit_generator"):  # numpy.random.Generator
            return generator.bit_generator.state  # a new dict each call
        return generator.get_state()  # numpy.random.RandomState

    def restore(self, state: Any) -> None:
        """Put the generator back to ``state`` (from :meth:`state`)."""
        generator = self.generator
        if isinstance(generator, random.Random):
            generator.setstate(state)
        elif isinstance(generator, torch.Generator):
            generator.set_state(state)
        elif hasattr(generator, "bit_generator"):
            generator.bit_generator.state = state
        else:
            generator.set_state(state)

    def fingerprint(self, state: Any = None) -> Any:
        """A hashable summary of ``state`` (from :meth:`state`; ``None``: the state now), which every draw changes."""
        return _frozen(self.state() if state is None else state)


def is_generator(value: Any) -> bool:
    """Whether ``value`` is a private generator this module handles (NumPy's only once NumPy is imported).

    Example:
        >>> import random, torch
        >>> is_generator(random.Random(0)), is_generator(torch.Generator()), is_generator(3)
        (True, True, False)
    """
    if isinstance(value, random.Random):
        return True
    if isinstance(value, torch.Generator):
        return value.device.type == "cpu"  # a CUDA generator's draws are a graph's kernels
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.random.RandomState, numpy.random.Generator))


def held_generators(modules: Sequence[torch.nn.Module], deep: bool = True) -> list[HeldGenerator]:
    """The generators held as attributes of ``modules`` (``deep``: and of their submodules), each once.

    An attribute that is a list, tuple or dict is looked into one level (``self.rngs[0]``).

    Example:
        >>> import random, torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> net.rng, net[0].rng = random.Random(0), random.Random(1)
        >>> [held.name for held in held_generators([net])]
        ['self.rng', '0.rng']
    """
    found: dict[int, HeldGenerator] = {}
    for root in modules:
        for prefix, module in root.named_modules() if deep else [("", root)]:
            for key, value in vars(module).items():
                for name, generator in _inside(f"{prefix or 'self'}.{key}", value):
                    found.setdefault(id(generator), HeldGenerator(name, generator))
    return list(found.values())


def _inside(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    if is_generator(value):
        yield name, value
    elif isinstance(value, (list, tuple)):
        yield from ((f"{name}[{i}]", item) for i, item in enumerate(value) if is_generator(item))
    elif isinstance(value, dict):
        yield from ((f"{name}[{key!r}]", item) for key, item in value.items() if is_generator(item))


def _frozen(state: Any) -> Any:
    """A hashable copy of a generator state (arrays and tensors by a hash of their bytes)."""
    if isinstance(state, dict):
        return tuple((key, _frozen(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_frozen(value) for value in state)
    if isinstance(state, torch.Tensor):
        return hash(state.numpy().tobytes())
    tobytes = getattr(state, "tobytes", None)
    if callable(tobytes) and not isinstance(state, (int, float)):
        return hash(tobytes())
    return state

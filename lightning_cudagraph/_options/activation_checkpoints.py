"""Activation checkpointing inside a region a capture would hold: found, and refused before any capture.

A checkpointed region recomputes its forward during backward; inside a graph that recompute would be replayed as
captured, so such a region is refused (a fixed scope) or its level skipped (``scope="auto"``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint

from lightning_cudagraph._options.config import config_error
from lightning_cudagraph._options.scopes import Target

__all__ = ["check_targets", "forward_calls_checkpoint"]


def check_targets(targets: Sequence[Target], component: str) -> None:
    """Refuse activation checkpointing inside a captured region (its recompute would replay into the graph).

    Found as a checkpoint wrapper module, a ``gradient_checkpointing`` flag (Hugging Face), or a ``forward`` (the
    class's or the instance's) whose code object refers to ``torch.utils.checkpoint``; a forward set on the instance
    is followed through ``functools.partial`` (``partial(checkpoint, module.forward)``), each layer of
    ``functools.wraps`` wrappers, bound methods and callable objects.
    """
    for target in targets:
        for name, module in target.module.named_modules():
            wrapped = type(module).__name__ == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module")
            own = vars(module).get("forward")
            on_instance = own is not None and _calls_checkpoint(own)
            functional = forward_calls_checkpoint(type(module)) or on_instance
            if wrapped or functional or getattr(module, "gradient_checkpointing", False) is True:
                where = f"{target.name}.{name}" if name else target.name
                owner = "the forward set on the instance" if on_instance else f"{type(module).__name__}.forward"
                how = f" ({owner} calls torch.utils.checkpoint)" if functional else ""
                raise config_error(
                    component,
                    "scope",
                    target.scope,
                    "regions without activation checkpointing",
                    f"{where} uses activation checkpointing{how}; turn it off for captured modules, or pick a scope"
                    " that does not contain it",
                )


_CHECKPOINT_FUNCTIONS = (torch.utils.checkpoint.checkpoint, torch.utils.checkpoint.checkpoint_sequential)


#: What :func:`forward_calls_checkpoint` found, by class (a class's code does not change during a fit).
_FOUND: dict[type, bool] = {}


def forward_calls_checkpoint(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` (or a function nested in it) refers to ``torch.utils.checkpoint``'s functions."""
    found = _FOUND.get(cls)
    if found is None:
        found = _FOUND[cls] = _calls_checkpoint(getattr(cls, "forward", None))
    return found


def _calls_checkpoint(forward: object) -> bool:
    """Whether a forward (a method, a lambda, a function, a partial, a wrapper) is or calls checkpoint's functions."""
    return any(_code_calls_checkpoint(function) for function in _layers(forward))


def _layers(forward: object) -> list[object]:
    """``forward`` and every callable it stands for.

    A bound method's function, a partial's function, what ``functools.wraps`` wrapped (each layer: a wrapper's own
    code may be the one that checkpoints), and a callable object's ``__call__``.
    """
    layers: list[object] = []
    pending = [forward]
    while pending and len(layers) < 32:  # a bound: wrappers may refer to each other
        current = pending.pop()
        if current is None or any(current is seen for seen in layers):
            continue
        layers.append(current)
        if isinstance(current, functools.partial):
            pending.append(current.func)
            continue
        pending.extend(getattr(current, attribute, None) for attribute in ("__func__", "__wrapped__"))
        if not inspect.isroutine(current) and callable(current):
            pending.append(type(current).__call__)
    return layers


def _code_calls_checkpoint(forward: object) -> bool:
    """Whether one function is checkpoint itself, or its code (or a function nested in it) refers to it."""
    if any(forward is fn for fn in _CHECKPOINT_FUNCTIONS):
        return True
    if inspect.ismethod(forward):  # its __func__ is a layer of its own
        return False
    code, namespace = getattr(forward, "__code__", None), dict(getattr(forward, "__globals__", {}))
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(forward, "__closure__", None) or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            namespace[name] = cell.cell_contents
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        stack.extend(const for const in code.co_consts if inspect.iscode(const))
        names = set(code.co_names)
        for name in names:
            value = namespace.get(name)
            if any(value is fn for fn in _CHECKPOINT_FUNCTIONS):
                return True
            if value is torch.utils.checkpoint and names & {"checkpoint", "checkpoint_sequential"}:
                return True
            if value is torch and {"utils", "checkpoint"} <= names:
                return True
    return False

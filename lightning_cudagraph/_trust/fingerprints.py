"""Python state as fingerprints that two observed steps are compared by: random generators, module attributes."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_cudagraph._trust.generators import held_generators

__all__ = ["describe_changes", "framework_keys", "object_state", "python_state", "random_states"]


def random_states(modules: Sequence[torch.nn.Module] = ()) -> dict[str, Any]:
    """The random generators' states by name: the global ones (NumPy's only once imported), and those ``modules`` hold.

    A generator held on a module (or a submodule) is named by where it is held (``self.rng``, ``net.0.rng``).

    Example:
        >>> import random, torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.rng = random.Random(0)
        >>> before = random_states([layer])
        >>> _ = layer.rng.random()
        >>> [name for name, state in random_states([layer]).items() if before[name] != state]
        ['self.rng']
    """
    states: dict[str, Any] = {"Python's random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, position, *_ = numpy.random.get_state()
        states["numpy.random"] = (kind, hash(keys.tobytes()), position)
    for held in held_generators(modules):
        states.setdefault(held.name, held.fingerprint())
    return states


# ---------------------------------------------------------------------------------------------- module attributes
def python_state(modules: Sequence[torch.nn.Module], deep: bool = True) -> dict[str, Any]:
    """A fingerprint of the plain Python attributes of ``modules`` (``deep``: and everything inside), by qualified name.

    Tensors, submodules, hooks and the framework's own bookkeeping are left out; torchmetrics metrics are watched by
    their update counts elsewhere.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.calls = 3
        >>> python_state([layer])
        {'in_features': 2, 'out_features': 2, 'calls': 3}
    """
    from torchmetrics import Metric

    state: dict[str, Any] = {}
    for root in modules:
        for prefix, module in root.named_modules(remove_duplicate=False) if deep else [("", root)]:
            if isinstance(module, Metric):
                continue
            for key, value in vars(module).items():
                if key in framework_keys() or "hook" in key or isinstance(value, (torch.Tensor, torch.nn.Module)):
                    continue
                state[f"{prefix}.{key}" if prefix else key] = _fingerprint(value, top=True)
    return state


def object_state(objects: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A fingerprint of the plain Python attributes of named objects that are not modules (a user's callbacks).

    Example:
        >>> class Counter:
        ...     calls = 0
        >>> counter = Counter()
        >>> counter.calls = 2
        >>> object_state([("Counter", counter)])
        {'Counter.calls': 2}
    """
    return {
        f"{name}.{key}": _fingerprint(value, top=True)
        for name, owner in objects
        for key, value in vars(owner).items()
        if not isinstance(value, (torch.Tensor, torch.nn.Module))
    }


def _fingerprint(value: Any, top: bool = False) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor",)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        items = list(value.values() if isinstance(value, dict) else value)
        inner = tuple(_fingerprint(item) for item in items[:8]) if top else ()
        return (type(value).__name__, id(value), len(items), inner)
    return (type(value).__name__, id(value))


def describe_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed between two :func:`python_state` fingerprints, one line per attribute.

    Example:
        >>> describe_changes({"calls": 2, "seen": ("list", 1, 3, ())}, {"calls": 3, "seen": ("list", 1, 4, ())})
        ['calls: 2 -> 3', 'seen: list of 3 -> 4 items']
    """
    changes = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name, _MISSING), after.get(name, _MISSING)
        if old == new:
            continue
        if old is _MISSING:
            changes.append(f"{name}: set by the step")
        elif new is _MISSING:
            changes.append(f"{name}: deleted by the step")
        elif isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 4 and old[:2] == new[:2]:
            changes.append(f"{name}: {old[0]} of {old[2]} -> {new[2]} items" if old[2] != new[2] else f"{name}: items")
        elif isinstance(old, tuple) or isinstance(new, tuple):
            changes.append(f"{name}: rebound")
        else:
            changes.append(f"{name}: {old!r} -> {new!r}")
    return changes


_MISSING = object()
_KEYS: set[str] = set()


def framework_keys() -> set[str]:
    """Attribute names ``nn.Module`` and ``LightningModule`` set themselves (their own bookkeeping)."""
    if not _KEYS:
        _KEYS.update(vars(torch.nn.Module()), vars(pl.LightningModule()), ("forward", "_compiled_call_impl"))
    return _KEYS

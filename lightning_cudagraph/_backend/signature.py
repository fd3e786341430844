"""Input signatures: what a graph was captured for, and a readable account of what changed.

A graph replays the exact kernels it recorded, so it is only valid for calls that match its :class:`CallSignature`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype, device and ``requires_grad`` of one tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        """The spec of ``tensor``."""
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)

    def __str__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{grad}"


@dataclass(frozen=True)
class CallSignature:
    """Everything a captured call depends on besides tensor values.

    ``leaves`` holds a :class:`TensorSpec` per tensor argument and the value of any other, in pytree order of
    ``(args, kwargs)``; ``aliases`` maps each leaf to the first leaf holding the same tensor (``attn(x, x, x)``).
    """

    #: Compared, not hashed: torch 2.6's TreeSpec holds a list and cannot be hashed (the leaves are hashed).
    spec: pytree.TreeSpec = field(hash=False)
    leaves: tuple[Any, ...]
    aliases: tuple[int, ...]
    training: bool
    grad_enabled: bool
    autocast: tuple[bool, torch.dtype | None]
    #: The call's :func:`call_key` (``None`` when its arguments are not plain containers of tensors and constants).
    key: tuple[Any, ...] | None = None

    @property
    def tensor_positions(self) -> tuple[int, ...]:
        """Leaf positions that hold distinct tensors (the graph's inputs), in order."""
        return tuple(i for i, leaf in enumerate(self.leaves) if isinstance(leaf, TensorSpec) and self.aliases[i] == i)

    @functools.cached_property
    def positional_key(self) -> tuple[tuple[torch.Size, torch.dtype, bool], ...] | None:
        """For the common call ``module(t0, t1, ...)`` with distinct tensors and no keywords: a cheap key."""
        if self.spec != _positional_spec(len(self.leaves)) or self.aliases != tuple(range(len(self.leaves))):
            return None
        if not all(isinstance(leaf, TensorSpec) for leaf in self.leaves):
            return None
        return tuple((torch.Size(leaf.shape), leaf.dtype, leaf.requires_grad) for leaf in self.leaves)


def call_signature(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallSignature:
    """The signature of ``module(*args, **kwargs)`` in the current grad and autocast state."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first_index: dict[int, int] = {}
    described, aliases = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            aliases.append(first_index.setdefault(id(leaf), i))
            described.append(TensorSpec.of(leaf))
        else:
            aliases.append(i)
            described.append(leaf)
    grad, autocast = grad_and_autocast_state()
    fast = call_key(args, kwargs)
    key = None if fast is None else fast[0]
    return CallSignature(spec, tuple(described), tuple(aliases), module.training, grad, autocast, key)


#: Markers in a :func:`call_key`: unique objects, equal to no argument.
_TENSOR, _TUPLE, _LIST, _DICT = object(), object(), object(), object()
#: Constants a call key holds by type and value (other objects send the call down the slow path).
_CONSTANTS = frozenset({type(None), bool, int, float, str})


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[Tensor]] | None:
    """A cheap, comparable key of a call, and its distinct tensors in pytree order; ``None`` for other calls.

    Only for plain tuples, lists and dicts of tensors, ``None``, booleans, numbers and strings. Equal keys mean equal
    signatures in the same grad, autocast and training state (devices aside: a replay copies inputs from any
    device). A Hugging Face layer's call costs a few microseconds instead of a pytree flatten.
    """
    key: list[Any] = []
    tensors: list[Tensor] = []
    seen: dict[int, int] = {}
    if not _walk(args, key, tensors, seen):
        return None
    if kwargs and not _walk(kwargs, key, tensors, seen):
        return None
    return tuple(key), tensors


def _walk(value: Any, key: list[Any], tensors: list[Tensor], seen: dict[int, int]) -> bool:
    """Append ``value`` 's part of a call key (see :func:`call_key`); ``False`` where a value is not supported."""
    kind = type(value)
    if kind is tuple or kind is list:
        key.append(_TUPLE if kind is tuple else _LIST)
        key.append(len(value))
        for item in value:  # noqa: SIM110 (a loop: all() of a generator costs more per call on this hot path)
            if not _walk(item, key, tensors, seen):
                return False
        return True
    if kind is dict:
        key.append(_DICT)
        key.append(tuple(value))
        for item in value.values():  # noqa: SIM110 (as above)
            if not _walk(item, key, tensors, seen):
                return False
        return True
    if isinstance(value, Tensor):
        first = seen.setdefault(id(value), len(tensors))
        if first == len(tensors):
            tensors.append(value)
        key.extend((_TENSOR, value.shape, value.dtype, value.requires_grad, first))
        return True
    if kind in _CONSTANTS:
        key.extend((kind, value))
        return True
    return False


def positional_key(args: tuple[Any, ...]) -> tuple[tuple[torch.Size, torch.dtype, bool], ...] | None:
    """The cheap key of a positional, tensor-only call (``None`` when the call is not of that form)."""
    key = []
    for arg in args:
        if not isinstance(arg, Tensor):
            return None
        key.append((arg.shape, arg.dtype, arg.requires_grad))
    if len(args) > 1 and len({id(a) for a in args}) != len(args):
        return None
    return tuple(key)


def grad_and_autocast_state() -> tuple[bool, tuple[bool, torch.dtype | None]]:
    """Grad mode, and whether CUDA autocast is on and with which dtype."""
    enabled = torch.is_autocast_enabled("cuda")
    return torch.is_grad_enabled(), (enabled, torch.get_autocast_dtype("cuda") if enabled else None)


def rebuild_call(signature: CallSignature, tensors: Sequence[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild ``(args, kwargs)`` from the distinct tensors of a call and the constants of its signature."""
    leaves: list[Any] = list(signature.leaves)
    for position, tensor in zip(signature.tensor_positions, tensors, strict=True):
        leaves[position] = tensor
    for i, first in enumerate(signature.aliases):
        if first != i:
            leaves[i] = leaves[first]
    args, kwargs = pytree.tree_unflatten(leaves, signature.spec)
    return args, kwargs


def distinct_tensors(signature: CallSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The distinct tensor arguments of a call, in the order :func:`rebuild_call` takes them."""
    if signature.key is not None:
        fast = call_key(args, kwargs)
        if fast is not None:
            return fast[1]
    leaves = pytree.tree_leaves((args, kwargs))
    return [leaves[i] for i in signature.tensor_positions]


def describe_change(old: CallSignature, new: CallSignature) -> str:
    """Say what differs between two signatures, e.g. ``input 0: float32[8, 128] -> float32[5, 128]``."""
    changes = []
    if old.training != new.training:
        changes.append(f"training mode {old.training} -> {new.training}")
    if old.grad_enabled != new.grad_enabled:
        changes.append(f"grad mode {old.grad_enabled} -> {new.grad_enabled}")
    if old.autocast != new.autocast:
        changes.append(f"autocast {_autocast_str(old.autocast)} -> {_autocast_str(new.autocast)}")
    if old.spec != new.spec:
        changes.append("the arguments' structure (positional/keyword layout) changed")
    else:
        for i, (a, b) in enumerate(zip(old.leaves, new.leaves, strict=True)):
            if not _same_leaf(a, b):
                changes.append(f"input {i}: {a} -> {b}")
        if old.aliases != new.aliases:
            changes.append("which arguments are the same tensor changed")
    return "; ".join(changes) if changes else "no change"


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, TensorSpec) or isinstance(b, TensorSpec):
        return a == b
    try:
        return bool(a == b) and type(a) is type(b)
    except (RuntimeError, TypeError, ValueError):
        return a is b


def _autocast_str(state: tuple[bool, torch.dtype | None]) -> str:
    return f"on ({str(state[1]).removeprefix('torch.')})" if state[0] else "off"


def _positional_spec(n: int) -> pytree.TreeSpec:
    return pytree.tree_flatten((tuple(range(n)), {}))[1]


_STATE = operator.attrgetter("spec", "aliases", "training", "grad_enabled", "autocast")


def signatures_equal(a: CallSignature, b: CallSignature) -> bool:
    """Whether two calls can share a graph (constants compared by value)."""
    return _STATE(a) == _STATE(b) and all(_same_leaf(x, y) for x, y in zip(a.leaves, b.leaves, strict=True))

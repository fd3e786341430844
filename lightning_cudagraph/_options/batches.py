"""Seeing into training batches: their tensors, a key of their shapes, and copies the package owns.

PyTorch's pytree treats a ``UserDict`` (Hugging Face's ``BatchEncoding``) or an object with ``.to()``
(torch_geometric's ``Data``) as one leaf, hiding its tensors; this module walks those too. A batch it cannot see
into gets no key (``None``), and the drivers refuse to graph it instead of replaying stale buffers.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

#: A batch key: the batch's structure (container types and keys) and, per tensor, its shape and dtype.
BatchKey = tuple[Any, ...]

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class OpaqueBatch(Exception):
    """The batch holds something the package cannot see into (its tensors could not be found or rebuilt)."""


def batch_key(batch: Any, values: bool = False) -> BatchKey | None:
    """A hashable key of a batch's structure, tensor shapes and dtypes; ``None`` when the batch is opaque.

    ``values`` includes the values of non-tensor leaves (a whole-step graph bakes them in).
    """
    try:
        return tuple(_walk(batch, "", values))
    except OpaqueBatch:
        return None


def opaque_reason(batch: Any) -> str:
    """Why :func:`batch_key` found ``batch`` opaque, and the fix."""
    try:
        _walk(batch, "", values=True)
    except OpaqueBatch as error:
        return (
            f"the training batch holds {error}, which the package cannot see into, so a graph could not be told"
            " which tensors to read. Fix: return tensors in dicts, lists, tuples, namedtuples or dataclasses from"
            " the collate function, or register the type with torch.utils._pytree.register_pytree_node"
        )
    return "no reason: the batch is not opaque"


def describe_batch_key(key: BatchKey | None) -> str:
    """A readable form of :func:`batch_key`, e.g. ``input_ids: int64[8, 128], labels: int64[8, 128]``."""
    if key is None:
        return "<opaque batch>"
    parts = []
    for path, spec in key:
        if spec[0] == "tensor":
            text = f"{str(spec[2]).removeprefix('torch.')}{list(spec[1])}"
        elif spec[0] == "value":
            text = repr(spec[1])
        else:
            continue
        named = any(not part.isdigit() for part in path.split(".")) if path else False
        parts.append(f"{path}: {text}" if named else text)  # positions in a tuple need no names
    return ", ".join(parts)


def batch_tensors(batch: Any) -> list[Tensor]:
    """The batch's tensors, in the order :func:`batch_key` lists them."""
    tensors: list[Tensor] = []
    _collect(batch, tensors)
    return tensors


def own_copy(batch: Any) -> Any:
    """The batch rebuilt around clones of its tensors: static buffers that the user's data never aliases."""
    return _rebuild(batch, lambda t: t.detach().clone())


def copy_into(static: Any, batch: Any) -> None:
    """Copy ``batch`` 's tensors into ``static`` 's (same key), without a host sync."""
    for buffer, value in zip(batch_tensors(static), batch_tensors(batch), strict=True):
        buffer.copy_(value, non_blocking=True)


def _walk(node: Any, path: str, values: bool) -> list[tuple[str, tuple[Any, ...]]]:
    """``(path, spec)`` per leaf; container types and keys are part of each path."""
    if isinstance(node, Tensor):
        return [(path, ("tensor", tuple(node.shape), node.dtype, node.device.type, node.requires_grad))]
    if isinstance(node, _SCALARS):
        return [(path, ("value", node) if values else ("leaf",))]
    children = _children(node)
    if children is None:
        raise OpaqueBatch(f"a {type(node).__qualname__} at {path or 'the top'}")
    rows: list[tuple[str, tuple[Any, ...]]] = [(path, ("node", type(node).__qualname__, len(children)))]
    for name, child in children:
        rows.extend(_walk(child, f"{path}.{name}" if path else str(name), values))
    return rows


def _collect(node: Any, tensors: list[Tensor]) -> None:
    if isinstance(node, Tensor):
        tensors.append(node)
    elif not isinstance(node, _SCALARS):
        for _, child in _children(node) or ():
            _collect(child, tensors)


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The named children of a container the package knows, or ``None``."""
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    if type(node) in pytree.SUPPORTED_NODES:
        children, _ = pytree.SUPPORTED_NODES[type(node)].flatten_fn(node)
        return list(enumerate(children))
    to_dict = getattr(node, "to_dict", None)  # torch_geometric's Data and Batch
    if callable(to_dict) and callable(getattr(node, "to", None)):
        items = to_dict()
        if isinstance(items, Mapping):
            return list(items.items())
    return None


def _rebuild(node: Any, leaf: Callable[[Tensor], Tensor]) -> Any:
    """``node`` with every tensor replaced by ``leaf(tensor)``; containers are new objects, the input is untouched."""
    if isinstance(node, Tensor):
        return leaf(node)
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, Mapping):
        items = {key: _rebuild(value, leaf) for key, value in node.items()}
        if type(node) is dict:
            return items
        mapping: Any = copy.copy(node)  # keeps the type (UserDict, BatchEncoding, OrderedDict) and its attributes
        for key, value in items.items():
            mapping[key] = value
        return mapping
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_rebuild(value, leaf) for value in node))
    if isinstance(node, (list, tuple)):
        return type(node)(_rebuild(value, leaf) for value in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        instance: Any = copy.copy(node)
        for f in dataclasses.fields(node):
            object.__setattr__(instance, f.name, _rebuild(getattr(node, f.name), leaf))
        return instance
    if type(node) in pytree.SUPPORTED_NODES:
        entry = pytree.SUPPORTED_NODES[type(node)]
        children, context = entry.flatten_fn(node)
        return entry.unflatten_fn([_rebuild(child, leaf) for child in children], context)
    attributes = _children(node)
    if attributes is None:
        raise OpaqueBatch(f"a {type(node).__qualname__}")
    new = copy.copy(node)
    for key, value in attributes:
        setattr(new, key, _rebuild(value, leaf))
    return new

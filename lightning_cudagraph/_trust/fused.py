"""Fused copies and differences over many tensors: a handful of kernels for a whole model, and no host sync.

A shadow step copies every parameter, gradient, buffer and optimizer state, puts them back, and weighs the graph's
update against eager's. Done tensor by tensor that is a few kernels per parameter; here each is one fused
(``torch._foreach_*``) operation per device and dtype, or per chunk of a comparison.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Parameter

__all__ = ["CHUNK", "Differences", "copies", "copy_each", "off_by_each", "shard"]

#: Elements of one fused pass of a comparison (1 MiB in float32): its temporaries stay this size, and in cache, unless
#: one tensor is larger (that tensor is then a pass of its own).
CHUNK = 1 << 18


@dataclass(frozen=True)
class Differences:
    """Differences from eager, one per parameter (or gradient), in a device vector that no host reads until needed.

    Args:
        values: The differences (``None``: nothing was weighed).
        order: Each entry's place among the parameters (the order of :attr:`TrainingState.names`).
        what: Each entry's name, for a message.
    """

    values: Tensor | None
    order: list[int]
    what: list[str]

    def largest(self) -> Tensor:
        """The largest difference, on the device (no host sync); a NaN anywhere is NaN."""
        return self.values.max() if self.values is not None else torch.zeros(())

    def first_over(self, tolerance: float) -> tuple[int, str, float] | None:
        """The first entry in the parameters' order over ``tolerance`` (or NaN): place, name, value (one host sync)."""
        if self.values is None:
            return None
        found = zip(self.order, self.what, self.values.tolist(), strict=True)
        over = [(i, what, value) for i, what, value in found if not value <= tolerance]
        return min(over, key=lambda entry: entry[0]) if over else None


def off_by_each(now: Sequence[Tensor], before: Sequence[Tensor] | None, other: Sequence[Tensor]) -> Tensor | None:
    """How far each of ``other`` is from ``now``, relative to the step from ``before`` to ``now`` (no host sync).

    The step's own size is the scale, so a frozen hyperparameter or a wrong batch cannot hide behind the size of the
    weights (``before=None``: the step started from zero). A sharded tensor (FSDP2's DTensor) is weighed on this
    rank's shard; the ranks agree on the verdict. The norms are fused over a chunk of tensors at a time, so the
    temporaries stay one chunk large. ``None`` when there is nothing to weigh.
    """
    if not now:
        return None
    steps: list[Tensor] = []
    bases: list[Tensor] = []
    offs: list[Tensor] = []
    now = [shard(t) for t in now]
    for chunk in chunks(now):
        ours = [now[i].float() for i in chunk]  # in float32 as a whole, chunk by chunk
        theirs = [shard(other[i]).float() for i in chunk]
        if before is None:
            steps += torch._foreach_norm(ours)
        else:
            start = [shard(before[i]).float() for i in chunk]
            bases += torch._foreach_norm(start)
            steps += torch._foreach_norm(torch._foreach_sub(ours, start))
        offs += torch._foreach_norm(torch._foreach_sub(theirs, ours))
    floor = 1e-7 * torch.stack(bases) + 1e-12 if bases else 1e-12
    return torch.stack(offs) / torch.stack(steps).clamp_min(floor)


def chunks(tensors: Sequence[Tensor]) -> Iterator[range]:
    """Consecutive runs of ``tensors`` of at most :data:`CHUNK` elements each (a larger tensor runs alone)."""
    start, size = 0, 0
    for i, tensor in enumerate(tensors):
        if size and size + tensor.numel() > CHUNK:
            yield range(start, i)
            start, size = i, 0
        size += tensor.numel()
    if start < len(tensors):
        yield range(start, len(tensors))


def fusable(tensor: Tensor) -> bool:
    """Whether fused copies take ``tensor``: a plain dense one (a DTensor or a sparse tensor is copied alone)."""
    return type(tensor) in (Tensor, Parameter) and tensor.layout == torch.strided


def copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Detached copies of ``tensors``: each allocated alone, all filled by one fused copy per device and dtype."""
    copies = []
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for tensor in tensors:
        if fusable(tensor):
            copy = torch.empty_like(tensor)
            into, of = groups.setdefault((tensor.device, tensor.dtype), ([], []))
            into.append(copy)
            of.append(tensor)
        else:
            copy = tensor.clone()
        copies.append(copy)
    for into, of in groups.values():
        torch._foreach_copy_(into, of)
    return copies


def copy_each(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``target.copy_(source)`` for each pair: one fused copy per device and dtypes, a DTensor or sparse one alone.

    The fused copy copies a pair its fast path cannot take (other shapes or strides) alone, as ``copy_`` does.
    """
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        if fusable(target) and fusable(source):
            into, of = groups.setdefault((target.device, target.dtype, source.dtype), ([], []))
            into.append(target)
            of.append(source)
        else:
            target.copy_(source)
    for into, of in groups.values():
        torch._foreach_copy_(into, of)


def shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded tensor (FSDP2's DTensor), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

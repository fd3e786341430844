"""What confirmation and the steady state check: parity, parameter identity, trainability, metric updates.

Each check reads host-side facts (data pointers, ``requires_grad`` flags, update counters) or builds a device
scalar; none synchronizes with the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric


def relative_error(reference: Sequence[Tensor], other: Sequence[Tensor]) -> Tensor:
    """Largest ``max|a - b| / max|a|`` over paired tensors, as a device scalar (no host sync).

    Example:
        >>> import torch
        >>> float(relative_error([torch.tensor([2.0, 4.0])], [torch.tensor([2.0, 5.0])]))
        0.25
    """
    if len(reference) != len(other):
        return torch.tensor(float("inf"))
    errors = []
    for a, b in zip(reference, other, strict=True):
        if a.shape != b.shape:
            return torch.tensor(float("inf"), device=a.device)
        if a.numel() and a.is_floating_point():
            a32, b32 = a.float(), b.float()
            errors.append((a32 - b32).abs().max() / a32.abs().max().clamp_min(1e-6))
    return torch.stack(errors).max() if errors else torch.zeros(())


class StateWatch:
    """What the graphs were captured with: which parameters trained, and where every parameter and buffer lives.

    Checked before each step that replays (host-side flags and data pointers, no device sync): a parameter whose
    ``requires_grad`` changed would get no gradient from the graphs, and a parameter or buffer rebound to new
    storage (``p.data = ...``, a ``.to()``, a weight swap) would leave the graphs reading the old one.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> watch = StateWatch()
        >>> watch.watch(layer.named_parameters())
        >>> layer.weight.data = layer.weight.data.clone()
        >>> watch.problem().split(":")[0]
        'address_changed'
    """

    def __init__(self) -> None:
        self._watched: list[tuple[str, Tensor, bool, int]] = []
        self._tensors: list[Tensor] = []
        self._flags: list[bool] = []
        self._addresses: list[int] = []

    def watch(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Remember ``requires_grad`` and the storage of these tensors now."""
        self._watched = [(name, t, t.requires_grad, t.data_ptr()) for name, t in named_tensors]
        self._tensors = [t for _, t, _, _ in self._watched]
        self._flags = [trainable for _, _, trainable, _ in self._watched]
        self._addresses = [address for _, _, _, address in self._watched]

    def problem(self) -> str | None:
        """A rollback reason if a tensor's trainability or storage changed since :meth:`watch`, else ``None``."""
        # Checked before every replayed step: two list comparisons, and the named search only when one differs.
        tensors = self._tensors
        if [t.requires_grad for t in tensors] == self._flags and [t.data_ptr() for t in tensors] == self._addresses:
            return None
        for name, tensor, trainable, address in self._watched:
            if tensor.requires_grad is not trainable:
                return (
                    f"trainable_changed: {name}.requires_grad {trainable} -> {tensor.requires_grad}; the graphs"
                    " compute gradients for the parameters that were trainable at capture"
                )
            if tensor.data_ptr() != address:
                return f"address_changed: {name} is not the tensor the graphs were captured with (it was rebound)"
        return None


class MetricUpdates:
    """Update counts of the torchmetrics ``Metric`` s inside some modules, to find one updated inside a capture.

    A metric's ``update`` runs Python (counters, list states, new state tensors) that a graph does not replay, so a
    metric updated inside a captured region or step would silently stop counting.
    """

    def __init__(self, named_modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
        self._metrics = {
            ".".join(part for part in (prefix, name) if part): metric
            for prefix, root in named_modules
            for name, metric in root.named_modules()
            if isinstance(metric, Metric)
        }
        self._counts = self._read()

    def changed(self) -> list[str]:
        """Names of the metrics updated since this object was made."""
        now = self._read()
        return [name for name, count in now.items() if count != self._counts[name]]

    def _read(self) -> dict[str, int]:
        return {name: metric.update_count for name, metric in self._metrics.items()}

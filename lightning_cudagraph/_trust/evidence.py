"""What confirmation and the steady state check: parity, parameter identity, trainability, metric updates.

Each check reads host-side facts or builds a device scalar; none synchronizes with the device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_cudagraph._backend.local import moved_since
from lightning_cudagraph._trust.guards import GuardSet


def largest_so_far(previous: float, *errors: float) -> float:
    """The largest difference from eager seen so far: ``previous`` (NaN before any check) and ``errors``.

    Example:
        >>> largest_so_far(float("nan"), 0.5), largest_so_far(0.5, 0.25), largest_so_far(0.5, 0.25, 0.75)
        (0.5, 0.5, 0.75)
    """
    return max(errors) if math.isnan(previous) else max(previous, *errors)


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
    """What the graphs were captured with: the parameters, buffers and modules they hold, as they were then.

    Checked before each replayed step: a parameter whose ``requires_grad`` changed would get no gradient from the
    graphs, a tensor rebound to new storage (``p.data = ...``, a ``.to()``) would leave them reading the old one, a
    module switched to eval mode, given a hook or a forward of its own would be replayed as captured, and a Python
    value the graphs' code read (their :class:`~lightning_cudagraph._trust.guards.GuardSet`) would stay as captured.

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
        self._modules: list[tuple[str, torch.nn.Module, torch.nn.Module | None]] = []
        self._inside: list[torch.nn.Module] = []
        self._modes: list[bool] = []
        self._region_modes: list[bool | None] = []
        self._dicts: list[dict[Any, Any]] = []
        self._lengths: list[int] = []
        self._sizes = 0
        self.guards: GuardSet | None = None

    def watch_module(self, module: torch.nn.Module, guards: GuardSet | None = None) -> None:
        """:meth:`watch` every parameter and buffer of ``module``, and its submodules (torchmetrics metrics aside)."""
        inside = [(name, sub, None) for name, sub in module.named_modules() if name and not isinstance(sub, Metric)]
        self.watch((*module.named_parameters(), *module.named_buffers()), inside, guards)

    def watch(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        modules: Iterable[tuple[str, torch.nn.Module, torch.nn.Module | None]] = (),
        guards: GuardSet | None = None,
    ) -> None:
        """Remember ``requires_grad`` and the storage of these tensors now, and the modes and hooks of ``modules``.

        ``modules`` are ``(name, module, region)``: a module inside a region is watched against the region's mode (a
        region switched as a whole is another call signature, which falls back by itself). ``guards``: the Python
        values the graphs read, held from now on (a previous set is released).
        """
        self.release()
        self.guards = guards
        self._watched = [(name, t, t.requires_grad, t.data_ptr()) for name, t in named_tensors]
        self._tensors = [t for _, t, _, _ in self._watched]
        self._flags = [trainable for _, _, trainable, _ in self._watched]
        self._addresses = [address for _, _, _, address in self._watched]
        self._modules = list(modules)
        self._inside = [module for _, module, _ in self._modules]
        self._modes = list(map(_TRAINING, self._inside))
        self._region_modes = [region.training if region is not None else None for _, _, region in self._modules]
        self._dicts = [d for module in self._inside for d in _hook_dicts(module)]
        self._lengths = [len(d) for d in self._dicts]
        self._sizes = sum(self._lengths)

    def problem(self) -> str | None:
        """A rollback reason if a tensor's trainability or storage changed since :meth:`watch`, else ``None``."""
        # Checked before every replayed step: two list comparisons, and the named search only when one differs.
        tensors = self._tensors
        if [t.requires_grad for t in tensors] == self._flags and [t.data_ptr() for t in tensors] == self._addresses:
            return self._module_problem() or (self.guards.problem() if self.guards is not None else None)
        for name, tensor, trainable, _ in self._watched:
            if tensor.requires_grad is not trainable:
                return (
                    f"trainable_changed: {name}.requires_grad {trainable} -> {tensor.requires_grad}; the graphs"
                    " compute gradients for the parameters that were trainable at capture"
                )
        then = {name: address for name, _, _, address in self._watched}
        moved = moved_since(then, {name: tensor.data_ptr() for name, tensor, _, _ in self._watched})
        if moved:
            return f"address_changed: {moved[0]} is not the tensor the graphs were captured with (it was rebound)"
        return None

    def release(self) -> None:
        """Stop holding the guards (idempotent): the graphs they served are gone."""
        guards, self.guards = self.guards, None
        if guards is not None:
            guards.release()

    def _module_problem(self) -> str | None:
        """A rollback reason if a watched module changed mode, or got hooks, attributes or a forward of its own."""
        # Checked before every replayed step: two passes in C over the modules, the named search only on a change.
        if list(map(_TRAINING, self._inside)) == self._modes and sum(map(len, self._dicts)) == self._sizes:
            return None
        for (name, module, region), then, region_then in zip(
            self._modules, self._modes, self._region_modes, strict=True
        ):
            moved = (
                module.training != then
                if region is None
                else (module.training == region.training) != (then == region_then)
            )
            if moved:
                mode = "train" if module.training else "eval"
                return (
                    f"module_changed: {name} went to {mode} mode since capture; the graphs replay the mode they were"
                    " captured in (dropout, batch norm). Fix: set modes before the fit or in the warmup steps"
                )
        lengths = iter(self._lengths)
        for name, module, _ in self._modules:
            if [len(d) for d in _hook_dicts(module)] != [next(lengths) for _ in range(_HOOK_DICTS)]:
                return (
                    f"module_changed: {name} got a hook, an attribute or a forward of its own since capture; a graph"
                    " runs no hook and no new forward. Fix: add hooks and forwards before the fit"
                )
        return None


_HOOK_DICTS = 5
_TRAINING = operator.attrgetter("training")


def _hook_dicts(module: torch.nn.Module) -> list[dict[Any, Any]]:
    """The dictionaries a mid-fit hook or forward on ``module`` lands in (a new key changes one's size)."""
    return [
        vars(module),
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    ]


class MetricUpdates:
    """Update counts of the torchmetrics ``Metric`` s inside some modules, to find one updated inside a capture.

    A graph does not replay ``update``'s Python, so a metric updated inside a capture would silently stop counting.
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

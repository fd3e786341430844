"""A copy of what one training step can change in user state, to put back after a capture or a shadow step.

A dropped whole-step capture has still run ``training_step`` 's Python: a torchmetrics ``update`` bumped its counters
and may have rebound its states to tensors in the graph's pool, a counter moved, the CPU generator drew. A shadow step
changes the parameters and the optimizer too, and a generator the step draws from (the global ones, and those kept on
the module or a submodule) has drawn once more. Putting it all back makes the step run exactly once.

Copies, restores and the comparison of a shadow step run as fused operations (:mod:`lightning_cudagraph._trust.fused`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_cudagraph._trust.fused import Differences, copies, copy_each, off_by_each
from lightning_cudagraph._trust.generators import HeldGenerator, held_generators

_SCALARS = (bool, int, float, str, type(None))
#: Python-side bookkeeping of a torchmetrics ``Metric`` besides its registered states.
_METRIC_FIELDS = ("_update_count", "_computed", "_forward_cache")


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


@dataclass
class TrainingState:
    """User state one training step can change, copied; :meth:`restore` puts it back.

    Example:
        >>> import torch
        >>> model = torch.nn.BatchNorm1d(2)
        >>> model.counter = 1
        >>> state = TrainingState.take(model)
        >>> _ = model(torch.randn(4, 2)); model.counter += 1
        >>> state.restore()
        >>> model.counter, model.running_mean.tolist()
        (1, [0.0, 0.0])
    """

    metrics: list[tuple[Metric, dict[str, Any]]] = field(default_factory=list)
    attributes: list[tuple[torch.nn.Module, dict[str, Any]]] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, Tensor, Tensor]] = field(default_factory=list)
    #: Each parameter, a copy of it, its gradient tensor and a copy of the gradient (accumulation adds to it).
    weights: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]] = field(default_factory=list)
    #: Each parameter's name in the module, in the order of ``weights`` (a failed check names what disagreed).
    names: list[str] = field(default_factory=list)
    optimizer_state: list[tuple[dict[str, Any], str, Any, Any]] = field(default_factory=list)
    tensors: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    generators: tuple[Any, ...] = ()
    #: The generators held on the module or its submodules, each with its state.
    held: list[tuple[HeldGenerator, Any]] = field(default_factory=list)
    cuda: tuple[int, Tensor] | None = None

    @classmethod
    def take(
        cls,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer] | None = None,
        device: torch.device | None = None,
        extra: list[Tensor] | tuple[Tensor, ...] = (),
    ) -> TrainingState:
        """Copy the module's metrics, plain attributes, buffers and the random generators (those it holds included).

        Args:
            module: The LightningModule (every submodule is included).
            optimizers: Also copy the parameters, their gradients and these optimizers' state (a shadow step).
            device: Also copy this CUDA device's generator.
            extra: Other tensors to put back in place (a grad scaler's scale).
        """
        state = cls(generators=(torch.get_rng_state(), random.getstate(), _numpy_state()))
        state.held = [(held, held.state()) for held in held_generators([module])]
        with torch.no_grad():
            state.tensors = list(zip(extra, copies(extra), strict=True))
            buffers: list[tuple[torch.nn.Module, str, Tensor]] = []
            for sub in module.modules():
                if isinstance(sub, Metric):
                    saved = {name: _clone(getattr(sub, name)) for name in sub._defaults}
                    saved.update({name: _clone(getattr(sub, name, None)) for name in _METRIC_FIELDS})
                    state.metrics.append((sub, saved))
                plain = {k: v for k, v in vars(sub).items() if isinstance(v, _SCALARS)}
                state.attributes.append((sub, plain))
                buffers += [(sub, name, buffer) for name, buffer in sub._buffers.items() if buffer is not None]
            buffer_copies = copies([buffer for *_, buffer in buffers])
            state.buffers = [(*held, copy) for held, copy in zip(buffers, buffer_copies, strict=True)]
            if optimizers is not None:
                state._take_weights(module, optimizers)
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            state.cuda = (index, torch.cuda.get_rng_state(index))
        return state

    def _take_weights(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        named = list(module.named_parameters())  # what ``parameters()`` yields, in its order, with the names
        self.names = [name for name, _ in named]
        params = [p for _, p in named]
        grads = [p.grad for p in params]
        saved = copies([p.detach() for p in params])
        grad_copies = iter(copies([g.detach() for g in grads if g is not None]))
        self.weights = [
            (p, w, g, None if g is None else next(grad_copies)) for p, w, g in zip(params, saved, grads, strict=True)
        ]
        held: list[tuple[dict[str, Any], str, Any]] = []
        for optimizer in optimizers:
            held += [(entry, key, value) for entry in optimizer.state.values() for key, value in entry.items()]
            for group in optimizer.param_groups:
                held += [(group, key, value) for key, value in group.items() if key != "params"]
        tensors = iter(copies([value for *_, value in held if isinstance(value, Tensor)]))
        self.optimizer_state = [
            (holder, key, value, next(tensors) if isinstance(value, Tensor) else _clone(value))
            for holder, key, value in held
        ]

    def restore(self) -> None:
        """Put everything back: in place where a graph may read the tensor, by rebinding where user code rebound it."""
        with torch.no_grad():
            for metric, fields in self.metrics:
                for name, value in fields.items():
                    object.__setattr__(metric, name, _clone(value))
            for sub, plain in self.attributes:
                for key, value in plain.items():
                    if sub.__dict__.get(key, value) is not value:
                        sub.__dict__[key] = value
            # The tensors a graph may read are written back in place (a graph reads these very tensors).
            targets = [buffer for _, _, buffer, _ in self.buffers] + [tensor for tensor, _ in self.tensors]
            sources = [saved for *_, saved in self.buffers] + [saved for _, saved in self.tensors]
            for p, saved, grad, saved_grad in self.weights:
                targets.append(p)
                sources.append(saved)
                if grad is not None and saved_grad is not None:  # a graph that accumulates adds into this tensor
                    targets.append(grad)
                    sources.append(saved_grad)
            for _, _, value, saved in self.optimizer_state:
                if isinstance(value, Tensor):
                    targets.append(value)
                    sources.append(saved)
            copy_each(targets, sources)
            for sub, name, buffer, _ in self.buffers:
                sub._buffers[name] = buffer
            for p, _, grad, _ in self.weights:
                p.grad = grad
            for holder, key, value, _ in self.optimizer_state:
                holder[key] = value
        torch.set_rng_state(self.generators[0])
        random.setstate(self.generators[1])
        _set_numpy_state(self.generators[2])
        for held, saved in self.held:
            held.restore(saved)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])

    def drawn(self) -> list[str]:
        """The generators held on the module that drew since :meth:`take` (by where they are held), before a restore.

        A capture that drew from one holds that draw: every replay would repeat it.
        """
        return [held.name for held, saved in self.held if held.fingerprint() != held.fingerprint(saved)]

    def parameters_now(self) -> list[Tensor]:
        """The parameters as they are now (copies), in the order they were taken."""
        with torch.no_grad():
            return copies([p.detach() for p, *_ in self.weights])

    def gradients_now(self) -> list[Tensor | None]:
        """The parameters' gradients as they are now (copies), in the order they were taken."""
        grads = [p.grad for p, *_ in self.weights]
        with torch.no_grad():
            taken = iter(copies([g.detach() for g in grads if g is not None]))
        return [None if g is None else next(taken) for g in grads]

    def gradient_errors(self, other: list[Tensor | None], zeroed: bool) -> Differences:
        """Relative differences between the gradients in ``other`` and the ones the parameters hold (no sync).

        Each is relative to what the step added to the gradient (all of it when the step ``zeroed`` them first). A
        gradient only one side has counts as infinitely off.
        """
        both: list[tuple[int, Tensor, Tensor, Tensor | None]] = []  # place, ours, theirs, ours before the step
        missing: list[int] = []
        for i, ((p, _, _, saved_grad), theirs) in enumerate(zip(self.weights, other, strict=True)):
            ours = p.grad
            if ours is not None and theirs is not None:
                both.append((i, ours.detach(), theirs, None if zeroed else saved_grad))
            elif (ours is None) != (theirs is None):
                missing.append(i)
        from_zero = [entry for entry in both if entry[3] is None]
        added = [entry for entry in both if entry[3] is not None]
        parts = [
            off_by_each([e[1] for e in from_zero], None, [e[2] for e in from_zero]),
            off_by_each([e[1] for e in added], [e[3] for e in added if e[3] is not None], [e[2] for e in added]),
        ]
        if missing:
            parts.append(torch.full((len(missing),), float("inf"), device=self.weights[missing[0]][0].device))
        order = [e[0] for e in from_zero] + [e[0] for e in added] + missing
        return self._differences(parts, order, "gradient of ")

    def keep_gradient_buffers(self) -> None:
        """Point each parameter's ``.grad`` back at the tensor it had, holding the gradient it has now.

        An eager step between replays allocates new gradients; the captured step keeps writing the ones it was
        captured with, which are what user code should see after later replays.
        """
        moved: list[tuple[Tensor, Tensor, Tensor]] = []  # the parameter, its graph's gradient, the one it has now
        for p, _, grad, _ in self.weights:
            now = p.grad
            if grad is not None and now is not None and now is not grad and now.shape == grad.shape:
                moved.append((p, grad, now))
        with torch.no_grad():
            copy_each([grad for _, grad, _ in moved], [now for *_, now in moved])
        for p, grad, _ in moved:
            p.grad = grad

    def update_errors(self, other: list[Tensor]) -> Differences:
        """Relative differences between the update in ``other`` and the one each parameter got (no sync).

        ``other`` holds the parameters after another step from the same state (:meth:`parameters_now` then
        :meth:`restore`).
        """
        if len(other) != len(self.weights):
            raise ValueError(f"{len(other)} parameters to weigh against the {len(self.weights)} taken")
        order = [i for i, (p, *_) in enumerate(self.weights) if p.is_floating_point()]
        now = [self.weights[i][0].detach() for i in order]
        before = [self.weights[i][1] for i in order]
        return self._differences([off_by_each(now, before, [other[i] for i in order])], order, "")

    def update_error_of(self, other: list[Tensor]) -> Tensor:
        """Largest relative difference between the update in ``other`` and the one the parameters got (no sync)."""
        return self.update_errors(other).largest()

    def _differences(self, parts: list[Tensor | None], order: list[int], prefix: str) -> Differences:
        found = [part for part in parts if part is not None]
        values = (found[0] if len(found) == 1 else torch.cat(found)) if found else None
        names = [f"{prefix}{self.names[i]}" if i < len(self.names) else f"{prefix}parameter {i}" for i in order]
        return Differences(values, order, names)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover (numpy comes with torch's usual installs)
        return None
    return numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)

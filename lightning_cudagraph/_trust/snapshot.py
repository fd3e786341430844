"""A copy of what one training step can change in user state, to put back after a capture or a shadow step.

A dropped whole-step capture has still run ``training_step`` 's Python: a torchmetrics ``update`` bumped its counters
and may have rebound its states to tensors in the graph's pool, a counter moved, the CPU generator drew. A shadow step
changes the parameters and the optimizer too, and a generator the step draws from (the global ones, and those kept on
the module or a submodule) has drawn once more. Putting it all back makes the step run exactly once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

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
            state.tensors = [(t, t.clone()) for t in extra]
            for sub in module.modules():
                if isinstance(sub, Metric):
                    saved = {name: _clone(getattr(sub, name)) for name in sub._defaults}
                    saved.update({name: _clone(getattr(sub, name, None)) for name in _METRIC_FIELDS})
                    state.metrics.append((sub, saved))
                plain = {k: v for k, v in vars(sub).items() if isinstance(v, _SCALARS)}
                state.attributes.append((sub, plain))
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        state.buffers.append((sub, name, buffer, buffer.clone()))
            if optimizers is not None:
                state._take_weights(module, optimizers)
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            state.cuda = (index, torch.cuda.get_rng_state(index))
        return state

    def _take_weights(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        for p in module.parameters():
            grad = p.grad
            self.weights.append((p, p.detach().clone(), grad, None if grad is None else grad.detach().clone()))
        for optimizer in optimizers:
            for entry in optimizer.state.values():
                for key, value in entry.items():
                    self.optimizer_state.append((entry, key, value, _clone(value)))
            for group in optimizer.param_groups:
                for key, value in group.items():
                    if key != "params":
                        self.optimizer_state.append((group, key, value, _clone(value)))

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
            for sub, name, buffer, saved in self.buffers:
                buffer.copy_(saved)
                sub._buffers[name] = buffer
            for p, saved, grad, saved_grad in self.weights:
                p.copy_(saved)
                if grad is not None and saved_grad is not None:
                    grad.copy_(saved_grad)  # a graph that accumulates adds into this very tensor
                p.grad = grad
            for holder, key, value, saved in self.optimizer_state:
                if isinstance(value, Tensor):
                    value.copy_(saved)  # the captured step reads this very tensor
                holder[key] = value
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
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
        return [p.detach().clone() for p, *_ in self.weights]

    def gradients_now(self) -> list[Tensor | None]:
        """The parameters' gradients as they are now (copies), in the order they were taken."""
        return [None if p.grad is None else p.grad.detach().clone() for p, *_ in self.weights]

    def gradient_error_of(self, other: list[Tensor | None], zeroed: bool) -> Tensor:
        """Largest relative difference between the gradients in ``other`` and the ones the parameters hold (no sync).

        Each is relative to what the step added to the gradient (all of it when the step ``zeroed`` them first). A
        gradient only one side has counts as infinitely off.
        """
        errors = []
        for (p, _, _, saved_grad), theirs in zip(self.weights, other, strict=True):
            ours = p.grad
            if ours is None or theirs is None:
                if (ours is None) != (theirs is None):
                    errors.append(torch.full((), float("inf"), device=p.device))
                continue
            now = ours.detach().float()
            before = saved_grad.float() if saved_grad is not None and not zeroed else torch.zeros_like(now)
            errors.append(_off_by(now, before, theirs.float()))
        return torch.stack(errors).max() if errors else torch.zeros(())

    def keep_gradient_buffers(self) -> None:
        """Point each parameter's ``.grad`` back at the tensor it had, holding the gradient it has now.

        An eager step between replays allocates new gradients; the captured step keeps writing the ones it was
        captured with, which are what user code should see after later replays.
        """
        with torch.no_grad():
            for p, _, grad, _ in self.weights:
                if grad is not None and p.grad is not None and p.grad is not grad and p.grad.shape == grad.shape:
                    grad.copy_(p.grad)
                    p.grad = grad

    def update_error_of(self, other: list[Tensor]) -> Tensor:
        """Largest relative difference between the update in ``other`` and the one the parameters got (no sync).

        ``other`` holds the parameters after another step from the same state (:meth:`parameters_now` then
        :meth:`restore`).
        """
        errors = [
            _off_by(p.detach().float(), before.float(), after.float())
            for (p, before, *_), after in zip(self.weights, other, strict=True)
            if p.is_floating_point()
        ]
        return torch.stack(errors).max() if errors else torch.zeros(())


def _off_by(now: Tensor, before: Tensor, other: Tensor) -> Tensor:
    """How far ``other`` is from ``now``, relative to the step from ``before`` to ``now`` (no host sync).

    The step's own size is the scale, so a frozen hyperparameter or a wrong batch cannot hide behind the size of the
    weights. A sharded tensor (FSDP2's DTensor) is weighed on this rank's shard; the ranks agree on the verdict.
    """
    now, before, other = _shard(now), _shard(before), _shard(other)
    scale = (now - before).norm().clamp_min(1e-7 * before.norm() + 1e-12)
    return (other - now).norm() / scale


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


def _shard(tensor: Tensor) -> Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

"""Eager stabilization: what each target was called with during eager steps, per batch shape, and whether it is stable.

The inputs of a shape's latest step are kept, as detached copies, as its capture's sample inputs: real data, so a
capture never feeds a module values it would not see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_cudagraph._backend.backend import RecordedCall
from lightning_cudagraph._backend.signature import (
    CallSignature,
    call_signature,
    describe_change,
    distinct_tensors,
    signatures_equal,
)
from lightning_cudagraph._options.hooks import recorded_outputs
from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._trust.observation import Behaviour, frozen_by_a_graph


@dataclass
class StepRecord:
    """The target calls of one eager step, in order, (when kept) their sample inputs, and what their Python did."""

    batch: tuple[Any, ...]
    calls: list[tuple[int, CallSignature]] = field(default_factory=list)
    samples: dict[int, list[Tensor]] = field(default_factory=dict)
    behaviours: dict[int, Behaviour] = field(default_factory=dict)
    #: Per target: the outputs transformers records with hooks inside it, which its replay would not fire.
    recorded_outputs: dict[int, list[str]] = field(default_factory=dict)


@dataclass
class CapturePlan:
    """The outcome of stabilization: calls to capture in execution order, or why the step is not stable."""

    calls: list[RecordedCall] = field(default_factory=list)
    batch: tuple[Any, ...] = ()
    unstable: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    #: Targets whose forward's Python a graph would freeze, with why (left eager for the rest of the fit).
    python: dict[str, str] = field(default_factory=dict)


class WarmupRecorder:
    """Collects :class:`StepRecord` s while targets run eagerly.

    Args:
        history: Steps kept per batch shape.
        run_of: What training steps run for target ``index`` (``None``: its module's forward); a capture plan's
            calls run that.
    """

    def __init__(
        self, targets: Sequence[Target], history: int = 8, run_of: Callable[[int], Callable[..., Any]] | None = None
    ) -> None:
        self._targets = list(targets)
        self._history = history
        self._run_of = run_of or (lambda index: self._targets[index].module.forward)
        self._by_batch: dict[tuple[Any, ...], list[StepRecord]] = {}
        #: Steps recorded per batch shape, all of them: with gradient accumulation N warmup steps (optimizer steps)
        #: is N x accumulate_grad_batches recorded steps, more than ``history`` keeps.
        self._seen: dict[tuple[Any, ...], int] = {}
        self._current: StepRecord | None = None
        self._keep_samples = False

    @property
    def steps(self) -> list[StepRecord]:
        """Every recorded step still held, all batch shapes."""
        return [record for records in self._by_batch.values() for record in records]

    def recorded_steps(self, batch: tuple[Any, ...]) -> int:
        """How many eager steps of this batch shape are recorded."""
        return self._seen.get(batch, 0)

    def begin_step(self, batch: tuple[Any, ...], keep_samples: bool) -> None:
        """Start recording a step whose batch has the given key."""
        self._current = StepRecord(batch)
        self._keep_samples = keep_samples

    def record(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record one call of target ``index``."""
        if self._current is None:
            return
        module = self._targets[index].module
        signature = call_signature(module, args, kwargs)
        self._current.calls.append((index, signature))
        recorded = recorded_outputs(module)
        if recorded:
            self._current.recorded_outputs.setdefault(index, recorded)
        if self._keep_samples:
            self._current.samples[index] = [_sample_of(t) for t in distinct_tensors(signature, args, kwargs)]

    def observed(self, index: int, behaviour: Behaviour) -> None:
        """What the Python of target ``index`` 's forward did in this step's call."""
        if self._current is not None:
            self._current.behaviours.setdefault(index, behaviour)

    def end_step(self) -> None:
        """Close the step (one with no target call is kept: the targets did not run); only the latest samples stay."""
        current, self._current = self._current, None
        if current is None:
            return
        records = self._by_batch.setdefault(current.batch, [])
        if current.samples:
            for record in records:
                record.samples = {}
        records.append(current)
        del records[: -self._history]
        self._seen[current.batch] = self._seen.get(current.batch, 0) + 1

    def forget(self, batch: tuple[Any, ...]) -> None:
        """Forget the steps of one batch shape (captured: its samples are no longer needed)."""
        self._by_batch.pop(batch, None)
        self._seen.pop(batch, None)

    def clear(self) -> None:
        """Forget every recorded step (their sample inputs hold device memory)."""
        self._by_batch, self._seen = {}, {}
        self._current = None

    def discard_step(self) -> None:
        """Drop the step being recorded (it never ran to its end)."""
        self._current = None

    def plan(self, excluded: set[int], batch: tuple[Any, ...]) -> CapturePlan:
        """Decide what to capture for batches of shape ``batch`` from that shape's recorded steps.

        A target must have one signature across the steps and run once per step; a target that did not run in
        the last step, ran more than once, or ran without grad is left eager (``skipped``); any other change of
        signature makes the whole step unstable (``unstable`` names the module and the change).
        """
        steps = self._by_batch.get(batch, [])
        plan = CapturePlan()
        if not steps:
            plan.unstable = "no eager step was recorded"
            return plan
        last = steps[-1]
        plan.batch = last.batch
        for index, target in enumerate(self._targets):
            if index in excluded:
                continue
            signatures = [sig for step in steps for i, sig in step.calls if i == index]
            per_step = [sum(1 for i, _ in step.calls if i == index) for step in steps]
            if per_step[-1] == 0:
                plan.skipped[target.name] = "not called during the last eager step"
                continue
            if max(per_step) > 1:
                plan.skipped[target.name] = f"called {max(per_step)} times in one step (one graph serves one call)"
                continue
            first = signatures[0]
            changed = next((sig for sig in signatures[1:] if not signatures_equal(first, sig)), None)
            if changed is not None:
                plan.unstable = f"{target.name}: {describe_change(first, changed)}"
                return plan
            if not first.grad_enabled or not first.training:
                plan.skipped[target.name] = "runs without grad or in eval mode during training steps"
                continue
            recorded = next((step.recorded_outputs[index] for step in steps if index in step.recorded_outputs), None)
            if recorded:
                plan.python[target.name] = plan.skipped[target.name] = (
                    f"hooks_inside: Hugging Face transformers records {', '.join(recorded[:3])} with forward hooks,"
                    " which do not fire while the region replays (the model would lose those outputs)"
                )
                continue
            # The first call may set things up (a lazy cache); calls are compared from the second on.
            python = frozen_by_a_graph([step.behaviours[index] for step in steps if index in step.behaviours])
            if python is not None:
                plan.python[target.name] = plan.skipped[target.name] = (
                    f"step_python: its forward's Python {python}, which a graph would freeze"
                )
                continue
        order = [i for i, _ in last.calls if self._targets[i].name not in plan.skipped and i not in excluded]
        for index in order:
            signature = next(sig for i, sig in last.calls if i == index)
            target = self._targets[index]
            samples = last.samples.get(index)
            if samples is None:
                plan.unstable = f"{target.name}: no sample inputs were kept"
                return plan
            plan.calls.append(RecordedCall(target.name, target.module, self._run_of(index), signature, samples))
        return plan


def _sample_of(tensor: Tensor) -> Tensor:
    with torch.no_grad():
        sample = tensor.detach().clone()
    return sample.requires_grad_(tensor.requires_grad)

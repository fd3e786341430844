"""The owner of every graph: the side stream, the shared memory pool, the patched forwards, and one cleanup.

Each target module's ``forward`` is replaced by a :class:`TargetForward` for the time graphs are in use. Called in
a training step, it records the call (eager warmup), replays the region's graph (signature matched), or runs the
original forward and counts a fallback with its reason. Outside training steps (validation, test, predict) it is
a plain call of the original forward. :meth:`GraphManager.release` restores every forward, resets every graph,
frees the pool and returns to the stream that was current before; it is idempotent.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph.graphs import device_index
from lightning_cudagraph.graphs.full import FullIterationGraphs
from lightning_cudagraph.graphs.local import GraphedRegion, RecordedCall, capture_regions, tensor_addresses
from lightning_cudagraph.graphs.pool import pool_memory_mib
from lightning_cudagraph.graphs.rng import generator_guard, training_state_preserved
from lightning_cudagraph.health import CUDAGraphReport
from lightning_cudagraph.hooks import hooks_stashed
from lightning_cudagraph.recording import WarmupRecorder
from lightning_cudagraph.scopes import Target
from lightning_cudagraph.signature import (
    call_signature,
    describe_change,
    fast_key,
    grad_and_autocast_state,
    signatures_equal,
)

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The package's side stream on ``device``: eager training steps, warmups and captures all run on it.

    Capturing on the stream the eager steps ran on means autograd never has to synchronize with a stream that
    is not capturing (on torch 2.11 an eager warmup on the legacy default stream breaks a later capture).
    """
    index = device_index(device)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class TargetForward:
    """Installed as a target module's ``forward``; hands every call to the manager."""

    def __init__(self, manager: GraphManager, index: int, module: torch.nn.Module) -> None:
        self.manager, self.index, self.module = manager, index, module
        self.original = module.forward
        self._previous = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the call through the manager (record, replay or fall back)."""
        return self.manager.dispatch(self, args, kwargs)

    def restore(self) -> None:
        """Give the module back the forward it had before."""
        if self._previous is not None:
            self.module.forward = self._previous
        else:
            self.module.__dict__.pop("forward", None)


@dataclass(eq=False)
class GraphSet:
    """The regions captured for one batch signature, by target index."""

    batch: tuple[Any, ...]
    regions: dict[int, GraphedRegion]


@dataclass
class StepState:
    """What the current training step does with the targets, and what confirmation saw in it."""

    graph_set: GraphSet | None = None
    recorder: WarmupRecorder | None = None
    fallback_reason: str | None = None
    confirming: bool = False
    accumulating: bool = False
    trainable_checked: bool = False
    problem: str | None = None
    forward_order: list[str] = field(default_factory=list)
    backward_order: list[str] = field(default_factory=list)
    parity: list[Tensor] = field(default_factory=list)


class GraphManager:
    """Owns the side stream, the pool and every graph of one fit; :meth:`release` is the one cleanup."""

    def __init__(
        self,
        targets: Sequence[Target],
        report: CUDAGraphReport,
        device: torch.device,
        strict_shapes: bool,
        capture: Callable[..., list[Any]] = capture_regions,
    ) -> None:
        self.targets = list(targets)
        self.report = report
        self.device = device
        self.strict_shapes = strict_shapes
        self._capture_regions = capture
        self.stream = capture_stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.sets: dict[tuple[Any, ...], GraphSet] = {}
        self.full: FullIterationGraphs | None = None
        self._guards: list[TargetForward] = []
        self._index = {target.name: i for i, target in enumerate(self.targets)}
        self._step: StepState | None = None
        self._trainable: list[tuple[str, Tensor, bool]] = []
        self._previous_stream: torch.cuda.Stream | None = None
        self.released = False

    # ----------------------------------------------------------------- lifecycle
    def enter_stream(self) -> None:
        """Make the side stream current for training (it first waits for work queued on the current stream)."""
        if self._previous_stream is None:
            self._previous_stream = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(self._previous_stream)
            torch.cuda.set_stream(self.stream)

    def install(self) -> None:
        """Put a :class:`TargetForward` on every target."""
        if not self._guards:
            self._guards = [TargetForward(self, i, target.module) for i, target in enumerate(self.targets)]
            for guard in self._guards:
                guard.module.forward = guard

    def watch_trainable(self, named_parameters: Iterable[tuple[str, Tensor]]) -> None:
        """Remember which parameters train now: the graphs compute gradients for exactly these."""
        self._trainable = [(name, param, param.requires_grad) for name, param in named_parameters]

    def trainable_problem(self) -> str | None:
        """A rollback reason if a parameter's ``requires_grad`` changed since :meth:`watch_trainable`, else ``None``."""
        for name, param, trainable in self._trainable:
            if param.requires_grad is not trainable:
                return (
                    f"trainable_changed: {name}.requires_grad {trainable} -> {param.requires_grad}; the graphs"
                    " compute gradients for the parameters that were trainable at capture"
                )
        return None

    def full_iteration(self) -> FullIterationGraphs:
        """The whole-step graphs (created on first use)."""
        if self.full is None:
            self.full = FullIterationGraphs(self.stream, self.pool, self.device, self.report)
        return self.full

    def release(self) -> None:
        """Restore forwards, reset graphs, free the pool, return to the previous stream. Safe to call twice."""
        if self.released:
            return
        self.released = True
        self._step = None
        with contextlib.suppress(RuntimeError):  # a sticky CUDA error must not stop the Python-side cleanup
            self.stream.synchronize()
        guards, self._guards = self._guards, []
        for guard in guards:  # first: plain Python, and what a user would trip over most
            guard.restore()
        try:
            self._reset_graphs()
        finally:  # whatever a reset raised, training goes back to the stream it came from
            self.report.graphs = 0
            self._leave_stream()
            self.pool = None
            gc.collect()
            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()

    def _reset_graphs(self) -> None:
        sets, self.sets = list(self.sets.values()), {}
        full, self.full = self.full, None
        try:
            for graph_set in sets:
                for region in graph_set.regions.values():
                    region.reset()
        finally:
            if full is not None:
                full.release()

    def _leave_stream(self) -> None:
        if self._previous_stream is not None:
            previous, self._previous_stream = self._previous_stream, None
            with contextlib.suppress(RuntimeError):
                previous.wait_stream(self.stream)
            torch.cuda.set_stream(previous)

    # ----------------------------------------------------------------- steps
    def begin_step(self, state: StepState) -> None:
        """Route target calls of this training step according to ``state``."""
        self._step = state

    def end_step(self) -> StepState | None:
        """Stop routing; return what the step saw."""
        state, self._step = self._step, None
        return state

    def dispatch(self, guard: TargetForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call of a target: record, replay, or fall back (counted, with its reason)."""
        step = self._step
        if step is None:
            return guard.original(*args, **kwargs)
        if step.recorder is not None:
            step.recorder.record(guard.index, args, kwargs)
        if step.fallback_reason is not None:
            self.report.count_fallback(step.fallback_reason)
            return guard.original(*args, **kwargs)
        region = step.graph_set.regions.get(guard.index) if step.graph_set is not None else None
        if region is None:
            return guard.original(*args, **kwargs)
        if not step.trainable_checked:  # here, not at batch start: hooks before the forward may (un)freeze
            step.trainable_checked = True
            step.problem = self.trainable_problem()
            if step.problem is not None:
                step.fallback_reason = "trainable parameters changed since capture"
                self.report.count_fallback(step.fallback_reason)
                return guard.original(*args, **kwargs)
        mismatch = self._mismatch(region, guard.module, args, kwargs)
        if mismatch is not None:
            if self.strict_shapes:
                raise RuntimeError(
                    f"CUDAGraphCallback(on_shape_change='error'): {region.name} was captured for another input:"
                    f" {mismatch}. Fix: keep shapes fixed (e.g. drop_last=True), or pass on_shape_change='eager'"
                    " or 'recapture'."
                )
            self.report.count_fallback(f"{region.name}: {mismatch}")
            return guard.original(*args, **kwargs)
        if step.confirming:
            return self._confirming_call(step, region, guard, args, kwargs)
        if step.accumulating:
            region.detach_accumulated_grads()
        self.report.replays += 1
        return region(args, kwargs)

    # ----------------------------------------------------------------- capture
    def capture(self, batch: tuple[Any, ...], calls: Sequence[RecordedCall], warmup_iters: int = 3) -> GraphSet:
        """Capture the recorded calls for batches with key ``batch``; leaves no trace on RNG or buffers.

        Raises whatever the capture raised, after undoing its partial work (graphs reset, generator state back).
        """
        if self.report.memory_before_capture is None:
            self.report.memory_before_capture = torch.cuda.memory_allocated(self.device)
        modules = [call.module for call in calls]
        started = time.perf_counter()
        with training_state_preserved(self.device, modules), generator_guard(self.device), hooks_stashed(modules):
            regions = self._capture_regions(calls, pool=self.pool, stream=self.stream, warmup_iters=warmup_iters)
        for region in regions:
            region.on_backward = self._on_backward
            region.fast = region.signature.fast_key
        graph_set = GraphSet(batch, {self._index[region.name]: region for region in regions})
        self.sets[batch] = graph_set
        self.report.captures += 1
        self.report.graphs = sum(len(s.regions) for s in self.sets.values())
        self.report.capture_ms = (time.perf_counter() - started) * 1e3
        self.report.pool_mib = pool_memory_mib(self.pool, self.device)
        return graph_set

    # ----------------------------------------------------------------- internals
    def _mismatch(
        self, region: GraphedRegion, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        signature = region.signature
        grad, autocast = grad_and_autocast_state()
        if (
            not kwargs
            and region.fast is not None
            and module.training == signature.training
            and grad == signature.grad_enabled
            and autocast == signature.autocast
            and fast_key(args) == region.fast
        ):
            return None
        live = call_signature(module, args, kwargs)
        return None if signatures_equal(signature, live) else describe_change(signature, live)

    def _confirming_call(
        self,
        step: StepState,
        region: GraphedRegion,
        guard: TargetForward,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        moved = [name for name, ptr in tensor_addresses(guard.module).items() if region.addresses.get(name) != ptr]
        if moved:
            step.problem = f"address_changed: {region.name}.{moved[0]} is not the tensor the graph was captured with"
            step.fallback_reason = "confirmation failed"
            self.report.count_fallback(step.fallback_reason)
            return guard.original(*args, **kwargs)
        step.forward_order.append(region.name)
        if region.parity_checked:
            if step.accumulating:
                region.detach_accumulated_grads()
            self.report.replays += 1
            return region(args, kwargs)
        return self._parity_call(step, region, guard, args, kwargs)

    def _parity_call(
        self,
        step: StepState,
        region: GraphedRegion,
        guard: TargetForward,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Replay the forward graph and run the eager forward on the same inputs; train on the eager result."""
        with training_state_preserved(self.device, [guard.module]):
            graphed = region.replay_forward_detached(args, kwargs)
        self.report.replays += 1
        output = guard.original(*args, **kwargs)
        eager = [leaf.detach() for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
        step.parity.append(relative_error(eager, graphed))
        region.parity_checked = True
        return output

    def _on_backward(self, region: GraphedRegion) -> None:
        if self._step is not None and self._step.confirming:
            self._step.backward_order.append(region.name)


def relative_error(reference: Sequence[Tensor], other: Sequence[Tensor]) -> Tensor:
    """Largest ``max|a - b| / max|a|`` over paired tensors, as a device scalar (no host sync)."""
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

"""Patched forwards and the per-call policy of scoped graphs.

In a training step a target's call is recorded (warmup steps), replays its region's graph, or runs eagerly as a
counted fallback with its reason. Outside training steps it is a plain call of the original forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._backend.backend import RegionGraphs
from lightning_cudagraph._backend.compiling import CompiledForwards
from lightning_cudagraph._backend.local import moved_since, tensor_addresses
from lightning_cudagraph._backend.signature import (
    call_key,
    call_signature,
    describe_change,
    grad_and_autocast_state,
    positional_key,
    signatures_equal,
)
from lightning_cudagraph._graphs.patched_forward import PatchedForward
from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._trust.evidence import relative_error
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.recording import WarmupRecorder
from lightning_cudagraph.health import CUDAGraphReport


class TargetForward(PatchedForward):
    """Installed as a target module's ``forward``; hands every call to the router.

    ``original`` is the module's own forward; ``run`` is what training steps run and capture (compiled with
    ``compile=``).
    """

    def __init__(
        self,
        index: int,
        module: torch.nn.Module,
        route: Callable[..., Any],
        compiled: CompiledForwards | None = None,
    ) -> None:
        super().__init__(module)
        self.index, self._route = index, route
        self.original = self.run
        if compiled is not None:
            self.run = compiled.for_module(module, self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the call through the router (record, replay or fall back)."""
        return self._route(self, args, kwargs)


class PatchedForwards:
    """The targets' forwards, patched for one fit."""

    def __init__(
        self, targets: Sequence[Target], route: Callable[..., Any], compiled: CompiledForwards | None = None
    ) -> None:
        self._targets, self._route, self._compiled = list(targets), route, compiled
        self._patched: list[TargetForward] = []

    def install(self) -> None:
        """Put a :class:`TargetForward` on every target (idempotent)."""
        if not self._patched:
            self._patched = [
                TargetForward(i, t.module, self._route, self._compiled) for i, t in enumerate(self._targets)
            ]
            for forward in self._patched:
                forward.install()

    def run_of(self, index: int) -> Callable[..., Any]:
        """What training steps run (and a capture records) for target ``index``: its forward, or the compiled one."""
        return self._patched[index].run if self._patched else self._targets[index].module.forward

    def restore(self) -> None:
        """Give every target its forward back (idempotent)."""
        patched, self._patched = self._patched, []
        for forward in patched:
            forward.restore()


@dataclass
class ReplayEntry:
    """A captured region and what the router keeps about it."""

    region: RegionGraphs
    parity_checked: bool = False


@dataclass(eq=False)
class GraphSet:
    """The regions captured for one batch signature, by target index, and how far its confirmation is."""

    batch: tuple[Any, ...]
    entries: dict[int, ReplayEntry]
    confirm_left: int = 0
    graphed_step_seen: bool = False
    replays: int = 0

    def reset(self) -> None:
        """Free every region's graphs."""
        for entry in self.entries.values():
            entry.region.reset()


@dataclass
class StepRoute:
    """What the current training step does with target calls, and what was seen on the way."""

    graph_set: GraphSet | None = None
    recorder: WarmupRecorder | None = None
    fallback_reason: str | None = None
    confirming: bool = False
    #: Gradients may carry over from the step before (accumulate_grad_batches > 1, or manual optimization): each
    #: replay first gives parameters holding a region's gradient buffer a copy, so the backward adds to them.
    accumulating: bool = False
    state_checked: bool = False
    problem: str | None = None
    forward_order: list[str] = field(default_factory=list)
    backward_order: list[str] = field(default_factory=list)
    parity: list[tuple[int, Tensor]] = field(default_factory=list)
    replays: int = 0
    fallbacks: int = 0
    #: The targets that ran in this step (a graph serves one call of its region per step).
    called: set[int] = field(default_factory=set)


class CallRouter:
    """Routes each target call of a training step by its :class:`StepRoute` (stage 6, and confirmation's checks).

    Args:
        report: Replays and fallbacks are counted here.
        mismatch: Given (region name, what differs) of a call its graph was not captured for, the fallback's reason;
            it raises under ``on_shape_change="error"``.
        state_problem: Says why the parameters no longer match the graphs, or ``None``.
        preserved: Restores random-number and buffer state around a confirmation's graphed forward.
        observer: Watches the Python of each recorded call.
    """

    def __init__(
        self,
        report: CUDAGraphReport,
        mismatch: Callable[[str, str], str],
        state_problem: Callable[[], str | None],
        preserved: Callable[[list[torch.nn.Module]], contextlib.AbstractContextManager[None]],
        observer: Observer,
    ) -> None:
        self.report, self._mismatch = report, mismatch
        self._state_problem, self._preserved, self._observer = state_problem, preserved, observer
        self._route: StepRoute | None = None

    def begin(self, route: StepRoute) -> None:
        """Route target calls of this training step according to ``route``."""
        self._route = route

    def end(self) -> StepRoute | None:
        """Stop routing; return what the step saw."""
        route, self._route = self._route, None
        return route

    def __call__(self, forward: TargetForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call of a target: record, replay, or fall back (counted, with its reason)."""
        route = self._route
        if route is None:
            return forward.original(*args, **kwargs)
        if route.recorder is not None:
            if route.fallback_reason is not None:  # a new shape's own eager steps while graphs are in use
                self._count_fallback(route, route.fallback_reason)
            return self._recorded_call(route.recorder, forward, args, kwargs)
        again = forward.index in route.called
        route.called.add(forward.index)
        entry = route.graph_set.entries.get(forward.index) if route.graph_set is not None else None
        if again and entry is not None:  # replaying again would overwrite what the first call saved for backward
            self._count_fallback(route, called_again(entry.region.name))
            return forward.run(*args, **kwargs)
        if route.fallback_reason is not None or entry is None:
            if route.fallback_reason is not None:
                self._count_fallback(route, route.fallback_reason)
            return forward.run(*args, **kwargs)
        if not route.state_checked:  # here, not at batch start: hooks before the forward may (un)freeze or rebind
            route.state_checked = True
            route.problem = self._state_problem()
            if route.problem is not None:
                route.fallback_reason = "parameters changed since capture"
                self._count_fallback(route, route.fallback_reason)
                return forward.run(*args, **kwargs)
        mismatch = _mismatch(entry.region, forward.module, args, kwargs)
        if mismatch is not None:
            self._count_fallback(route, self._mismatch(entry.region.name, mismatch))
            return forward.run(*args, **kwargs)
        if route.confirming:
            return self._confirming_call(route, entry, forward, args, kwargs)
        return self._replay(route, entry, args, kwargs)

    def _recorded_call(
        self, recorder: WarmupRecorder, forward: TargetForward, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """An eager call of a warmup step: its signature recorded, its Python observed."""
        with self._observer.paused():  # the recorder's copies of the inputs are not the call's
            recorder.record(forward.index, args, kwargs)
        with self._observer.span([forward.module]) as seen:
            output = forward.run(*args, **kwargs)
        recorder.observed(forward.index, seen)
        return output

    def on_backward(self, region: RegionGraphs) -> None:
        """A region's backward graph is about to replay (confirmation checks the order)."""
        if self._route is not None and self._route.confirming:
            self._route.backward_order.append(region.name)

    def _replay(self, route: StepRoute, entry: ReplayEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if route.accumulating:
            entry.region.detach_accumulated_grads()
        route.replays += 1
        self.report.replays += 1
        return entry.region(args, kwargs)

    def _count_fallback(self, route: StepRoute, reason: str) -> None:
        route.fallbacks += 1
        self.report.count_fallback(reason)

    def _confirming_call(
        self, route: StepRoute, entry: ReplayEntry, forward: TargetForward, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        region = entry.region
        moved = moved_since(region.addresses, tensor_addresses(forward.module))
        if moved:
            route.problem = f"address_changed: {region.name}.{moved[0]} is not the tensor the graph was captured with"
            route.fallback_reason = "confirmation failed"
            self._count_fallback(route, route.fallback_reason)
            return forward.run(*args, **kwargs)
        route.forward_order.append(region.name)
        if entry.parity_checked:
            return self._replay(route, entry, args, kwargs)
        # Parity: replay the forward graph and run the eager forward (never the compiled one: compiled kernels are
        # checked too) on the same inputs; train on the eager result.
        with self._preserved([forward.module]):
            graphed = region.replay_forward_detached(args, kwargs)
        route.replays += 1
        self.report.replays += 1
        output = forward.original(*args, **kwargs)
        eager = [leaf.detach() for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
        route.parity.append((forward.index, relative_error(eager, graphed)))
        entry.parity_checked = True
        return output


def called_again(name: str) -> str:
    """The fallback reason of a region called a second time in one training step."""
    return (
        f"called_again: {name} ran again in the same training step; its graph serves one call per step (a second"
        " replay would overwrite what the first saved for backward), so this call runs eagerly"
    )


def _mismatch(
    region: RegionGraphs, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Why this call cannot replay the region's graph, or ``None``.

    Common calls compare a cheap key; the full signature is built only for other calls, and to say what changed.
    """
    signature = region.signature
    if signature.key is not None and module.training == signature.training:
        grad, autocast = grad_and_autocast_state()
        if grad == signature.grad_enabled and autocast == signature.autocast:
            if not kwargs and signature.positional_key is not None:  # module(t0, t1, ...): cheaper still
                if positional_key(args) == signature.positional_key:
                    return None
            else:
                live_key = call_key(args, kwargs)
                if live_key is not None and live_key[0] == signature.key:
                    return None
    live = call_signature(module, args, kwargs)
    return None if signatures_equal(signature, live) else describe_change(signature, live)

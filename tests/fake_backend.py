"""A capture backend for CPU tests: it records what the drivers ask for and runs the original code.

It implements the package's seam (:class:`lightning_cudagraph.graphs.backend.CaptureBackend`), so on a CPU the whole
lifecycle runs for real: warmup recording, the capture decision, patched forwards, confirmation, replay counting,
fallbacks, rollback and release. Where a graph would replay recorded kernels, a fake region or step runs the
original forward (or training step) again; like a real graph, a region's replay fires no hooks of the modules
inside it. It never stands in for a claim about CUDA: capture itself is tested on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph.graphs.backend import CaptureBackend, RegionCapture, RegionCaptures, StepGraph
from lightning_cudagraph.graphs.local import tensor_addresses
from lightning_cudagraph.health import StepTimer
from lightning_cudagraph.hooks import hooks_stashed
from lightning_cudagraph.recording import RecordedCall
from lightning_cudagraph.signature import rebuild_call


class FakeRegion:
    """Runs the module's original forward where a graph would replay; ``distort`` scales what a replay returns."""

    def __init__(self, call: RecordedCall, distort: float = 1.0) -> None:
        self.name, self.module, self.signature = call.name, call.module, call.signature
        self.addresses = tensor_addresses(call.module)
        self.on_backward: Callable[[Any], None] | None = None
        self.replays = 0
        self.live = True
        self._forward, self._distort = call.forward, distort

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.replays += 1
        with hooks_stashed([self.module], include_roots=False):  # a graph does not run inner hooks
            output = self._forward(*args, **kwargs)
        if self._distort != 1.0:
            output = pytree.tree_map(lambda v: v * self._distort if isinstance(v, Tensor) else v, output)
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                leaf.register_hook(self._notify_backward)
                break
        return output

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        # Under the grad mode the forward was captured in, as a replay is (a compiled forward would recompile for
        # another one); the result is detached, as a replay's is.
        self.replays += 1
        with hooks_stashed([self.module], include_roots=False):
            output = self._forward(*args, **kwargs)
        return [leaf.detach() * self._distort for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]

    def detach_accumulated_grads(self) -> None:
        """Nothing to detach: gradients are autograd's own."""

    def reset(self) -> None:
        self.live = False

    def _notify_backward(self, grad: Tensor) -> None:
        if self.on_backward is not None:
            self.on_backward(self)


class FakeStepGraph:
    """A whole step: capturing runs the step once (that step's work), each later replay runs it again."""

    def __init__(self, body: Callable[[], None]) -> None:
        self._body: Callable[[], None] | None = body
        body()
        self._capture_ran_this_step = True
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        if self._capture_ran_this_step:  # the capture's own run did the step the first replay stands for
            self._capture_ran_this_step = False
            return
        self._body()

    def reset(self) -> None:
        self._body = None

    @property
    def live(self) -> bool:
        return self._body is not None


class FakeOptimizer:
    """The optimizer as built (CPU optimizers need no capturable form); records that it was given back."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.restored = optimizer, False

    def refresh(self) -> None:
        """Nothing to refresh: the optimizer reads its hyperparameters as built."""

    def plain_state_dict(self, state: dict[str, Any]) -> None:
        """Already plain."""

    def restore(self) -> None:
        self.restored = True


class FakeTimer(StepTimer):
    """Step times that the test decides: ``step_ms(backend)`` when a step ends, from what is captured then."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(use_cuda=False)
        self._backend, self._times = backend, []

    def stop(self) -> None:
        if self._open is not None:
            self._open = None
            self._times.append(self._backend.step_ms(self._backend))

    def read(self) -> list[float]:
        times, self._times = self._times, []
        return times


@dataclass
class FakeBackend(CaptureBackend):
    """Records every request; ``fail_capture`` makes captures raise, ``distort`` corrupts named regions' replays.

    Attributes:
        device: The device training runs on (the CPU).
        fail_capture: Raised by every capture when set.
        fail_step: Raised by whole-step captures only.
        fail_regions: Region name (or a prefix ending in ``.``) -> error its capture raises; as with the CUDA
            backend, the pass ends there and reports it.
        distort: Region name -> factor its replays are scaled by (a wrong graph).
        mib_per_graph: What each live graph counts towards the pool.
        step_ms: When set, the step time the timer reports for a step, from the backend's state at its end (live
            regions and steps); otherwise host time.
        warmup_iters_per_pass: The warmup iterations each region capture pass was asked for, in order.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fail_capture: Exception | None = None
    fail_step: Exception | None = None
    fail_regions: dict[str, Exception] = field(default_factory=dict)
    distort: dict[str, float] = field(default_factory=dict)
    mib_per_graph: float = 1.0
    step_ms: Callable[[FakeBackend], float] | None = None
    pools: int = 1
    entered: bool = False
    capturing: bool = False
    releases: int = 0
    regions: list[FakeRegion] = field(default_factory=list)
    step_graphs: list[FakeStepGraph] = field(default_factory=list)
    optimizers: list[FakeOptimizer] = field(default_factory=list)
    warmup_iters_per_pass: list[int] = field(default_factory=list)

    @property
    def stream(self) -> None:
        return None

    def enter(self) -> None:
        self.entered = True

    def leave(self) -> None:
        self.entered = False

    def capture_regions(
        self, calls: Sequence[RecordedCall], warmup_iters: int, capture: RegionCapture | None = None
    ) -> RegionCaptures:
        self.capturing = True
        self.warmup_iters_per_pass.append(warmup_iters)
        try:
            if self.fail_capture is not None:
                raise self.fail_capture
            for call in calls:  # like a capture, run each call once (its hooks must have been stashed)
                error = self._region_failure(call.name)
                if error is not None:  # like the CUDA backend: the pass ends (after warmup), its pool is not used again
                    return RegionCaptures(failed={call.name: error}, warmed=True)
                args, kwargs = rebuild_call(call.signature, call.samples)
                call.forward(*args, **kwargs)
        finally:
            self.capturing = False
        regions = [FakeRegion(call, self.distort.get(call.name, 1.0)) for call in calls]
        self.regions.extend(regions)
        return RegionCaptures(regions)

    def _region_failure(self, name: str) -> Exception | None:
        for pattern, error in self.fail_regions.items():
            if name == pattern or (pattern.endswith(".") and name.startswith(pattern)):
                return error
        return None

    def renew_pool(self) -> None:
        self.pools += 1

    def capture_step(self, body: Callable[[], None]) -> StepGraph:
        if self.fail_capture is not None or self.fail_step is not None:
            raise self.fail_capture or self.fail_step
        self.capturing = True
        try:
            graph = FakeStepGraph(body)
        finally:
            self.capturing = False
        self.step_graphs.append(graph)
        return graph

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> FakeOptimizer:
        prepared = FakeOptimizer(optimizer)
        self.optimizers.append(prepared)
        return prepared

    def pool_mib(self) -> float:
        live = sum(region.live for region in self.regions) + sum(graph.live for graph in self.step_graphs)
        return live * self.mib_per_graph

    def memory_allocated(self) -> int:
        return 0

    def timer(self) -> StepTimer:
        return FakeTimer(self) if self.step_ms is not None else StepTimer(use_cuda=False)

    def release(self) -> None:
        self.releases += 1
        self.leave()

    @property
    def live_region_names(self) -> list[str]:
        """Names of the regions captured and not reset."""
        return [region.name for region in self.regions if region.live]

    @property
    def live_graphs(self) -> int:
        """Regions and steps captured and not reset."""
        return sum(region.live for region in self.regions) + sum(graph.live for graph in self.step_graphs)

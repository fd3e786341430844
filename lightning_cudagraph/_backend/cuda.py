"""The CUDA capture backend: side stream, shared memory pool, ``torch.cuda`` graphs, CUDA random-number state.

Eager steps, warmups and captures all run on one side stream per device, so autograd never syncs with a stream
that is not capturing (on torch 2.11 an eager warmup on the legacy default stream breaks a later capture).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_cudagraph._backend.backend import (
    CaptureBackend,
    CaptureMethod,
    CapturePassResult,
    PreparedOptimizer,
    RecordedCall,
    StepGraph,
)
from lightning_cudagraph._backend.capture import gc_frozen, graph_capture, stale_streams_joined
from lightning_cudagraph._backend.local import capture_regions
from lightning_cudagraph._backend.optimizers import CapturableOptimizer
from lightning_cudagraph._backend.state import (
    cuda_generator_guard,
    cuda_rng_preserved,
    device_index,
    module_state_preserved,
)
from lightning_cudagraph._backend.timing import StepTimer


@functools.cache
def side_stream(index: int) -> torch.cuda.Stream:
    """The package's side stream on CUDA device ``index`` (one per process, shared by every fit)."""
    return torch.cuda.Stream(device=index)


class CUDAStepGraph:
    """A whole step captured with ``torch.cuda.graph``."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self._graph: torch.cuda.CUDAGraph | None = graph

    def replay(self) -> None:
        """Replay the step's kernels."""
        assert self._graph is not None, "a step graph is replayed only until it is reset"
        self._graph.replay()

    def reset(self) -> None:
        """Free the graph."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = None


class CUDABackend(CaptureBackend):
    """Captures with PyTorch's CUDA graphs on a side stream, into one memory pool per fit."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._pool: Any = None
        self._previous_stream: torch.cuda.Stream | None = None
        self._holds = False  # a pool was made, or training entered the side stream, since the last release

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream training runs on."""
        return side_stream(device_index(self.device))

    @property
    def pool(self) -> Any:
        """The memory pool every graph of this fit is captured into (created on first use)."""
        if self._pool is None:
            self._pool, self._holds = torch.cuda.graph_pool_handle(), True
        return self._pool

    def enter(self) -> None:
        """Make the side stream current (it first waits for work queued on the current stream)."""
        if self._previous_stream is None:
            self._holds = True
            self._previous_stream = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(self._previous_stream)
            torch.cuda.set_stream(self.stream)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """A block run on the side stream."""
        return torch.cuda.stream(self.stream)

    def leave(self) -> None:
        """Return to the stream that was current before :meth:`enter`, after the side stream's work."""
        if self._previous_stream is not None:
            previous, self._previous_stream = self._previous_stream, None
            with contextlib.suppress(RuntimeError):  # a sticky CUDA error must not keep training on the side stream
                previous.wait_stream(self.stream)
            torch.cuda.set_stream(previous)

    def capture_regions(
        self, calls: Sequence[RecordedCall], warmup_iters: int, capture: CaptureMethod | None = None
    ) -> CapturePassResult:
        """Capture with ``capture`` (PyTorch's forward/backward pairs by default) on the side stream, GC frozen.

        Another method (Transformer Engine's) gets at least one warmup iteration: its FP8 state is its own.
        """
        if capture is not None:
            warmup_iters = max(warmup_iters, 1)
        capture = capture or capture_regions
        with gc_frozen():
            return capture(calls, pool=self.pool, stream=self.stream, warmup_iters=warmup_iters)

    def renew_pool(self) -> None:
        """A new pool for the next captures: a level of ``scope="auto"`` never shares memory with the one before."""
        self._pool = None

    def capture_step(self, body: Callable[[], None]) -> StepGraph:
        """Capture ``body`` as one graph, GC frozen; on failure the graph is reset before the error propagates."""
        graph = torch.cuda.CUDAGraph()
        with gc_frozen(), stale_streams_joined(), torch.cuda.stream(self.stream), graph_capture(graph, self.pool):
            body()
        return CUDAStepGraph(graph)

    def marker(self) -> torch.cuda.Event:
        """A CUDA event recorded on the training stream: ``query()`` without a host sync."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Capturable Adam/AdamW, fused SGD, learning rates as device tensors."""
        return CapturableOptimizer(optimizer, self.device)

    def pool_mib(self) -> float:
        """MiB in the allocator segments that belong to the pool (one allocator snapshot)."""
        if self._pool is None:
            return 0.0
        index, pool = device_index(self.device), tuple(self._pool)
        total = sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if segment.get("device") == index and tuple(segment.get("segment_pool_id", ())) == pool
        )
        return total / 2**20

    def memory_allocated(self) -> int:
        """``torch.cuda.memory_allocated`` of the device."""
        return torch.cuda.memory_allocated(self.device)

    def timer(self) -> StepTimer:
        """CUDA events on the current stream, read once per log interval."""
        return StepTimer(use_cuda=True)

    @contextlib.contextmanager
    def preserved(self, modules: Iterable[torch.nn.Module]) -> Iterator[None]:
        """CUDA and CPU generators and the modules' buffers, restored on exit."""
        with cuda_rng_preserved(self.device), module_state_preserved(modules):
            yield

    def failure_guard(self) -> contextlib.AbstractContextManager[Any]:
        """The CUDA generator back to its pre-capture state after a failed capture."""
        return cuda_generator_guard(self.device)

    def release(self) -> None:
        """Wait for the side stream, drop the pool, leave the side stream, give cached memory back.

        Lightning ends a fit through several hooks that each release; only the first frees anything (a
        ``gc.collect()`` costs a large process a good part of a second).
        """
        if not self._holds:
            return
        with contextlib.suppress(RuntimeError):  # a sticky CUDA error must not stop the Python-side cleanup
            self.stream.synchronize()
        self._pool, self._holds = None, False
        self.leave()
        gc.collect()
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()


def default_backend(device: torch.device) -> CaptureBackend | None:
    """The CUDA backend for a CUDA device when CUDA is available, else ``None`` (graphs off: ``no_cuda``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return CUDABackend(device)

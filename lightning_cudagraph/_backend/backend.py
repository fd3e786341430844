"""The capture backend: the one seam between the drivers and the device.

The drivers decide what to capture and when; a backend does the device work.
:class:`~lightning_cudagraph._backend.cuda.CUDABackend` is the real one; another (a test double, another
accelerator) is handed to the callback or strategy as ``capture_backend``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_cudagraph._backend.signature import CallSignature
from lightning_cudagraph._backend.state import module_state_preserved
from lightning_cudagraph._backend.timing import StepTimer


@dataclass
class RecordedCall:
    """A target's call seen during eager warmup steps: how to run it, what it was called with, and its signature.

    ``samples`` are detached copies of the call's real inputs, so a capture never feeds a module values it would not
    see.
    """

    name: str
    module: torch.nn.Module
    forward: Callable[..., Any]
    signature: CallSignature
    samples: list[Tensor]


class RegionGraphs(Protocol):
    """One region's graphs: replays them in place of the target module's forward (and backward)."""

    name: str
    module: torch.nn.Module
    signature: CallSignature
    addresses: dict[str, int]
    on_backward: Callable[[Any], None] | None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Replay for a call whose signature matched; gradients flow through autograd."""

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """Replay only the forward, outside autograd, and return copies of its tensor outputs."""

    def detach_accumulated_grads(self) -> None:
        """With gradient accumulation: move adopted gradient buffers out before the next backward replay."""

    def reset(self) -> None:
        """Free the region's graphs and buffers."""


class StepGraph(Protocol):
    """A captured whole training step."""

    def replay(self) -> None:
        """Run the step again on the current contents of its static buffers."""

    def reset(self) -> None:
        """Free the graph."""


class PreparedOptimizer(Protocol):
    """An optimizer switched to the form its step can be captured in, for the fit."""

    def refresh(self) -> None:
        """Take user-assigned hyperparameters into the captured state (no host sync)."""

    def plain_state_dict(self, state: dict[str, Any]) -> None:
        """Rewrite a saved ``state_dict`` into the form the user built the optimizer in."""

    def restore(self) -> None:
        """Give the optimizer back as it was built."""


@dataclass
class CapturePassResult:
    """One capture pass's result: the regions captured, or the calls that could not be, with the error.

    With a failure, the driver resets any returned regions and captures again without that call, into a new pool.
    """

    regions: list[RegionGraphs] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)
    #: Every call was warmed up on the capture stream before the failure: a pass over what is left needs no warmup.
    warmed: bool = False


#: A method of capturing regions: ``capture(calls, *, pool, stream, warmup_iters) -> CapturePassResult`` (PyTorch's,
#: or TE's, which captures all calls at once and raises on a failure).
CaptureMethod = Callable[..., CapturePassResult]


class CaptureBackend(ABC):
    """Device work for the drivers. One per fit; :meth:`release` frees what it holds and it can serve another fit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    @abstractmethod
    def stream(self) -> Any:
        """The stream eager steps, warmups and captures run on (``None`` where the device has none)."""

    @abstractmethod
    def enter(self) -> None:
        """Make :attr:`stream` current for training (idempotent)."""

    @abstractmethod
    def leave(self) -> None:
        """Return to the stream that was current before :meth:`enter` (idempotent)."""

    @abstractmethod
    def capture_regions(
        self, calls: Sequence[RecordedCall], warmup_iters: int, capture: CaptureMethod | None = None
    ) -> CapturePassResult:
        """Capture the recorded calls in execution order into the shared pool; ``capture`` overrides how."""

    @abstractmethod
    def capture_step(self, body: Callable[[], None]) -> StepGraph:
        """Capture ``body`` (one whole training step) into the shared pool."""

    @abstractmethod
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Switch ``optimizer`` to a form whose step can be captured (done once, for the whole fit)."""

    @abstractmethod
    def renew_pool(self) -> None:
        """Start a new memory pool for the next captures (the graphs of the old one must be released first)."""

    @abstractmethod
    def pool_mib(self) -> float:
        """Memory the shared pool holds, in MiB."""

    @abstractmethod
    def memory_allocated(self) -> int:
        """Bytes allocated on the device now."""

    @abstractmethod
    def timer(self) -> StepTimer:
        """A step timer for this device (no host sync per step)."""

    @abstractmethod
    def release(self) -> None:
        """Wait for queued work, free the pool, give cached memory back (idempotent)."""

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """A block run on :attr:`stream`, so that what it builds names that stream (nothing where there is none)."""
        return contextlib.nullcontext()

    def marker(self) -> Any:
        """A marker behind the work launched so far, whose ``query()`` says whether the device finished it.

        This default, for a device without streams, is done at once.
        """
        return _Done()

    def preserved(self, modules: Iterable[torch.nn.Module]) -> contextlib.AbstractContextManager[None]:
        """Random-number state and the modules' buffers, restored on exit (a capture leaves no trace)."""
        return module_state_preserved(modules)

    def failure_guard(self) -> contextlib.AbstractContextManager[Any]:
        """Undo what a failed capture leaves behind in the device's random-number state.

        Yields an object whose ``mark_failed()`` a capture that reports its failure (instead of raising) calls, or
        ``None`` where there is nothing to undo.
        """
        return contextlib.nullcontext()


class _Done:
    """A marker of work that already finished."""

    def query(self) -> bool:
        return True

"""The host side of a CUDA capture: one graph's capture on the current stream, and the garbage collector around a pass.

``torch.cuda.graph`` syncs, runs a full ``gc.collect()`` and empties the cache before every graph: most of a scoped
pass's host time (two graphs per region). Here a pass collects the young generations once and freezes the collector
(as Megatron-Core does), and each graph begins without a sync. A training step's garbage (autograd's cycles) is
young; what an older generation holds only costs memory, never a wrong graph.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["gc_frozen", "graph_capture", "warn_on_grad_stream_mismatch"]

#: The capture path before the faster capture (full collection, a sync after warmups): for benchmarks/host_cost.py.
_PREVIOUS_CAPTURE = False


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect the young generations once, then freeze the collector's tracked objects for the body; unfreeze on exit.

    A collector the process froze itself (a forking server's ``gc.freeze()``) is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect(2 if _PREVIOUS_CAPTURE else 1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """Capture into ``graph`` on the current stream, into ``pool``.

    No sync, ``gc.collect()`` or ``empty_cache()`` first. A failed body ends the capture without masking its error and
    leaves the allocator as it found it.
    """
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        yield
    except BaseException:
        try:
            graph.capture_end()
        except RuntimeError:  # an invalidated capture (a host sync inside it) fails to end
            # ``capture_end`` raised before it stopped routing this stream's allocations into the pool; left so,
            # every later capture into it fails ("already recording") and eager allocations would land in it.
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        graph.reset()
        raise
    graph.capture_end()


def warn_on_grad_stream_mismatch(enabled: bool) -> None:
    """Turn autograd's warning about gradients accumulated on another stream on or off (where torch has it).

    DDP on the graphs' side stream keeps eager steps' autograd nodes alive, which that warning reports as a mismatch.
    """
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(enabled)


@contextmanager
def stale_streams_joined() -> Iterator[None]:
    """During a whole-step capture, autograd nodes naming a stale stream run on the capturing one (where torch can).

    An eager step's autograd nodes (DDP's, FSDP2's) can keep the stream they were built on; a captured wait on it
    would pull a non-capturing stream into the graph. The torch override is process-global, so it is switched off after.
    """
    override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if override is None:
        yield
        return
    override(True)
    try:
        yield
    finally:
        override(False)

"""The host side of a capture: the garbage collector is frozen around every capture pass, and thawed on every exit."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_cudagraph._backend import cuda
from lightning_cudagraph._backend.backend import CapturePassResult
from lightning_cudagraph._backend.capture import gc_frozen


def test_the_collector_is_frozen_inside_and_thawed_after_even_on_an_error():
    with gc_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="capture broke"), gc_frozen():
        raise RuntimeError("capture broke")
    assert gc.get_freeze_count() == 0


def test_a_freeze_the_process_made_itself_is_kept():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_garbage_from_before_the_capture_is_collected_first():
    class Cycle:
        pass

    enabled = gc.isenabled()
    gc.disable()  # only the explicit collection may free the cycle
    try:
        cycle = Cycle()
        cycle.me = cycle
        alive = weakref.ref(cycle)
        del cycle
        with gc_frozen():
            assert alive() is None, "a garbage cycle was frozen with the live objects"
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def cpu_cuda_backend(monkeypatch) -> cuda.CUDABackend:
    """The CUDA backend without a GPU: a stand-in stream and pool, so its capture calls run on the host."""
    monkeypatch.setattr(cuda, "side_stream", lambda index: None)
    backend = cuda.CUDABackend(torch.device("cuda", 0))
    backend._pool = object()
    return backend


def test_the_cuda_backend_captures_regions_with_the_collector_frozen(cpu_cuda_backend):
    seen: list[int] = []

    def capture(calls, *, pool, stream, warmup_iters):
        seen.append(gc.get_freeze_count())
        return CapturePassResult()

    cpu_cuda_backend.capture_regions([], 0, capture)
    assert seen[0] > 0 and gc.get_freeze_count() == 0

    def failing(calls, *, pool, stream, warmup_iters):
        raise RuntimeError("TE capture broke")

    with pytest.raises(RuntimeError, match="TE capture broke"):
        cpu_cuda_backend.capture_regions([], 0, failing)
    assert gc.get_freeze_count() == 0

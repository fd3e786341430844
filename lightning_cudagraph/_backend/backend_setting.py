"""``capture_backend`` on the callback and the strategies: ``None``, or a backend instance for its device, checked."""

from __future__ import annotations

from typing import Any

import torch

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.cuda import CUDABackend
from lightning_cudagraph._options.errors import Verbatim, config_error

__all__ = ["HoldsCaptureBackend", "checked_capture_backend"]


class HoldsCaptureBackend:
    """The ``capture_backend`` attribute of the callback and the strategies, checked when it is set."""

    _capture_backend: CaptureBackend | None = None

    @property
    def capture_backend(self) -> CaptureBackend | None:
        """The capture backend for the next fit; ``None`` uses CUDA on a CUDA device (and graphs off elsewhere).

        A test double or another accelerator's :class:`~lightning_cudagraph._backend.backend.CaptureBackend` instance
        can be set here. A strategy hands its backend to the callback it attaches.
        """
        return self._capture_backend

    @capture_backend.setter
    def capture_backend(self, backend: CaptureBackend | None) -> None:
        self._capture_backend = checked_capture_backend(type(self).__name__, backend)


def checked_capture_backend(component: str, backend: Any) -> CaptureBackend | None:
    """``capture_backend`` as set on the callback or a strategy: ``None`` or a backend instance for its device."""
    off_cuda = isinstance(backend, CUDABackend) and torch.device(backend.device).type != "cuda"
    if backend is None or (isinstance(backend, CaptureBackend) and not off_cuda):
        return backend
    allowed = "None (CUDA on a CUDA device, graphs off elsewhere) or a CaptureBackend instance"
    if isinstance(backend, type) and issubclass(backend, CaptureBackend):
        fix = f"pass an instance, not the class: capture_backend = {backend.__name__}(...)"
    elif isinstance(backend, CaptureBackend):
        fix = (
            "CUDABackend captures on a CUDA device: build it with CUDABackend(torch.device('cuda', 0)), or leave"
            " capture_backend=None (the package builds it for the Trainer's device)"
        )
    else:
        fix = (
            "leave it None (the package picks CUDA on a CUDA device), or set an instance of a"
            " lightning_cudagraph._backend.backend.CaptureBackend subclass"
        )
    if isinstance(backend, CaptureBackend):
        shown: Any = Verbatim(f"{type(backend).__name__}(device={backend.device!r})")
    else:
        shown = backend if isinstance(backend, (str, type)) else Verbatim(repr(backend))
    raise config_error(component, "capture_backend", shown, allowed, fix)

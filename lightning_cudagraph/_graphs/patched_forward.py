"""A callable set as a module's ``forward`` on the instance, which gives back what was there: the one forward patcher.

Training regions (:class:`~lightning_cudagraph._graphs.routing.TargetForward`) and evaluation regions
(:class:`~lightning_cudagraph._graphs.eval_regions.RegionForward`) both build on it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PatchedForward"]


class PatchedForward:
    """Set as ``module.forward`` by :meth:`install`; :meth:`restore` puts back the forward the instance had.

    A forward set on the instance before (by the user or a library) is put back; otherwise the instance attribute is
    removed, so the class's ``forward`` is found again.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        #: What the module ran before: its class's forward, or one set on the instance.
        self.run: Any = module.forward
        self._had = "forward" in module.__dict__
        self._previous = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run what the module ran before (a subclass routes the call instead)."""
        return self.run(*args, **kwargs)

    def install(self) -> None:
        """Route the module's calls through this object."""
        self.module.forward = self

    def restore(self) -> None:
        """Give the module back the forward it had before :meth:`install`."""
        if self._had:
            self.module.__dict__["forward"] = self._previous
        else:
            self.module.__dict__.pop("forward", None)

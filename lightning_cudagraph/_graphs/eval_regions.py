"""Forward-only graphs of the trained level's regions, for evaluation loops run through the callback alone.

A scoped level's training graphs pair each forward with its backward and cannot replay under ``torch.no_grad()`` or
inference mode, so during an evaluation loop each region gets forward graphs of its own, one per call signature.
Its ``forward`` is wrapped for the loop only, on top of the training driver's. The step's Python (``self.log``,
metrics) stays eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._backend.backend import StepGraph
from lightning_cudagraph._backend.signature import CallSignature, call_signature, distinct_tensors, rebuild_call
from lightning_cudagraph._graphs.eval_capture import EvalGraphs
from lightning_cudagraph._graphs.patched_forward import PatchedForward

__all__ = ["EvalRegionGraphs", "RegionForward"]


@dataclass(eq=False)
class _RegionGraph:
    """One region's forward for one call signature: static inputs, graph, static outputs."""

    signature: CallSignature
    inputs: list[Tensor]
    graph: StepGraph | None = None
    output: Any = None
    leaves: list[Any] | None = None
    spec: Any = None

    def reset(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.output, self.leaves, self.inputs = None, None, None, []


class RegionForward(PatchedForward):
    """Installed as a region module's ``forward`` for one evaluation loop; hands each call to the owner.

    What it runs eagerly (:attr:`run`) is what the module ran before: the training driver's forward, or its own.
    """

    def __init__(self, name: str, module: torch.nn.Module, owner: EvalRegionGraphs) -> None:
        super().__init__(module)
        self.name, self._owner = name, owner
        #: Graphs by positional key (plain positional calls), and by full signature for the rest.
        self.by_key: dict[Any, _RegionGraph] = {}
        #: Graphs captured for this region (call signatures), at most the owner's ``limit``.
        self.captured = 0
        self.install()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the region's evaluation graph, or run the call eagerly."""
        return self._owner.call(self, args, kwargs)


class EvalRegionGraphs(EvalGraphs[_RegionGraph]):
    """Forward-only graphs of some regions during evaluation loops, in the backend's pool (``limit`` per region)."""

    #: Every region holds up to ``limit`` signatures; the cache itself never evicts a region for another one.
    cache_bounded = False
    _forwards: tuple[RegionForward, ...] = ()

    def install(self, regions: Sequence[tuple[str, torch.nn.Module]]) -> None:
        """Wrap the regions' forwards for this loop (idempotent)."""
        if not self._forwards:
            self._forwards = tuple(RegionForward(name, module, self) for name, module in regions)

    def restore(self) -> None:
        """Give every region its forward back, innermost wrap last (idempotent); the graphs stay for the next loop."""
        forwards, self._forwards = self._forwards, ()
        for forward in reversed(forwards):
            forward.restore()

    @property
    def installed(self) -> bool:
        """Whether the regions' forwards are wrapped now."""
        return bool(self._forwards)

    def call(self, forward: RegionForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One region call: replay its graph, or run it eagerly (and capture on the signature's second call)."""
        fast = _fast_key(args, kwargs, forward.module)
        entry = forward.by_key.get(fast) if fast is not None else None
        if entry is not None and entry.graph is not None:
            return self._replay(entry, args, kwargs)
        signature = call_signature(forward.module, args, kwargs)
        key = (forward.name, signature)
        decision = self.decide(key, room=forward.captured < self.limit)
        if isinstance(decision, _RegionGraph):
            return self._replay(decision, args, kwargs)
        if not decision:
            return forward.run(*args, **kwargs)
        reference = forward.run(*args, **kwargs)  # the real call, eager
        entry = _RegionGraph(signature, [t.detach().clone() for t in distinct_tensors(signature, args, kwargs)])
        static_args, static_kwargs = rebuild_call(signature, entry.inputs)

        def body() -> None:
            entry.output = forward.run(*static_args, **static_kwargs)

        checked = (_tensor_leaves(reference), lambda: _tensor_leaves(entry.output))
        failure = self.capture(key, entry, body, [forward.module], entry.inputs, checked, forward.name)
        if failure is not None:
            self.fail(*failure)
            return reference
        entry.leaves, entry.spec = pytree.tree_flatten(entry.output)
        if fast is not None:
            forward.by_key[fast] = entry
        forward.captured += 1
        rank_zero_info(f"{self.component}: captured the forward of {forward.name} for evaluation")
        return reference

    def _replay(self, entry: _RegionGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for buffer, value in zip(entry.inputs, distinct_tensors(entry.signature, args, kwargs), strict=True):
            if buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        assert entry.graph is not None, "a cached region graph always holds its graph"
        entry.graph.replay()
        self.record.replays += 1
        tensors = iter(t.clone() for t in _tensor_leaves(entry.output))  # the next replay rewrites the outputs
        leaves = [next(tensors) if isinstance(leaf, Tensor) else leaf for leaf in entry.leaves or ()]
        return pytree.tree_unflatten(leaves, entry.spec)

    def release(self) -> None:
        """Give the forwards back and free every graph (idempotent)."""
        self.restore()
        super().release()


def _fast_key(args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module) -> Any:
    """A cheap key for a plain positional call of distinct tensors (``None`` for other calls)."""
    if kwargs or not args or not all(isinstance(a, Tensor) for a in args):
        return None
    if len({a.data_ptr() for a in args}) != len(args):
        return None
    enabled = torch.is_autocast_enabled("cuda")
    state = (module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), enabled)
    return (state, tuple((a.shape, a.dtype, a.requires_grad) for a in args))


def _tensor_leaves(value: Any) -> list[Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Tensor)]

"""Scoped capture with Transformer Engine's ``make_graphed_callables``: FP8-aware graphs of TE modules.

TE's capture handles what PyTorch's cannot for FP8 layers (FP8 autocast, amax and scaling state, its graph-safe RNG
tracker) and clones parameter gradients on return. A region here only wraps the forward TE builds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._backend.backend import CapturePassResult, RecordedCall
from lightning_cudagraph._backend.local import autocast_of, tensor_addresses
from lightning_cudagraph._backend.signature import CallSignature, rebuild_call


@dataclass(eq=False)
class TERegion:
    """A target captured by Transformer Engine: its graphed forward and TE's ``reset``."""

    name: str
    module: torch.nn.Module
    signature: CallSignature
    forward: Any
    reset_graphs: Any
    addresses: dict[str, int] = field(default_factory=dict)
    on_backward: Any = None  # TE's autograd function is its own: no backward-order record
    weight_cache: FP8WeightCache | None = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Replay through TE's graphed forward."""
        return self.forward(*args, **self._with_microbatch(kwargs))

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """Replay the forward graph outside autograd and return copies of its tensor outputs."""
        with torch.no_grad():
            outputs = self.forward(*args, **self._with_microbatch(kwargs))
        return [leaf.clone() for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, Tensor)]

    def _with_microbatch(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        # TE's graphed callable requires the flag on every call once weight caching is on.
        if self.weight_cache is None:
            return kwargs
        return {**kwargs, "is_first_microbatch": self.weight_cache.first_microbatch}

    def detach_accumulated_grads(self) -> None:
        """Nothing to do: TE clones parameter gradients on return."""

    def reset(self) -> None:
        """Free the graphs through TE's own ``reset``."""
        if self.reset_graphs is not None:
            self.reset_graphs()
        self.reset_graphs = self.forward = None


class FP8WeightCache:
    """Says, per micro-batch, whether TE's graphs may reuse the FP8 weights quantized earlier in the window.

    Weights change only at the optimizer step, so FP8 copies made on the first micro-batch of a window hold for the
    rest of it (TE's ``cache_quantized_params``). They are trusted only when every region replayed on an earlier
    micro-batch since the last optimizer step. The flag is a device tensor TE's graphs read (no host sync).

    Args:
        set_skip_flag: Writes TE's "skip the FP8 weight update" flag; TE's ``FP8GlobalStateManager`` by default.
    """

    def __init__(self, set_skip_flag: Callable[[bool], None] | None = None) -> None:
        self.first_microbatch = True
        self._set_skip_flag = set_skip_flag or _set_te_skip_flag
        self._quantized_at: dict[Any, int] = {}
        self._current: tuple[Any, int] | None = None

    def begin_microbatch(self, graph_key: Any, optimizer_steps: int) -> None:
        """Before a micro-batch that replays the graphs captured for ``graph_key``."""
        self.first_microbatch = self._quantized_at.get(graph_key) != optimizer_steps
        self._current = (graph_key, optimizer_steps)
        self._set_skip_flag(not self.first_microbatch)

    def end_microbatch(self, every_region_replayed: bool) -> None:
        """After the micro-batch: its replays quantized the weights of this optimizer step unless one fell back."""
        if self._current is None:
            return
        graph_key, optimizer_steps = self._current
        if every_region_replayed:
            self._quantized_at[graph_key] = optimizer_steps
        else:
            self._quantized_at.pop(graph_key, None)
        self._current = None
        self.first_microbatch = True


def _set_te_skip_flag(skip: bool) -> None:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip)


def capture_te_regions(
    calls: Sequence[RecordedCall],
    *,
    pool: Any,
    stream: torch.cuda.Stream,
    warmup_iters: int,
    fp8_recipe: Any | None,
    weight_cache: FP8WeightCache | None = None,
) -> CapturePassResult:
    """Capture the calls with ``transformer_engine.pytorch.make_graphed_callables`` into one pool on ``stream``.

    TE captures every call in one pass, so a failing call fails the pass (it raises). Arguments must be tensors.
    ``weight_cache`` (FP8 with gradient accumulation) captures with ``cache_quantized_params``.
    """
    import transformer_engine.pytorch as te

    samples = [_sample_call(call) for call in calls]
    modules = tuple(call.module for call in calls)
    guards = [module.__dict__.pop("forward", None) for module in modules]  # TE wraps the original forward
    try:
        with _captured_on(stream), _tracker_generators_restored_on_error(), autocast_of(calls[0].signature):
            te.make_graphed_callables(
                modules,
                tuple(args for args, _ in samples),
                num_warmup_iters=warmup_iters,
                allow_unused_input=True,
                sample_kwargs=tuple(kwargs for _, kwargs in samples),
                enabled=fp8_recipe is not None,
                recipe=fp8_recipe,
                cache_quantized_params=weight_cache is not None,
                pool=pool,
            )
        regions = []
        for call, module in zip(calls, modules, strict=True):
            forward = module.__dict__.pop("forward")
            reset = module.__dict__.pop("reset", None)
            module.__dict__.pop("backward_dw", None)
            addresses = tensor_addresses(module)
            regions.append(
                TERegion(call.name, module, call.signature, forward, reset, addresses, weight_cache=weight_cache)
            )
        return CapturePassResult(list(regions))  # a list of the base class, for the backend's type
    finally:
        for module, guard in zip(modules, guards, strict=True):
            for attribute in ("forward", "reset", "backward_dw"):
                module.__dict__.pop(attribute, None)
            if guard is not None:
                module.forward = guard


def _sample_call(call: RecordedCall) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    args, kwargs = rebuild_call(call.signature, call.samples)
    constants = [name for name, value in kwargs.items() if not isinstance(value, Tensor)]
    if constants or not all(isinstance(a, Tensor) for a in args):
        raise RuntimeError(
            f"impl='transformer_engine' graphs calls whose arguments are tensors; {call.name} is called with"
            f" constant arguments {constants or '(positional)'}. Fix: pass them as module attributes, or use"
            " impl='local'."
        )
    return tuple(args), kwargs


@contextlib.contextmanager
def _captured_on(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make ``torch.cuda.graph`` (which TE calls without a stream) capture on the stream training runs on."""
    previous = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = stream
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.graph.default_capture_stream = previous


@contextlib.contextmanager
def _tracker_generators_restored_on_error() -> Iterator[None]:
    """On a failed capture, give the generators of TE's RNG tracker back their pre-capture state.

    A generator left in capture mode fails at the next eager dropout. TE restores them itself after a successful
    capture; the backend's failure guard covers the default generator.
    """
    from transformer_engine.pytorch.distributed import get_all_rng_states, graph_safe_rng_available

    generators = list(get_all_rng_states().values()) if graph_safe_rng_available() else []
    snapshots = [generator.clone_state() for generator in generators]
    try:
        yield
    except BaseException:
        for generator, snapshot in zip(generators, snapshots, strict=True):
            generator.graphsafe_set_state(snapshot)
        raise


def fp8_recipe_of(precision_plugin: Any) -> Any | None:
    """The FP8 recipe of Lightning's ``TransformerEnginePrecision``, or ``None`` when the Trainer does not use FP8."""
    from lightning.pytorch.plugins.precision import TransformerEnginePrecision

    if not isinstance(precision_plugin, TransformerEnginePrecision):
        return None
    recipe = getattr(precision_plugin, "recipe", None)
    if recipe is None:
        from transformer_engine.common.recipe import DelayedScaling

        recipe = DelayedScaling()
    return recipe

"""Scoped capture with PyTorch's own graphs: one forward and one backward ``torch.cuda.CUDAGraph`` per region.

This follows ``torch.cuda.make_graphed_callables`` (warm up, forwards in execution order, backwards in reverse, one
pool), plus: capture on the eager steps' stream (autograd never syncs a stale stream), keyword, constant and
repeated-tensor arguments through the call's signature, every graph kept for ``reset()``, and parameter gradients
handed to autograd as the graph's buffers (no copy per step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from lightning_cudagraph._backend import capture
from lightning_cudagraph._backend.backend import CapturePassResult, RecordedCall
from lightning_cudagraph._backend.capture import graph_capture
from lightning_cudagraph._backend.signature import CallSignature, distinct_tensors, rebuild_call


@dataclass(eq=False)
class GraphedRegion:
    """A captured region: replay its forward graph in a forward pass and its backward graph in the backward pass."""

    name: str
    module: torch.nn.Module
    signature: CallSignature
    params: tuple[Tensor, ...]
    static_inputs: tuple[Tensor, ...]
    static_outputs: tuple[Tensor, ...]
    output_leaves: list[Any]
    output_spec: pytree.TreeSpec
    output_positions: tuple[int, ...]
    differentiable: tuple[bool, ...]
    static_grad_outputs: tuple[Tensor | None, ...] = ()
    static_grad_inputs: tuple[Tensor | None, ...] = ()
    fwd_graph: torch.cuda.CUDAGraph | None = None
    bwd_graph: torch.cuda.CUDAGraph | None = None
    on_backward: Callable[[GraphedRegion], None] | None = None
    addresses: dict[str, int] = field(default_factory=dict)
    returns_one_tensor: bool = False
    #: Set under gradient accumulation: the backward hands autograd copies of the parameter gradients.
    copy_param_grads: bool = False

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Replay the region for a call whose signature matched, rebuilding the module's output structure."""
        # Per-call host time is what a scoped graph saves, so the common ``module(x)`` -> tensor call skips pytree.
        positional = self.signature.positional_key is not None and not kwargs
        inputs = args if positional else distinct_tensors(self.signature, args, kwargs)
        outputs = _GraphedCall.apply(self, *inputs, *self.params)
        return outputs[0] if self.returns_one_tensor else self._rebuild_output(outputs)

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """Replay only the forward graph, outside autograd, and return copies of its tensor outputs."""
        with torch.no_grad():
            self._copy_inputs(distinct_tensors(self.signature, args, kwargs))
            assert self.fwd_graph is not None, "a region is replayed only while it holds its graphs"
            self.fwd_graph.replay()
            return [out.clone() for out in self.static_outputs]

    def detach_accumulated_grads(self) -> None:
        """With gradient accumulation: hand autograd copies of the parameter gradients from now on.

        Autograd adopts a returned gradient as ``param.grad``, and the next backward replay would rewrite it. A copy per
        micro-batch never is (tracking which buffer was adopted missed cases on Hugging Face layers).
        """
        self.copy_param_grads = True
        for param, buffer in zip(self.params, self.static_grad_inputs[len(self.static_inputs) :], strict=True):
            grad = param.grad
            if grad is not None and buffer is not None and grad.data_ptr() == buffer.data_ptr():
                param.grad = grad.clone()

    def reset(self) -> None:
        """Free both graphs and every static buffer of the region."""
        for graph in (self.fwd_graph, self.bwd_graph):
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = None
        self.static_inputs = self.static_outputs = self.static_grad_outputs = self.static_grad_inputs = ()
        self.params = ()
        self.output_leaves = []

    def _copy_inputs(self, inputs: Sequence[Tensor]) -> None:
        for static, live in zip(self.static_inputs, inputs, strict=True):
            if static.data_ptr() != live.data_ptr():
                static.copy_(live)

    def _rebuild_output(self, outputs: Sequence[Tensor]) -> Any:
        leaves = list(self.output_leaves)
        for position, tensor in zip(self.output_positions, outputs, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.output_spec)


class _GraphedCall(torch.autograd.Function):
    """Autograd's view of a region: inputs and trainable parameters in, the forward graph's outputs out."""

    @staticmethod
    def forward(ctx: Any, region: GraphedRegion, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.region = region
        region._copy_inputs(inputs[: len(region.static_inputs)])
        assert region.fwd_graph is not None, "a region is replayed only while it holds its graphs"
        region.fwd_graph.replay()
        outputs = tuple(out.detach() for out in region.static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, region.differentiable, strict=True) if not d))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        region: GraphedRegion = ctx.region
        if region.on_backward is not None:
            region.on_backward(region)
        for static, grad in zip(region.static_grad_outputs, grads, strict=True):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        if region.bwd_graph is not None:
            region.bwd_graph.replay()
        inputs = len(region.static_inputs)
        grads_in = [None if g is None else g.detach() for g in region.static_grad_inputs]
        if region.copy_param_grads:
            # Autograd keeps what it is handed as ``param.grad``, and the next replay rewrites the buffers: hand it
            # copies. One fused multiply by 1 (exact) copies them all, where a ``clone()`` each costs host time.
            params = [g for g in grads_in[inputs:] if g is not None]
            copies = iter(torch._foreach_mul(params, 1.0) if params else ())
            grads_in[inputs:] = [None if g is None else next(copies) for g in grads_in[inputs:]]
        return (None, *grads_in)


def capture_regions(
    calls: Sequence[RecordedCall],
    *,
    pool: Any,
    stream: torch.cuda.Stream,
    warmup_iters: int = 3,
) -> CapturePassResult:
    """Capture the given calls, in their execution order, into one memory pool on ``stream``.

    A call whose warmup or capture raises ends the pass: the graphs captured so far are reset and the call is
    reported in ``failed``. The caching allocator cannot capture into the pool after a failed capture, so the caller
    uses a new one. The caller restores what warmup and capture disturb (RNG state, module buffers).
    """
    regions: list[GraphedRegion] = []
    name = ""
    warmed = False
    try:
        with torch.cuda.stream(stream), torch.enable_grad():
            functions = {call.name: _functional(call) for call in calls}
            surfaces = {call.name: _input_surface(call) for call in calls}
            for call in calls:
                name = call.name
                with autocast_of(call.signature):
                    for _ in range(warmup_iters):
                        outputs, _ = functions[name](*call.samples)
                        _grads_of(outputs, surfaces[name], None)
            if capture._PREVIOUS_CAPTURE:  # the capture runs on the warmups' stream, after them: no wait is needed
                torch.cuda.current_stream().synchronize()
            warmed = True
            for call in calls:
                name = call.name
                regions.append(_capture_forward(call, functions[name], surfaces[name], pool))
            for region in reversed(regions):
                name = region.name
                _capture_backward(region, surfaces[name], pool)
    except BaseException as error:
        for region in regions:
            region.reset()
        if not isinstance(error, Exception):  # an interrupt propagates
            raise
        return CapturePassResult(failed={name: error}, warmed=warmed)  # one call cannot be captured: say which
    return CapturePassResult(list(regions))  # a list of the base class, for the backend's type


def _functional(call: RecordedCall) -> Callable[..., tuple[tuple[Tensor, ...], tuple[Any, pytree.TreeSpec]]]:
    """Wrap a call as ``fn(*distinct_tensors) -> (tensor outputs, (all output leaves, spec))``."""

    def run(*tensors: Tensor) -> tuple[tuple[Tensor, ...], tuple[Any, pytree.TreeSpec]]:
        args, kwargs = rebuild_call(call.signature, tensors)
        leaves, spec = pytree.tree_flatten(call.forward(*args, **kwargs))
        return tuple(leaf for leaf in leaves if isinstance(leaf, Tensor)), (leaves, spec)

    return run


def _input_surface(call: RecordedCall) -> tuple[Tensor, ...]:
    params = tuple(p for p in call.module.parameters() if p.requires_grad)
    return (*call.samples, *params)


def _grads_of(
    outputs: Sequence[Tensor], surface: Sequence[Tensor], grad_outputs: Sequence[Tensor] | None
) -> tuple[Tensor | None, ...] | None:
    needing = [o for o in outputs if o.requires_grad]
    inputs = [t for t in surface if t.requires_grad]
    if not needing or not inputs:
        return None
    if grad_outputs is None:
        grad_outputs = [torch.zeros_like(o) for o in needing]
    return torch.autograd.grad(needing, inputs, grad_outputs=list(grad_outputs), allow_unused=True)


def _capture_forward(
    call: RecordedCall, fn: Callable[..., Any], surface: tuple[Tensor, ...], pool: Any
) -> GraphedRegion:
    graph = torch.cuda.CUDAGraph()
    with autocast_of(call.signature), graph_capture(graph, pool):
        outputs, (leaves, spec) = fn(*call.samples)
    positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor))
    template = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    return GraphedRegion(
        name=call.name,
        module=call.module,
        signature=call.signature,
        params=surface[len(call.samples) :],
        static_inputs=tuple(call.samples),
        static_outputs=outputs,
        output_leaves=template,
        output_spec=spec,
        output_positions=positions,
        differentiable=tuple(o.requires_grad for o in outputs),
        fwd_graph=graph,
        addresses=tensor_addresses(call.module),
        returns_one_tensor=spec.is_leaf() and positions == (0,),
    )


def _capture_backward(region: GraphedRegion, surface: tuple[Tensor, ...], pool: Any) -> None:
    grad_outputs = tuple(
        torch.empty_like(o) if d else None for o, d in zip(region.static_outputs, region.differentiable, strict=True)
    )
    region.static_grad_outputs = grad_outputs
    region.static_grad_inputs = tuple(None for _ in surface)
    if not any(region.differentiable) or not any(t.requires_grad for t in surface):
        region.static_outputs = tuple(o.detach() for o in region.static_outputs)
        return  # nothing flows back through this region: no backward graph
    graph = torch.cuda.CUDAGraph()
    with autocast_of(region.signature), graph_capture(graph, pool):
        grads = _grads_of(region.static_outputs, surface, [g for g in grad_outputs if g is not None])
    grads_iter = iter(grads or ())  # no output needing a gradient: no gradient flows back to any input
    region.static_grad_inputs = tuple(next(grads_iter, None) if t.requires_grad else None for t in surface)
    region.bwd_graph = graph
    region.static_outputs = tuple(o.detach() for o in region.static_outputs)  # drop the capture's autograd graph


def tensor_addresses(module: torch.nn.Module) -> dict[str, int]:
    """Data pointers of a module's parameters and buffers, by qualified name (what its graphs read)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor.data_ptr() for name, tensor in named}


def moved_since(then: dict[str, int], now: dict[str, int]) -> list[str]:
    """The one check that tensors a graph reads moved: names whose storage differs from ``then``, or that came or went.

    ``then`` and ``now`` map names to data pointers (:func:`tensor_addresses`, or a watch's own tensors).
    """
    changed = [name for name, address in now.items() if then.get(name) != address]
    return changed + [name for name in then if name not in now]


def autocast_of(signature: CallSignature) -> Any:
    """The autocast context a call ran under (cache off, as capture requires)."""
    enabled, dtype = signature.autocast
    if not enabled:
        return nullcontext()
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False)

"""A capture backend for CPU tests, as strict as CUDA graphs about what a replay sees.

It implements the package's seam (:class:`lightning_cudagraph._backend.backend.CaptureBackend`), so on a CPU the whole
lifecycle runs for real: warmup recording, the capture decision, patched forwards, confirmation, replay counting,
fallbacks, rollback and release. Where CUDA would replay recorded kernels, the fake replays what it recorded:

- A whole step (:class:`FakeStepGraph`) records every tensor operation of the step at capture (forward, backward,
  optimizer), then undoes the capture's writes to tensors that existed before it (a CUDA capture runs nothing).
  Each replay runs the recorded operations again on the same tensors, without the step's Python: the output and
  logged tensors of the capture are rewritten in place, Python numbers (a float ``lr``, ``betas``, ``momentum``)
  stay what they were at capture, and only tensors the step reads (a tensor ``lr``, the static batch) change it.
- A region (:class:`FakeRegion`) runs the module's original forward in the training mode it was captured in,
  fires no hooks of the modules inside it, and hands parameter gradients to autograd in its own static buffers, as
  a graph's backward does (with gradient accumulation they must be moved out before the next backward).
- Optimizers are switched to their capturable form for real (:class:`FakeOptimizer` wraps
  :class:`~lightning_cudagraph._backend.optimizers.CapturableOptimizer`).
- A host sync (``.item()``) inside a capture fails it, as it does on CUDA.

What it cannot stand in for (tests/FAKE_BACKEND.md): kernels, streams, memory pools and their reuse, CUDA's RNG
offsets, NCCL. Those claims are tested on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._C._distributed_c10d import Work
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lightning_cudagraph._backend.backend import (
    CaptureBackend,
    CaptureMethod,
    CapturePassResult,
    RecordedCall,
    StepGraph,
)
from lightning_cudagraph._backend.local import tensor_addresses
from lightning_cudagraph._backend.optimizers import CapturableOptimizer
from lightning_cudagraph._backend.signature import distinct_tensors, rebuild_call
from lightning_cudagraph._backend.timing import StepTimer
from lightning_cudagraph._options.hooks import hooks_stashed

#: Operations that read a device value back to the host: a CUDA capture fails on them.
HOST_SYNCS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"})


def host_sync_error(op: str, where: str) -> RuntimeError:
    """What a capture that syncs with the host raises (CUDA says "operation not permitted when stream is capturing")."""
    return RuntimeError(
        f"operation not permitted when stream is capturing: {op} (a host sync, e.g. .item()) inside {where}"
    )


class _NoHostSync(TorchDispatchMode):
    """Raises on a host sync; every other operation runs as usual."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # else dynamo skips (and from then on never compiles) a compiled forward run under the mode

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func._schema.name in HOST_SYNCS:
            raise host_sync_error(func._schema.name, self.where)
        return func(*args, **(kwargs or {}))


# =================================================================== scoped regions
class FakeRegion:
    """A captured region: the original forward, run as captured; ``distort`` scales what a replay returns.

    Like :class:`~lightning_cudagraph._backend.local.GraphedRegion`: the modules inside run in the training mode they
    had at capture and fire no hooks; the output's non-tensor parts are the capture's; the trainable parameters are
    those of the capture, and their gradients come back in static buffers that autograd adopts as ``param.grad``
    when it is ``None`` (the next backward rewrites them: :meth:`detach_accumulated_grads` copies them out first).
    """

    def __init__(self, call: RecordedCall, distort: float = 1.0, output: Any = None) -> None:
        self.name, self.module, self.signature = call.name, call.module, call.signature
        self.addresses = tensor_addresses(call.module)
        self.on_backward: Callable[[Any], None] | None = None
        self.replays = 0
        self.live = True
        self._forward, self._distort = call.forward, distort
        self.params = tuple(p for p in call.module.parameters() if p.requires_grad)
        self.grad_buffers: list[Tensor | None] = [None] * len(self.params)
        self._modes = [(module, module.training) for module in call.module.modules()]
        self._leaves, self._spec = pytree.tree_flatten(output)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.replays += 1
        inputs = distinct_tensors(self.signature, args, kwargs)
        outputs = _FakeCall.apply(self, len(inputs), *inputs, *self.params)
        return self._rebuild(outputs)

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        # Under the grad mode the forward was captured in, as a replay is (a compiled forward would recompile for
        # another one); the result is detached, as a replay's is.
        self.replays += 1
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in distinct_tensors(self.signature, args, kwargs)]
        with self.as_captured():
            leaves = self._run(inputs)
        return [leaf.detach() for leaf in leaves]

    def detach_accumulated_grads(self) -> None:
        """Give parameters whose ``.grad`` is this region's gradient buffer a copy, before the buffer is rewritten."""
        for param, buffer in zip(self.params, self.grad_buffers, strict=True):
            grad = param.grad
            if grad is not None and buffer is not None and grad.data_ptr() == buffer.data_ptr():
                param.grad = grad.clone()

    def reset(self) -> None:
        self.live = False
        self.grad_buffers = [None] * len(self.params)

    @contextlib.contextmanager
    def as_captured(self) -> Iterator[None]:
        """The modules inside in their capture-time training mode, their own hooks stashed (a graph runs none)."""
        now = [(module, module.training) for module, _ in self._modes]
        for module, training in self._modes:
            module.training = training
        try:
            with hooks_stashed([self.module], include_roots=False):
                yield
        finally:
            for module, training in now:
                module.training = training

    def _run(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        args, kwargs = rebuild_call(self.signature, inputs)
        leaves = [leaf for leaf in pytree.tree_leaves(self._forward(*args, **kwargs)) if isinstance(leaf, Tensor)]
        return [leaf * self._distort for leaf in leaves] if self._distort != 1.0 else leaves

    def _rebuild(self, outputs: Sequence[Tensor]) -> Any:
        tensors = iter(outputs)
        leaves = [next(tensors) if isinstance(leaf, Tensor) else leaf for leaf in self._leaves]
        return pytree.tree_unflatten(leaves, self._spec)

    def _backward(self, outputs: list[Tensor], inputs: list[Tensor], grads: Sequence[Tensor | None]) -> tuple:
        if self.on_backward is not None:
            self.on_backward(self)
        needing = [
            (o, g if g is not None else torch.zeros_like(o))
            for o, g in zip(outputs, grads, strict=True)
            if o.requires_grad
        ]
        surface = [*inputs, *self.params]
        wrt = [t for t in surface if t.requires_grad]
        computed = iter(
            torch.autograd.grad([o for o, _ in needing], wrt, [g for _, g in needing], allow_unused=True)
            if needing and wrt
            else [None] * len(wrt)
        )
        result: list[Tensor | None] = [next(computed) if t.requires_grad else None for t in surface]
        for index, grad in enumerate(result[len(inputs) :]):
            if grad is None:
                continue
            buffer = self.grad_buffers[index]
            if buffer is None or buffer.shape != grad.shape:
                buffer = self.grad_buffers[index] = torch.empty_like(grad)
            buffer.copy_(grad)
            result[len(inputs) + index] = buffer.detach()  # autograd adopts it when .grad is None, as with a graph
        return tuple(result)


class _FakeCall(torch.autograd.Function):
    """Autograd's view of a fake region: inputs and captured trainable parameters in, the forward's tensors out."""

    @staticmethod
    def forward(ctx: Any, region: FakeRegion, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors[:count]]
        with torch.enable_grad(), region.as_captured():
            outputs = region._run(inputs)
        ctx.region, ctx.inputs, ctx.outputs = region, inputs, outputs
        results = tuple(out.detach() for out in outputs)
        ctx.mark_non_differentiable(*(r for r, o in zip(results, outputs, strict=True) if not o.requires_grad))
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.region._backward(ctx.outputs, ctx.inputs, grads))


# =================================================================== whole steps
@dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[Tensor | None]


@dataclass
class _Resize:
    """A storage resized inside the step (FSDP2 frees and re-allocates unsharded parameters): a replay does it too."""

    storage: torch.UntypedStorage
    size: int


def _storage_key(tensor: Tensor) -> int:
    return _key(tensor.untyped_storage())


def _key(storage: torch.UntypedStorage) -> int:
    return storage._cdata  # the storage itself, which a resize keeps (its data pointer moves)


def _tensors(value: Any) -> list[Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Tensor)]


class _StepRecorder(TorchDispatchMode):
    """Records a step's tensor operations; keeps what the step wrote into tensors made before it, to undo it."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code runs compiled under the recorder, which sees the operations it runs

    def __init__(self, host_sync_fails: bool) -> None:
        super().__init__()
        self.host_sync_fails = host_sync_fails
        self.ops: list[_Op | _Resize] = []
        self._made: set[int] = set()  # storages the step allocated
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._resize = torch.UntypedStorage.resize_
        self._wait = Work.wait

    def __enter__(self) -> _StepRecorder:
        recorder, resize, wait = self, self._resize, self._wait

        def recorded_resize(storage: torch.UntypedStorage, size: int) -> Any:
            with _disable_current_modes():  # the copy kept to undo the resize is not the step's work
                recorder._save(storage)
            recorder.ops.append(_Resize(storage, size))
            return resize(storage, size)

        def unrecorded_wait(work: Work, *args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():  # gloo finishes a collective with copies at wait: the collective's own
                return wait(work, *args, **kwargs)

        torch.UntypedStorage.resize_ = recorded_resize  # type: ignore[method-assign]
        Work.wait = unrecorded_wait  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        Work.wait = self._wait  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(t is not Tensor and not issubclass(t, torch.nn.Parameter) for t in types):
            # A tensor subclass (FSDP2's DTensor parameters): its own dispatch runs the operations on its local
            # tensors, which come back here, as a CUDA capture records the kernels on the local storage.
            return NotImplemented
        name = func._schema.name
        if name in HOST_SYNCS and self.host_sync_fails:
            raise host_sync_error(name, "the captured training step")
        if name.startswith("profiler::"):  # record_function markers: nothing a graph holds
            return func(*args, **kwargs)
        self._save_written(func, args, kwargs)
        inputs = {_storage_key(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        leaves = pytree.tree_leaves(out)
        self.ops.append(_Op(func, args, kwargs, [leaf if isinstance(leaf, Tensor) else None for leaf in leaves]))
        self._made.update(_storage_key(t) for t in _tensors(out) if _storage_key(t) not in inputs)
        return out

    def _save_written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name, args[position] if position < len(args) else None)
            for tensor in _tensors(value):
                self._save(tensor.untyped_storage())

    def _save(self, storage: torch.UntypedStorage) -> None:
        key = _key(storage)
        if key not in self._made and key not in self._saved:
            self._saved[key] = (storage, storage.clone())

    def undo_writes(self) -> None:
        """Put back every tensor the step wrote (or resized) that existed before it."""
        with torch.no_grad():
            for storage, saved in self._saved.values():
                if storage.size() != saved.size():
                    self._resize(storage, saved.size())
                storage.copy_(saved)
        self._saved = {}


class FakeStepGraph:
    """A whole step: capture records its tensor operations (and undoes them), each replay runs them again.

    A replay runs no Python of the step: the tensors the capture produced (its output, its logged values, the
    gradients) are rewritten in place, with the values the recorded operations compute from what they read now.
    """

    def __init__(self, body: Callable[[], None], host_sync_fails: bool = True) -> None:
        self.replays = 0
        recorder = _StepRecorder(host_sync_fails)
        rng = torch.get_rng_state()
        try:
            with recorder:
                body()
        finally:
            recorder.undo_writes()  # a CUDA capture runs nothing: the first replay does the capture step's work
            torch.set_rng_state(rng)
        self._ops: list[_Op | _Resize] | None = recorder.ops

    def replay(self) -> None:
        self.replays += 1
        with torch.no_grad():
            for op in self._ops:
                if isinstance(op, _Resize):
                    op.storage.resize_(op.size)
                    continue
                fresh = pytree.tree_leaves(op.func(*op.args, **op.kwargs))
                for captured, now in zip(op.outputs, fresh, strict=True):
                    if not isinstance(now, Tensor):
                        if callable(getattr(now, "wait", None)):  # a collective's work: done before what reads it
                            now.wait()
                        continue
                    if captured is None or now is captured:
                        continue
                    if captured.numel() and now.data_ptr() != captured.data_ptr():
                        captured.copy_(now)

    def reset(self) -> None:
        self._ops = None

    @property
    def live(self) -> bool:
        return self._ops is not None

    @property
    def operations(self) -> int:
        """How many tensor operations a replay runs."""
        return len(self._ops or ())


# =================================================================== optimizers, timing, the backend
class FakeOptimizer:
    """The optimizer switched to its capturable form for real (it runs on a CPU); records that it was given back."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer, self.restored = optimizer, False
        self.capturable = CapturableOptimizer(optimizer, device)

    def refresh(self) -> None:
        self.capturable.refresh()

    def plain_state_dict(self, state: dict[str, Any]) -> None:
        self.capturable.plain_state_dict(state)

    def restore(self) -> None:
        self.capturable.restore()
        self.restored = True


class FakeTimer(StepTimer):
    """Step times that the test decides: ``step_ms(backend)`` when a step ends, from what is captured then."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(use_cuda=False)
        self._backend, self._times = backend, []
        self._replays_at_start = 0

    def start(self) -> None:
        super().start()
        self._replays_at_start = self._backend.replays_so_far

    def stop(self) -> None:
        if self._open is not None:
            self._open = None
            # A step that replayed nothing ran eagerly, graphs alive or not (scope="auto"'s eager reference steps).
            self._backend.step_replayed = self._backend.replays_so_far != self._replays_at_start
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
        distort: Region name -> factor its replays are scaled by (a wrong graph; ``float("nan")`` for a graph that
            returns NaN).
        host_sync_fails: A host sync inside a capture fails it, as on CUDA.
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
    host_sync_fails: bool = True
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
    #: Whether the step a :class:`FakeTimer` timed last replayed any graph (set before ``step_ms`` is asked).
    step_replayed: bool = True

    @property
    def stream(self) -> None:
        return None

    def enter(self) -> None:
        self.entered = True

    def leave(self) -> None:
        self.entered = False

    def capture_regions(
        self, calls: Sequence[RecordedCall], warmup_iters: int, capture: CaptureMethod | None = None
    ) -> CapturePassResult:
        self.capturing = True
        self.warmup_iters_per_pass.append(warmup_iters)
        outputs = []
        try:
            if self.fail_capture is not None:
                raise self.fail_capture
            for call in calls:  # like a capture, run each call once (its hooks must have been stashed)
                error = self._region_failure(call.name)
                args, kwargs = rebuild_call(call.signature, call.samples)
                if error is None:
                    try:
                        with _NoHostSync(f"the captured region {call.name}"):
                            outputs.append(call.forward(*args, **kwargs))
                    except RuntimeError as sync:
                        if "operation not permitted when stream is capturing" not in str(sync):
                            raise
                        error = sync
                if error is not None:  # like the CUDA backend: the pass ends (after warmup), its pool is not used again
                    return CapturePassResult(failed={call.name: error}, warmed=True)
        finally:
            self.capturing = False
        regions = [
            FakeRegion(call, self.distort.get(call.name, 1.0), output)
            for call, output in zip(calls, outputs, strict=True)
        ]
        self.regions.extend(regions)
        return CapturePassResult(regions)

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
            graph = FakeStepGraph(body, self.host_sync_fails)
        finally:
            self.capturing = False
        self.step_graphs.append(graph)
        return graph

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> FakeOptimizer:
        prepared = FakeOptimizer(optimizer, self.device)
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
    def replays_so_far(self) -> int:
        """Replays of every region and step graph so far."""
        return sum(region.replays for region in self.regions) + sum(graph.replays for graph in self.step_graphs)

    @property
    def live_region_names(self) -> list[str]:
        """Names of the regions captured and not reset."""
        return [region.name for region in self.regions if region.live]

    @property
    def live_graphs(self) -> int:
        """Regions and steps captured and not reset."""
        return sum(region.live for region in self.regions) + sum(graph.live for graph in self.step_graphs)

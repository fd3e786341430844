"""The whole training step as one CUDA graph: ``training_step``, ``zero_grad``, backward, clipping, optimizer step.

The strategy hands this module three things at public override points: the batch (``batch_to_device``), the
output of ``training_step`` (``training_step``) and the step itself (``optimizer_step``). This module:

- keeps static batch buffers per input shape and copies each batch into them;
- makes the optimizer capturable (device-side step counts, learning rates as device tensors that schedulers
  update in place) and puts everything back on release;
- captures the step on the package's side stream, then replays it, rebuilding Lightning's closure result so
  ``global_step``, ``on_train_batch_end(outputs)``, checkpointing and early stopping behave as in eager training;
- records the ``self.log`` calls ``training_step`` makes while it is captured and re-issues them after every
  replay with the replayed values, so logged metrics stay true;
- counts non-finite losses inside the graph, read once per log interval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_cudagraph._lightning import logging_as
from lightning_cudagraph.graphs.pool import pool_memory_mib
from lightning_cudagraph.graphs.rng import generator_guard
from lightning_cudagraph.health import CUDAGraphReport

#: Optimizer classes whose capturable (or fused) step reads a tensor learning rate.
CAPTURABLE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass(eq=False)
class StepGraph:
    """One captured training step for one batch signature."""

    static_batch: Any
    graph: torch.cuda.CUDAGraph | None = None
    output: Any = None
    logs: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)

    def reset(self) -> None:
        """Free the graph and its static buffers."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.static_batch = self.output = None
        self.logs = []


class CapturableOptimizer:
    """An optimizer switched to its capturable form for the duration of the graphs.

    Learning rates become one-element device tensors, which every PyTorch LR scheduler updates in place
    (``fill_``), so schedules keep acting on the captured step. Adam and AdamW get ``capturable=True`` (their step
    counts move to the device), SGD gets ``fused=True``; an optimizer built with ``fused=True`` is left as it is.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self._saved = [
            {key: group.get(key) for key in ("lr", "capturable", "fused", "foreach")} for group in self.groups
        ]
        self._steps_on_cpu = False
        for group in self.groups:
            if "capturable" in group:
                group["capturable"] = True  # fused Adam checks the flag under capture as well
            elif not group.get("fused"):
                group["fused"], group["foreach"] = True, False
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, Tensor) and step.device != device:
                self._steps_on_cpu = True
                state["step"] = step.to(device)
        self.lrs = [group["lr"] for group in self.groups]

    @property
    def groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def refresh(self) -> None:
        """Take a learning rate that user code assigned as a number into the captured tensor (no host sync)."""
        for group, lr in zip(self.groups, self.lrs, strict=True):
            if group["lr"] is not lr:
                lr.fill_(group["lr"])
                group["lr"] = lr

    def plain_state_dict(self, state: dict[str, Any]) -> None:
        """Rewrite a saved ``optimizer.state_dict()`` into the form the user built, so checkpoints load anywhere."""
        for group, saved in zip(state["param_groups"], self._saved, strict=True):
            if isinstance(group.get("lr"), Tensor) and not isinstance(saved["lr"], Tensor):
                group["lr"] = group["lr"].item()
            for key in ("capturable", "fused", "foreach"):
                if key in group:
                    group[key] = saved[key]
        if self._user_keeps_steps_on_cpu:
            for index, entry in list(state["state"].items()):
                if isinstance(entry.get("step"), Tensor):
                    state["state"][index] = {**entry, "step": entry["step"].cpu()}  # a copy: the live state stays

    def restore(self) -> None:
        """Put learning rates back as numbers and the optimizer flags as they were."""
        for group, saved in zip(self.groups, self._saved, strict=True):
            if isinstance(group["lr"], Tensor) and not isinstance(saved["lr"], Tensor):
                group["lr"] = group["lr"].item()
            for key in ("capturable", "fused", "foreach"):
                if key in group:
                    group[key] = saved[key]
        if self._user_keeps_steps_on_cpu:  # else eager Adam would read a device step count on every step
            for state in self.optimizer.state.values():
                step = state.get("step")
                if isinstance(step, Tensor):
                    state["step"] = step.cpu()

    @property
    def _user_keeps_steps_on_cpu(self) -> bool:
        """Whether the optimizer as built keeps its step counts on the CPU (neither capturable nor fused)."""
        return self._steps_on_cpu or not any(saved["capturable"] or saved["fused"] for saved in self._saved)


def step_loss(output: Any) -> Tensor | None:
    """The loss of a ``training_step`` output (a tensor, or a dict with ``"loss"``), or ``None``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss if isinstance(loss, Tensor) else None


class NonFiniteFlags:
    """Device tensors the captured step writes: how many losses were not finite, and the first such step."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.current_step = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, loss: Tensor) -> None:
        """Record whether ``loss`` is finite (graph-safe: no host sync; captured into the step)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self.first_step.copy_(torch.where(bad & (self.first_step < 0), self.current_step, self.first_step))
        self.count.add_(bad.to(torch.int64))

    def read_and_clear(self) -> tuple[int, int]:
        """``(count, first step)`` since the last read; one host sync."""
        count, first = torch.stack([self.count, self.first_step]).tolist()
        if count:
            self.count.zero_()
            self.first_step.fill_(-1)
        return int(count), int(first)


class FullIterationGraphs:
    """Whole-step graphs, one per batch signature, sharing the manager's stream and pool."""

    def __init__(self, stream: torch.cuda.Stream, pool: Any, device: torch.device, report: CUDAGraphReport) -> None:
        self.stream, self.pool, self.device, self.report = stream, pool, device, report
        self.graphs: dict[tuple[Any, ...], StepGraph] = {}
        self.flags = NonFiniteFlags(device)
        self.optimizers: dict[int, CapturableOptimizer] = {}
        self._capturing: StepGraph | None = None

    def stage(self, key: tuple[Any, ...], batch: Any) -> Any:
        """Copy ``batch`` into the static buffers of the graph for ``key`` and return those buffers."""
        static = self.graphs[key].static_batch
        for buffer, value in zip(pytree.tree_leaves(static), pytree.tree_leaves(batch), strict=True):
            if isinstance(buffer, Tensor):
                buffer.copy_(value, non_blocking=True)
        return static

    def adopt(self, key: tuple[Any, ...], batch: Any) -> Any:
        """Make this (already on-device) batch the static buffers of a graph about to be captured for ``key``."""
        self.graphs[key] = StepGraph(static_batch=batch)
        return batch

    @property
    def capturing(self) -> bool:
        """Whether a step is being captured right now (``training_step`` runs once, into the graph)."""
        return self._capturing is not None

    def prepare_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Switch optimizers to their capturable form for the whole fit, so their arithmetic never changes mid-run."""
        for optimizer in optimizers:
            if id(optimizer) not in self.optimizers:
                self.optimizers[id(optimizer)] = CapturableOptimizer(optimizer, self.device)

    def capture(
        self,
        key: tuple[Any, ...],
        optimizer: torch.optim.Optimizer,
        run_step: Callable[[], Any],
        module: pl.LightningModule,
    ) -> None:
        """Capture ``run_step`` (Lightning's optimizer step with its closure) as the graph for ``key``."""
        step = self.graphs[key]
        self.prepare_optimizers([optimizer])
        graph = torch.cuda.CUDAGraph()
        started = time.perf_counter()
        self._capturing = step
        try:
            with (
                generator_guard(self.device),
                _logs_recorded(module, step.logs),
                torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"),
            ):
                run_step()
        except BaseException:
            with contextlib.suppress(RuntimeError):
                graph.reset()
            self.graphs.pop(key, None)
            raise
        finally:
            self._capturing = None
        step.graph = graph
        step.addresses = _state_addresses(module)
        self.report.captures += 1
        self.report.graphs = len(self.graphs)
        self.report.capture_ms = (time.perf_counter() - started) * 1e3
        self.report.pool_mib = pool_memory_mib(self.pool, self.device)

    def on_training_step_output(self, output: Any) -> None:
        """While capturing: keep ``training_step``'s output (static tensors) and add the non-finite check."""
        step = self._capturing
        if step is None:
            return
        step.output = output
        loss = step_loss(output)
        if loss is not None:
            self.flags.update(loss)

    def replay(self, key: tuple[Any, ...], global_step: int) -> Any:
        """Replay the step for ``key``; return a copy of ``training_step``'s output for this step."""
        step = self.graphs[key]
        for optimizer in self.optimizers.values():
            optimizer.refresh()
        self.flags.current_step.fill_(global_step)
        step.graph.replay()
        self.report.replays += 1
        return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, step.output)

    def relog(self, key: tuple[Any, ...], module: pl.LightningModule) -> None:
        """Re-issue the ``self.log`` calls of the captured ``training_step`` with this replay's values."""
        logs = self.graphs[key].logs
        if logs:
            with logging_as(module, "training_step"):
                for name, value, args, kwargs in logs:
                    module.log(name, value, *args, **kwargs)

    def addresses_moved(self, key: tuple[Any, ...], module: pl.LightningModule) -> bool:
        """Whether any parameter or buffer no longer lives where the graph reads it."""
        return _state_addresses(module) != self.graphs[key].addresses

    def plain_checkpoint(self, checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            capturable = self.optimizers.get(id(optimizer))
            if capturable is not None:
                capturable.plain_state_dict(state)

    def release(self) -> None:
        """Reset every graph and restore the optimizers (the optimizers even when a reset fails)."""
        try:
            for step in self.graphs.values():
                step.reset()
        finally:
            self.graphs.clear()
            self.report.graphs = 0
            optimizers, self.optimizers = list(self.optimizers.values()), {}
            for optimizer in optimizers:
                optimizer.restore()


@contextlib.contextmanager
def _logs_recorded(
    module: pl.LightningModule, logs: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]
) -> Iterator[None]:
    """Record ``module.log`` calls instead of running them (logging a number would copy to the GPU mid-capture)."""
    had_attribute = "log" in module.__dict__
    previous = module.__dict__.get("log")

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logs.append((name, value, args, kwargs))

    module.log = record
    try:
        yield
    finally:
        if had_attribute:
            module.log = previous
        else:
            del module.log


def _state_addresses(module: torch.nn.Module) -> list[int]:
    return [tensor.data_ptr() for tensor in (*module.parameters(), *module.buffers())]

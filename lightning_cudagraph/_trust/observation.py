"""What the Python of an eager step depends on, seen before a graph is trusted with it.

A graph replays kernels: whatever the Python that launched them decided per step is frozen at capture (a skipped batch,
a branch on ``batch_idx``, a draw from ``random``, a counter it increments). An :class:`Observer` watches spans of eager
Python (a whole step, or one call of a region) and returns a :class:`Behaviour` for each. Only eager spans are watched
(warmup steps, recorded calls, re-checks at epoch boundaries); a replayed step runs none of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_cudagraph._trust.fingerprints import describe_changes, object_state, python_state, random_states
from lightning_cudagraph._trust.reads import reads_watched

__all__ = ["SKIP_FIX", "Behaviour", "Observer", "frozen_by_a_graph"]

#: What a user can do about a step that skips its batch (``training_step`` returns ``None``).
SKIP_FIX = (
    "where skipping means leaving the batch out of the loss, mask it instead (multiply the loss by a 0/1 tensor);"
    " otherwise use a scoped level (strategy='cudagraph' or scope=['layer']), which runs training_step every step"
)
#: Operations kept in a trace at most (a long step is compared on its first ones).
_TRACE_LIMIT = 200_000


@dataclass
class Behaviour:
    """What one span of eager Python did that a graph would not do again.

    Attributes:
        reads: Per-step values read by user code (``self.global_step``, ``trainer.current_epoch``, ``batch_idx``)
            -> the line of the first read.
        random: The random generators the span drew from: the global ones (Python's, NumPy's) and those held on the
            watched modules, by attribute (``self.rng``, ``net.0.rng``).
        mutated: Module attributes the span changed, described (torchmetrics states aside).
        trace: The operations launched and their non-tensor arguments (``None`` when not traced).
        skipped: Whether the step returned no loss (a skipped batch).
    """

    reads: dict[str, str] = field(default_factory=dict)
    random: list[str] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)
    trace: tuple[tuple[Any, ...], ...] | None = None
    skipped: bool = False

    def depends(self) -> str | None:
        """What this span read or drew that a replay would freeze (or a skipped batch), or ``None``."""
        if self.skipped:
            return "skipped its batch (returned None)"
        if self.reads:
            return "; ".join(f"reads {name} ({where})" for name, where in self.reads.items())
        if self.random:
            return f"draws from {' and '.join(self.random)} (a replay draws nothing)"
        return None

    def changes(self) -> str | None:
        """The module attributes this span changed (a replay would not change them), or ``None``."""
        if self.mutated:
            return f"changes attributes a replay would not change: {', '.join(self.mutated[:3])}"
        return None

    def differs(self, other: Behaviour) -> str | None:
        """How ``other`` launched other operations or other Python numbers than this span, or ``None``."""
        if self.trace is None or other.trace is None or self.trace == other.trace:
            return None
        for index, (mine, theirs) in enumerate(zip(self.trace, other.trace, strict=False)):
            if mine != theirs:
                return f"operation {index} went from {_op(mine)} to {_op(theirs)}"
        return f"it launched {len(self.trace)} operations, then {len(other.trace)}"


def frozen_by_a_graph(spans: Sequence[Behaviour], setup: int = 1) -> str | None:
    """What spans of the same code (steps of one batch key, calls of one region) show that a graph would freeze.

    A read, a draw or a skip counts in any span. The first ``setup`` spans may set things up once (a lazy buffer,
    Lightning's first ``self.log``, DDP's bucket rebuild): attribute changes count after them, and operations are
    compared with the first span after them.

    Example:
        >>> spans = [Behaviour(trace=(("aten::mul", 1.0),)), Behaviour(trace=(("aten::mul", 1.0),))]
        >>> frozen_by_a_graph(spans) is None
        True
        >>> frozen_by_a_graph([*spans, Behaviour(trace=(("aten::mul", 0.1),))])
        'launched other operations than before: operation 0 went from aten::mul(1.0) to aten::mul(0.1)'
    """
    reference = spans[setup] if len(spans) > setup else None
    for index, seen in enumerate(spans):
        found = seen.depends()
        if found is None and index >= setup:
            change = reference.differs(seen) if reference is not None else None
            found = seen.changes() or (f"launched other operations than before: {change}" if change else None)
        if found is not None:
            return found
    return None


def _op(record: tuple[Any, ...]) -> str:
    name, *values = record
    return f"{name}({', '.join(map(repr, values))})"


class _Trace(TorchDispatchMode):
    """Records each operation's name and its non-tensor arguments (Python numbers are baked into a graph)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, ...]] = []
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = str(func)
        if not self.paused and len(self.ops) < _TRACE_LIMIT and not name.startswith("profiler."):
            leaves = pytree.tree_leaves((args, kwargs or {}))
            self.ops.append((name, *(leaf for leaf in leaves if _baked(leaf))))
        return func(*args, **(kwargs or {}))


def _baked(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) and not isinstance(value, torch.Tensor)


class Observer:
    """Watches eager spans of one fit; one span at a time per kind, nested spans share the trace.

    Args:
        trace: Record the operations of each span (off with ``compile=``: dynamo compiles what it sees run).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> observer = Observer(trace=True)
        >>> with observer.span([layer]) as seen:
        ...     _ = layer(torch.ones(1, 2)) * 0.5
        >>> seen.trace[-1]
        ('aten.mul.Tensor', 0.5)
    """

    def __init__(self, trace: bool = True) -> None:
        self.trace = trace
        self._mode: _Trace | None = None

    @contextlib.contextmanager
    def span(
        self,
        modules: Sequence[torch.nn.Module],
        reader: pl.LightningModule | None = None,
        paused: bool = False,
        others: Sequence[tuple[str, Any]] = (),
    ) -> Iterator[Behaviour]:
        """Watch what runs inside: reads through ``reader`` (and its Trainer), random draws, attributes of ``modules``.

        Random draws are from the global generators and from those held on ``modules`` and their submodules.
        ``others``: named objects whose plain attributes are watched too (the user's callbacks, whose hooks inside the
        optimizer step would run once, at capture).

        The yielded :class:`Behaviour` is filled in when the span ends. ``paused``: the trace starts at :meth:`resume`
        (what the optimizer runs before its closure is not the step's own).
        """
        seen = Behaviour()
        before, draws = {**python_state(modules), **object_state(others)}, random_states(modules)
        excused: set[str] = set()
        start, owns = self._enter_trace(paused)
        try:
            with reads_watched(reader, seen.reads), self._logs_untraced(reader, excused):
                yield seen
        finally:
            mode = self._mode
            if mode is not None:
                seen.trace = tuple(mode.ops[start:])
            if owns:
                self._leave_trace()
            seen.random = [name for name, state in random_states(modules).items() if draws.get(name) != state]
            now = {**python_state(modules), **object_state(others)}
            after = {name: value for name, value in now.items() if name not in excused}
            seen.mutated = describe_changes({k: v for k, v in before.items() if k not in excused}, after)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside out of the trace (the package's own bookkeeping inside a span)."""
        mode = self._mode
        if mode is None or mode.paused:
            yield
            return
        mode.paused = True
        try:
            yield
        finally:
            mode.paused = False

    @contextlib.contextmanager
    def _logs_untraced(self, module: pl.LightningModule | None, excused: set[str]) -> Iterator[None]:
        """``self.log`` left out of the trace, and the attributes it changes excused: replays re-issue its calls."""
        if module is None or "log" in vars(module):
            yield
            return
        log = module.log

        def untraced(*args: Any, **kwargs: Any) -> Any:
            before = python_state([module], deep=False)  # a log override changes its own module's attributes
            with self.paused():
                result = log(*args, **kwargs)
            after = python_state([module], deep=False)
            excused.update(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
            return result

        module.log = untraced  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log

    def pause(self) -> None:
        """Leave the rest of the current span out of the trace (``on_before_optimizer_step``)."""
        if self._mode is not None:
            self._mode.paused = True

    def resume(self) -> None:
        """Trace from here on (``training_step`` starts)."""
        if self._mode is not None:
            self._mode.paused = False

    def _enter_trace(self, paused: bool) -> tuple[int, bool]:
        if not self.trace:
            return 0, False
        if self._mode is not None:
            return len(self._mode.ops), False
        self._mode = _Trace()
        self._mode.paused = paused
        self._mode.__enter__()
        return 0, True

    def _leave_trace(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

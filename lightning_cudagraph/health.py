"""Replay health: counters, step timing without per-step host syncs, the report, and logging.

Counters are plain Python integers bumped on the host. Step times come from CUDA events recorded at batch start
and end and read once per log interval (one sync per interval, none per step). The metrics go through Lightning's
own ``log_dict`` once per interval, so they share the rows of the user's metrics and appear in
``trainer.logged_metrics``; the stage is shown by name in the progress bar.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

METRIC_PREFIX = "cudagraph/"
#: ``cudagraph/level``: each rung of ``scope="auto"`` 's ladder has a fixed number, so dashboards compare across
#: models (a rung a model lacks is skipped, not renumbered); 0 while no level runs on graphs.
LEVEL_NUMBERS = {"attn": 1, "attn+mlp": 2, "layer": 3, "full_iteration": 4}


@dataclass
class LevelRecord:
    """One rung of ``scope="auto"`` 's ladder, as tried: what it measured and what became of it.

    Attributes:
        level: ``attn``, ``attn+mlp``, ``layer`` or ``full_iteration``.
        status: ``kept`` (the level training settled on), ``slower`` (confirmed, not faster by the margin),
            ``failed`` (capture or confirmation failed; ``reason`` says why), ``skipped`` (not tried; ``reason``)
            ``trying`` (on it now) or ``planned`` (not reached yet).
        step_ms: Median step time measured on the level (``nan`` if not measured).
        capture_ms: Host time of the level's captures, warmup included.
        steps: Training steps spent on the level while the ladder was walked.
        reason: Why a level failed or was skipped.
    """

    level: str
    status: str = "planned"
    step_ms: float = math.nan
    capture_ms: float = 0.0
    steps: int = 0
    reason: str | None = None


class Stage(IntEnum):
    """Where the rollout is; logged as ``cudagraph/stage`` (its number), so a dashboard shows it rise to 2.

    Example:
        >>> from lightning_cudagraph import Stage
        >>> [(stage.name, int(stage)) for stage in Stage]
        [('DISABLED', -1), ('WARMUP', 0), ('CONFIRMING', 1), ('REPLAYING', 2)]
    """

    DISABLED = -1  #: rolled back, or never enabled (see the report's ``reason``)
    WARMUP = 0  #: eager steps that record input signatures and the eager step time
    CONFIRMING = 1  #: first replays, checked before they are trusted
    REPLAYING = 2  #: steady state

    @property
    def label(self) -> str:
        """The stage in a word, as the progress bar shows it.

        Example:
            >>> [stage.label for stage in Stage]
            ['off', 'warmup', 'confirming', 'replaying']
        """
        return "off" if self is Stage.DISABLED else self.name.lower()


@dataclass
class CUDAGraphReport:
    """Everything the rollout measured and decided, readable in code as ``callback.report``.

    Attributes:
        stage: The current :class:`Stage`.
        reason: Why graphs are off (``no_cuda``, ``impl_none``, ``no_targets``, ``shape_unstable: ...``,
            ``nonfinite_warmup``, ``rollback: ...``), or ``None``.
        scopes: Modules found per scope (before nested matches were folded into their enclosing region).
        graphs: Captured regions alive now (a forward/backward pair counts once; a whole step counts once).
        replays: Forward graph replays (a whole-step replay counts once).
        fallbacks: Calls (scoped) or steps (full_iteration) that ran eagerly while graphs were in use.
        fallback_reasons: ``fallbacks`` broken down by reason.
        rollbacks: Times the rollout gave graphs up and returned to eager.
        rollback_reasons: The reason of each rollback, in order.
        captures: Graph sets captured (one per input signature; a shape captured again after eviction counts again).
        evictions: Graph sets evicted from the per-shape cache (``max_graphs``) to make room for another shape.
        steps_replayed: Training steps since the first capture that ran on graphs.
        steps_eager: Training steps since the first capture that ran eagerly (a shape without graphs yet, a
            fallback, its own warmup).
        capture_ms: Host time of the last capture, warmup included.
        pool_mib: Memory held by the graphs' shared pool.
        step_ms: Median step time over the last log interval.
        eager_step_ms: Median eager step time during warmup (first step excluded).
        parity_err: Largest relative difference between a graphed forward and the eager forward on the same
            inputs, measured during confirmation; for the whole step, between the graph's and the eager step's
            loss and parameter update from the same state (shadow steps: confirmation and audits).
        audits: Shadow steps run: the graph checked against the eager step from the same state on a real batch.
        memory_before_capture: ``torch.cuda.memory_allocated()`` right before the first capture, in bytes.
        nonfinite: Non-finite losses seen, as ``(first step, count)`` per detection.
        level: The level graphs run at (``attn``, ``attn+mlp``, ``layer``, ``full_iteration``); with a fixed
            scope, ``None``. Logged as ``cudagraph/level``, the rung's number in :data:`LEVEL_NUMBERS`.
        ladder: The levels ``scope="auto"`` tried, in order, with their step times and outcomes.
        exclusions: Regions left eager, by qualified name, with the reason (a failed capture or parity check).
        capture_ms_total: Host time of every capture of the fit, summed (the ladder's captures included).
        compile_s: With ``compile=``: seconds torch.compile spent compiling in this fit (recompiles included).
        recompiles: With ``compile=``: compilations after the first capture (a guard failed on an eager path).

    Example:
        A fit on a CPU: graphs are off, the report says why, and training ran eagerly.

        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_cudagraph import CUDAGraphCallback
        >>> callback = CUDAGraphCallback(scope=["mlp"], modules={"mlp": "layer"})  # BoringModel's one Linear
        >>> trainer = pl.Trainer(
        ...     accelerator="cpu", max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
        ...     enable_progress_bar=False, enable_model_summary=False,
        ... )
        >>> trainer.fit(BoringModel())
        >>> report = callback.report
        >>> report.stage.name, report.reason, report.replays, report.graphs
        ('DISABLED', 'no_cuda', 0, 0)
    """

    stage: Stage = Stage.WARMUP
    reason: str | None = None
    scopes: dict[str, list[str]] = field(default_factory=dict)
    graphs: int = 0
    replays: int = 0
    fallbacks: int = 0
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    rollbacks: int = 0
    rollback_reasons: list[str] = field(default_factory=list)
    captures: int = 0
    evictions: int = 0
    steps_replayed: int = 0
    steps_eager: int = 0
    capture_ms: float = math.nan
    pool_mib: float = 0.0
    step_ms: float = math.nan
    eager_step_ms: float = math.nan
    parity_err: float = math.nan
    audits: int = 0
    memory_before_capture: int | None = None
    nonfinite: list[tuple[int, int]] = field(default_factory=list)
    level: str | None = None
    ladder: list[LevelRecord] = field(default_factory=list)
    exclusions: dict[str, str] = field(default_factory=dict)
    capture_ms_total: float = 0.0
    compile_s: float = math.nan
    recompiles: int = 0

    @property
    def speedup(self) -> float:
        """Eager step time over graphed step time (``nan`` until both are measured)."""
        if self.stage < Stage.CONFIRMING or not self.step_ms > 0:
            return math.nan
        return self.eager_step_ms / self.step_ms

    @property
    def hit_rate(self) -> float:
        """Share of the steps since the first capture that ran on graphs (``nan`` before)."""
        total = self.steps_replayed + self.steps_eager
        return self.steps_replayed / total if total else math.nan

    def summary(self) -> str:
        """One line: whether graphs are on (and if not, why) and the speedup measured.

        Example:
            >>> CUDAGraphReport(stage=Stage.DISABLED, reason="no_cuda").summary()
            'CUDA graphs off (no_cuda): trained eagerly'
            >>> CUDAGraphReport(stage=Stage.REPLAYING, eager_step_ms=3.0, step_ms=2.0, level="layer").summary()
            'CUDA graphs on (replaying, level layer): speedup 1.50x (eager 3.00 ms/step, graphed 2.00 ms/step)'
        """
        if self.stage == Stage.DISABLED:
            eager = "training went on eagerly" if self.rollbacks else "trained eagerly"
            return f"CUDA graphs off ({self.reason}): {eager}"
        if self.stage == Stage.WARMUP:
            return "CUDA graphs not captured: the fit ended in the eager warmup (raise max_steps or lower warmup_steps)"
        where = self.stage.label + (f", level {self.level}" if self.level else "")
        if math.isnan(self.speedup):
            return f"CUDA graphs on ({where}): speedup not measured yet"
        timings = f"eager {self.eager_step_ms:.2f} ms/step, graphed {self.step_ms:.2f} ms/step"
        return f"CUDA graphs on ({where}): speedup {self.speedup:.2f}x ({timings})"

    def count_fallback(self, reason: str, count: int = 1) -> None:
        """Count calls or steps that ran eagerly although graphs were in use."""
        self.fallbacks += count
        self.fallback_reasons[reason] += count

    def metrics(self) -> dict[str, float]:
        """The logged metrics, as plain floats; values not measured yet are left out."""
        values = {
            "stage": float(self.stage),
            "graphs": float(self.graphs),
            "replays": float(self.replays),
            "fallbacks": float(self.fallbacks),
            "rollbacks": float(self.rollbacks),
            "captures": float(self.captures),
            "evictions": float(self.evictions),
            "hit_rate": self.hit_rate,
            "capture_ms": self.capture_ms,
            "pool_mib": self.pool_mib,
            "step_ms": self.step_ms,
            "eager_step_ms": self.eager_step_ms,
            "speedup": self.speedup,
            "parity_err": self.parity_err,
            "level": float(LEVEL_NUMBERS.get(self.level or "", 0)) if self.ladder else math.nan,
            "capture_ms_total": self.capture_ms_total if self.captures else math.nan,
            "compile_s": self.compile_s,
            "recompiles": float(self.recompiles) if not math.isnan(self.compile_s) else math.nan,
        }
        return {METRIC_PREFIX + key: value for key, value in values.items() if not math.isnan(value)}

    def state_dict(self) -> dict[str, object]:
        """Counters that survive a checkpoint (graphs themselves never do)."""
        return {
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
            "rollbacks": self.rollbacks,
            "rollback_reasons": list(self.rollback_reasons),
            "captures": self.captures,
            "evictions": self.evictions,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the counters of :meth:`state_dict`."""
        self.replays = int(state.get("replays", 0))
        self.fallbacks = int(state.get("fallbacks", 0))
        self.fallback_reasons = Counter(state.get("fallback_reasons", {}))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.rollback_reasons = list(state.get("rollback_reasons", []))
        self.captures = int(state.get("captures", 0))
        self.evictions = int(state.get("evictions", 0))


class StepTimer:
    """Step times from CUDA events recorded on the current stream, read in bulk (or host time without CUDA)."""

    def __init__(self, use_cuda: bool, capacity: int = 256) -> None:
        self._use_cuda = use_cuda
        self._capacity = capacity
        self._pending: list[tuple[object, object]] = []
        self._open: object | None = None
        self._free: list[torch.cuda.Event] = []

    def start(self) -> None:
        """Mark the start of a step."""
        self._open = self._mark()

    def stop(self) -> None:
        """Mark the end of the step started last."""
        if self._open is None:
            return
        self._pending.append((self._open, self._mark()))
        self._open = None
        if len(self._pending) > self._capacity:
            self._recycle(self._pending.pop(0))

    def read(self) -> list[float]:
        """Milliseconds of every step since the last read (one host sync on CUDA)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if not self._use_cuda:
            return [(end - begin) * 1e3 for begin, end in pending]
        pending[-1][1].synchronize()
        times = [begin.elapsed_time(end) for begin, end in pending]
        for pair in pending:
            self._recycle(pair)
        return times

    def _mark(self) -> object:
        if not self._use_cuda:
            return time.perf_counter()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _recycle(self, pair: tuple[object, object]) -> None:
        if self._use_cuda:
            self._free.extend(pair)


def median(values: list[float]) -> float:
    """The median, or ``nan`` for no values."""
    return statistics.median(values) if values else math.nan


def log_through_lightning(module: pl.LightningModule, metrics: dict[str, float]) -> None:
    """Log plain floats with one ``log_dict`` from a training-batch hook (``on_train_batch_end``).

    They land in the rows Lightning writes for the user's metrics (every ``log_every_n_steps``, on every logger of the
    Trainer) and in ``trainer.logged_metrics`` and ``trainer.callback_metrics`` (so a callback can monitor them).
    Each value becomes a CPU tensor: no copy to the GPU, no host sync.
    """
    trainer = module.trainer
    if not metrics or trainer.barebones:  # barebones: Lightning refuses self.log (with a warning)
        return
    values = {key: torch.tensor(value, dtype=torch.float64) for key, value in metrics.items()}
    module.log_dict(values, on_step=True, on_epoch=False, logger=bool(trainer.loggers))


@rank_zero_only
def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Send plain floats to every logger of the Trainer, on rank zero: for hooks where ``self.log`` is refused.

    ``on_train_end`` is one: the metrics of a last interval that Lightning's own cadence did not write go this way.
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class ProgressBarItems:
    """Extra items on a Lightning progress bar: strings too (``self.log(prog_bar=True)`` takes numbers only).

    The bar's ``get_metrics`` is the documented place that decides what it shows; this wraps it on the one bar
    instance, for one fit, and :meth:`remove` puts back what was there. Items are read at every refresh from plain
    Python values (no tensor, no host sync).

    Args:
        items: Returns the items to add, e.g. ``{"graphs": "replaying"}`` (empty: nothing added).

    Example:
        >>> from lightning.pytorch.callbacks import TQDMProgressBar
        >>> bar, items = TQDMProgressBar(), ProgressBarItems(lambda: {"graphs": "replaying"})
        >>> items.show_on(bar)
        >>> bar.get_metrics.__call__  # doctest: +ELLIPSIS
        <bound method _WithItems.__call__ of ...>
        >>> items.remove()
        >>> "get_metrics" in vars(bar)
        False
    """

    def __init__(self, items: Callable[[], dict[str, str]]) -> None:
        self._items = items
        self._bar: Any = None

    def show_on(self, bar: Any) -> None:
        """Add the items to ``bar`` (``trainer.progress_bar_callback``); no-op for ``None`` or the bar shown on."""
        if bar is None or bar is self._bar:
            return
        self.remove()
        _unwrap(bar)  # items left by a fit that ended on an exception
        bar.get_metrics = _WithItems(bar.get_metrics, vars(bar).get("get_metrics"), self._items)
        self._bar = bar

    def remove(self) -> None:
        """Give the bar back the ``get_metrics`` it had (idempotent)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            _unwrap(bar)


class _WithItems:
    """A bar's ``get_metrics`` with the package's items added after its own.

    Args:
        get_metrics: The bar's ``get_metrics`` (bound).
        replaced: What the bar instance itself held as ``get_metrics`` before (``None``: only its class's method).
        items: The items to add.
    """

    def __init__(
        self, get_metrics: Callable[..., dict[str, Any]], replaced: Any, items: Callable[[], dict[str, str]]
    ) -> None:
        self.get_metrics, self.replaced, self.items = get_metrics, replaced, items

    def __call__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {**self.get_metrics(trainer, pl_module), **self.items()}


def _unwrap(bar: Any) -> None:
    wrapper = vars(bar).get("get_metrics")
    if not isinstance(wrapper, _WithItems):
        return
    if wrapper.replaced is None:
        del bar.get_metrics
    else:
        bar.get_metrics = wrapper.replaced

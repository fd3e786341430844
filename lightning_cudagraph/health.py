"""Replay health: the stage of a fit, its counters and timings, and the levels of its ladder, as one report.

Counters are plain Python integers bumped on the host. The report is written by the stage machine, the drivers
and the level runner, and read by the user (``callback.report``) and the logged metrics
(:mod:`lightning_cudagraph._rollout.reporting`). Each part decides from its own state and writes its figures here;
no part decides from another part's figures.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

__all__ = ["LEVEL_NUMBERS", "METRIC_PREFIX", "CUDAGraphReport", "EvaluationRecord", "LevelRecord", "Stage"]

METRIC_PREFIX = "cudagraph/"
#: ``cudagraph/level``: each level of ``scope="auto"`` 's ladder has a fixed number, so dashboards compare across
#: models (a level a model lacks is skipped, not renumbered); 0 while no level runs on graphs. ``model`` came after
#: the others and sits between ``layer`` and the whole step: 3.5 keeps the earlier numbers as they were.
LEVEL_NUMBERS = {"attn": 1.0, "attn+mlp": 2.0, "layer": 3.0, "model": 3.5, "full_iteration": 4.0}


@dataclass
class LevelRecord:
    """One level of ``scope="auto"`` 's ladder, as tried: what it measured and what became of it.

    Attributes:
        level: ``attn``, ``attn+mlp``, ``layer`` or ``full_iteration``.
        status: ``kept`` (the level training settled on), ``slower`` (confirmed, not faster by the margin),
            ``failed`` (capture or confirmation failed; ``reason`` says why), ``skipped`` (not tried; ``reason``)
            ``trying`` (on it now) or ``planned`` (not reached yet).
        step_ms: Median step time measured on the level (``nan`` if not measured).
        capture_ms: Host time of the level's captures, capture warmup iterations included.
        steps: Training steps spent on the level while the ladder was walked.
        reason: Why a level failed or was skipped.
    """

    level: str
    status: str = "planned"
    step_ms: float = math.nan
    capture_ms: float = 0.0
    steps: int = 0
    reason: str | None = None


#: ``cudagraph/optimizer_graph`` by ``report.optimizer_graph`` (anything else, a reason, is -1: eager).
_OPTIMIZER_GRAPH_NUMBERS = {"waiting": 0.0, "confirming": 1.0, "replaying": 2.0}


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
class EvaluationRecord:
    """The evaluation graphs of a fit or loop (validation, test, predict).

    Made by the evaluation graphs of the callback and the strategies.

    Attributes:
        mode: What the last evaluation loop ran on: ``"whole_step"`` (one forward-only graph per step hook and
            batch shape), ``"regions"`` (forward-only graphs of the trained level's regions) or ``"eager"``.
        reason: Why the last evaluation loop (or a shape of it) ran eagerly, or ``None``.
        graphs: Evaluation graphs alive now.
        captures: Evaluation graphs captured (and trusted) so far.
        replays: Evaluation graph replays.
        fallbacks: Evaluation steps (or region calls) that ran eagerly while evaluation graphs were in use.
        memory_mib: Device memory the evaluation graphs took when captured (what their captures added to the shared
            pool, and their static inputs), in MiB.
        capture_ms: Host time of every evaluation capture, its parity check included.
        parity_err: Largest relative difference between a graph and the eager step (or region) on the same batch.
        releases: Times the evaluation graphs were released.
    """

    mode: str | None = None
    reason: str | None = None
    graphs: int = 0
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    memory_mib: float = 0.0
    capture_ms: float = 0.0
    parity_err: float = math.nan
    releases: int = 0


@dataclass
class CUDAGraphReport:
    """Everything the rollout measured and decided, readable in code as ``callback.report``.

    Attributes:
        stage: The current ``Stage``.
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
            fallback, its own warmup steps).
        capture_ms: Host time of the last capture, capture warmup iterations included.
        pool_mib: Memory held by the graphs' shared pool.
        step_ms: Median step time over the last log interval.
        eager_step_ms: Median eager step time of the warmup steps (first step excluded): the ladder's eager
            baseline, mirrored.
        parity_err: Largest relative difference between a graphed forward and the eager forward on the same
            inputs, measured during confirmation; for the whole step, between the graph's and the eager step's
            loss and parameter update from the same state (shadow steps: confirmation and audits).
        audits: Checks of a graph against eager on a real batch, of every kind (regions' forwards, whole-step
            shadow steps, the optimizer update): the checks of confirmation and the audits.
        memory_before_capture: ``torch.cuda.memory_allocated()`` right before the first capture, in bytes.
        nonfinite: Non-finite losses seen, as ``(first step, count)`` per detection.
        level: The level graphs run at (``attn``, ``attn+mlp``, ``layer``, ``full_iteration``); with a fixed
            scope, ``None``. Logged as ``cudagraph/level``, the level's number in ``LEVEL_NUMBERS``.
        ladder: The levels ``scope="auto"`` tried, in order, with their step times and outcomes.
        exclusions: Regions left eager, by qualified name, with the reason (a failed capture or parity check).
        capture_ms_total: Host time of every capture of the fit, summed (the ladder's captures included).
        compile_s: With ``compile=``: seconds torch.compile spent compiling in this fit (recompiles included).
        recompiles: With ``compile=``: compilations after the first capture (a guard failed on an eager path).
        compile_exclusions: With ``compile=``: the levels whose regions it left uncompiled (captured as plain graphs),
            with the reason; ``compile={"regions": True}`` compiles them.
        optimizer_graph: A scoped fit through the package's strategies: the optimizer step's own graph,
            ``waiting`` (not captured yet), ``confirming``, ``replaying``, or why it stays eager
            (``optimizer_not_graphed: ...``); ``None`` otherwise. Logged as ``cudagraph/optimizer_graph``
            (0, 1, 2, or -1 when eager).
        optimizer_replays: Replays of the optimizer step's graph.
        optimizer_parity_err: Largest relative difference between the optimizer graph's update and the eager
            update from the same state on the same gradients (parameters and optimizer state).
        evaluation: The evaluation loops' graphs (an ``EvaluationRecord``).

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
    compile_exclusions: dict[str, str] = field(default_factory=dict)
    optimizer_graph: str | None = None
    optimizer_replays: int = 0
    optimizer_parity_err: float = math.nan
    evaluation: EvaluationRecord = field(default_factory=EvaluationRecord)

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
            "optimizer_graph": _OPTIMIZER_GRAPH_NUMBERS.get(self.optimizer_graph or "", -1.0)
            if self.optimizer_graph is not None
            else math.nan,
        }
        return {METRIC_PREFIX + key: value for key, value in values.items() if not math.isnan(value)}

    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of :meth:`state_dict`."""
        self.replays = int(state.get("replays", 0))
        self.fallbacks = int(state.get("fallbacks", 0))
        self.fallback_reasons = Counter(state.get("fallback_reasons", {}))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.rollback_reasons = list(state.get("rollback_reasons", []))
        self.captures = int(state.get("captures", 0))
        self.evictions = int(state.get("evictions", 0))

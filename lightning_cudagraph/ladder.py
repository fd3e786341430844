"""``scope="auto"``: a ladder of levels, walked during the fit, from the narrowest scope to the whole step.

The rungs, in order: ``attn`` (attention and Mamba mixers), ``attn+mlp`` (plus dense feed-forward blocks and MoE
routers: the dense parts of a layer), ``layer`` (whole layers) and ``full_iteration`` (the whole training step,
when the Trainer's strategy is one of the package's: only a strategy owns the step). Custom scopes of
``modules=`` join every scoped rung; overrides of built-in scopes apply to the rungs that use them. A rung that
finds no modules, or the same modules as the rung before, is skipped.

Each rung is captured, confirmed like any graph, then timed over :data:`MEASURE_STEPS` steps on its graphs (CUDA
events read once per decision; a close call is timed longer). A rung is kept as the best so far when it is faster
than the best before it (eager training to start with) by :data:`MARGIN`.

The walk: the narrowest rung first (it confirms that graphs work on the model at all), then from the widest rung
down, until one is kept. Every rung tried costs a capture and a few steps on slower graphs, and a wider rung holds
the work of the narrower ones in fewer launches: once a rung is confirmed faster, the narrower ones left are
skipped (their rows say so). A rung that fails (capture, confirmation, memory budget) or does not pay hands over
to the next narrower one. If the first rung fails, the rollout rolls back to eager as a fixed scope would; when
no rung is left, training settles on the best rung tried (captured again if needed), or on eager training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.nn as nn

from lightning_cudagraph.config import FULL_ITERATION, SCOPES, Selector
from lightning_cudagraph.health import CUDAGraphReport, LevelRecord
from lightning_cudagraph.scopes import Target, resolve_present

#: The scoped rungs and the scopes each captures, narrowest first.
RUNG_SCOPES: dict[str, tuple[str, ...]] = {
    "attn": ("attn", "mamba"),
    "attn+mlp": ("attn", "mamba", "mlp", "moe_router"),
    "layer": ("layer",),
}
#: What stands in for a layer whose capture fails: its dense parts (MoE experts stay eager).
PART_SCOPES = RUNG_SCOPES["attn+mlp"]
#: A wider rung is kept only if its median step time is this much below the best so far. Medians of a few replayed
#: steps on the H200 scatter by 1-4% for scoped graphs; 5% stays above that noise, so a rung is never kept for a
#: gain that is not there, and costs at most 5% against the best rung when two rungs are that close.
MARGIN = 0.05
#: Steps timed per rung once its graphs are confirmed (confirming steps run parity checks): their median decides
#: when it is clear of the margin by a margin; a closer call is timed over up to :data:`MAX_MEASURE_STEPS`.
MEASURE_STEPS = 2
MAX_MEASURE_STEPS = 8


@dataclass(frozen=True)
class Rung:
    """A level of the ladder: the regions it captures (none for the whole step), or why it is not tried."""

    name: str
    targets: tuple[Target, ...] = ()
    unavailable: str | None = None

    @property
    def full_step(self) -> bool:
        """Whether this rung captures the whole training step."""
        return self.name == FULL_ITERATION


def build_rungs(
    model: nn.Module, overrides: Mapping[str, Sequence[Selector]], full_step_problem: str | None
) -> list[Rung]:
    """The rungs for ``model``, in climbing order (skipped ones included, with their reason).

    Args:
        model: The LightningModule.
        overrides: The ``modules=`` option: overrides of built-in scopes, and custom scopes (in every scoped rung).
        full_step_problem: Why the whole step cannot be captured in this fit, or ``None`` if it can.

    Example:
        >>> import torch.nn as nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)
        >>> model = nn.Module()
        >>> model.layers = nn.ModuleList([Block(), Block()])
        >>> [(r.name, len(r.targets), r.unavailable) for r in build_rungs(model, {}, "needs the strategy")]
        [('attn', 2, None), ('attn+mlp', 4, None), ('layer', 2, None), ('full_iteration', 0, 'needs the strategy')]
    """
    custom = tuple(name for name in overrides if name not in SCOPES)
    rungs: list[Rung] = []
    previous: tuple[str, tuple[str, ...]] | None = None
    for name, scopes in RUNG_SCOPES.items():
        targets = tuple(resolve_present(model, (*scopes, *custom), overrides).targets)
        names = tuple(target.name for target in targets)
        if not targets:
            rungs.append(Rung(name, unavailable=f"no {' or '.join(scopes)} modules"))
        elif previous is not None and names == previous[1]:
            rungs.append(Rung(name, unavailable=f"the same modules as {previous[0]!r}"))
        else:
            rungs.append(Rung(name, targets))
            previous = (name, names)
    rungs.append(Rung(FULL_ITERATION, unavailable=full_step_problem))
    return rungs


def replacement_parts(
    model: nn.Module, targets: Sequence[Target], overrides: Mapping[str, Sequence[Selector]]
) -> dict[str, tuple[Target, ...]]:
    """For each layer among ``targets``, the dense parts that are captured instead when the layer cannot be."""
    layers = [target for target in targets if target.scope == "layer"]
    if not layers:
        return {}
    custom = tuple(name for name in overrides if name not in SCOPES)
    parts = resolve_present(model, (*PART_SCOPES, *custom), overrides).targets
    found = {layer.name: tuple(p for p in parts if p.name.startswith(layer.name + ".")) for layer in layers}
    return {name: inside for name, inside in found.items() if inside}


#: Where the ladder settles when no rung was faster than eager training by the margin (or none could be confirmed).
EAGER = Rung("eager", unavailable="no level was confirmed faster than eager training")


class Ladder:
    """The decisions of the climb: which rung is on, which was best, where to go next. Pure bookkeeping.

    Args:
        rungs: From :func:`build_rungs`.
        report: Its ``ladder`` rows and ``level`` are written here.
        margin: See :data:`MARGIN`.

    Example:
        >>> from lightning_cudagraph.health import CUDAGraphReport
        >>> report = CUDAGraphReport()
        >>> ladder = Ladder([Rung("attn", ()), Rung("layer", ())], report)
        >>> ladder.measured(10.0, eager_ms=20.0).name  # attn pays: keep it as the best, try layer
        'layer'
        >>> ladder.measured(9.9, eager_ms=20.0).name  # layer is within the margin: back to attn
        'attn'
        >>> [(row.level, row.status) for row in report.ladder]
        [('attn', 'kept'), ('layer', 'slower')]
    """

    def __init__(self, rungs: Sequence[Rung], report: CUDAGraphReport, margin: float = MARGIN) -> None:
        self.report, self.margin = report, margin
        self._rungs = [rung for rung in rungs if rung.unavailable is None]
        self._rows = {rung.name: LevelRecord(rung.name) for rung in self._rungs}
        report.ladder = [
            self._rows.get(rung.name) or LevelRecord(rung.name, status="skipped", reason=rung.unavailable)
            for rung in rungs
        ]
        self._walk = _walk(self._rungs)
        self._position = 0
        self._best: Rung | None = None
        self.settled = not self._rungs

    @property
    def current(self) -> Rung | None:
        """The rung training is on (or going to)."""
        return self._walk[self._position] if self._walk else None

    @property
    def to_try(self) -> list[Rung]:
        """The rungs the climb may try, in the order it tries them (it stops at the first one kept after the first)."""
        return list(self._walk)

    @property
    def row(self) -> LevelRecord:
        """The report's row of the current rung."""
        return self._rows[self._walk[self._position].name]

    @property
    def scoped_targets(self) -> list[Target]:
        """Every target of every scoped rung, each once, by name."""
        seen: dict[str, Target] = {}
        for rung in self._rungs:
            for target in rung.targets:
                seen.setdefault(target.name, target)
        return list(seen.values())

    @property
    def has_full_step(self) -> bool:
        """Whether the whole step is one of the rungs to try."""
        return any(rung.full_step for rung in self._rungs)

    def skip(self, name: str, reason: str) -> None:
        """Take a rung out before the climb starts (a problem found once the optimizers exist)."""
        self._rungs = [rung for rung in self._rungs if rung.name != name]
        self._walk = _walk(self._rungs)
        row = self._rows.pop(name, None)
        if row is not None:
            row.status, row.reason = "skipped", reason
        self.settled = not self._rungs

    def close_call(self, step_ms: float, eager_ms: float, spread: float = 1.0) -> bool:
        """Whether ``step_ms`` is too near the bar a rung must pass to decide on a few steps (time it longer).

        Near means within the margin of the bar, or within half the steps' spread (``max / min``) of it: a median
        of noisy steps is only that sure.
        """
        reference = self._rows[self._best.name].step_ms if self._best is not None else eager_ms
        bar = reference * (1 - self.margin)
        return not math.isnan(bar) and abs(step_ms - bar) < max(bar * self.margin, step_ms * (spread - 1) / 2)

    def same_as(self, other: str) -> Rung | None:
        """The current rung ended up capturing the regions ``other`` did (every layer narrowed to its parts).

        It is not timed again. Returns the rung to move to next, ``None`` to stay, or :data:`EAGER`.
        """
        row = self.row
        row.status, row.reason = "skipped", f"after narrowing, the same regions as {other!r}"
        return self._next()

    def measured(self, step_ms: float, eager_ms: float) -> Rung | None:
        """The current rung is confirmed and timed: the rung to move to next, ``None`` to stay, or :data:`EAGER`."""
        row = self.row
        row.step_ms = step_ms
        reference = self._rows[self._best.name].step_ms if self._best is not None else eager_ms
        if math.isnan(reference) or step_ms < reference * (1 - self.margin):
            if self._best is not None:
                self._rows[self._best.name].status = "slower"
            self._best = self.current
            row.status = "kept"
        else:
            row.status = "slower"
        return self._next()

    def _next(self) -> Rung | None:
        best = self._best
        if self._position > 0 and best is not None and best is self.current:  # the narrower rungs hold less of its work
            for rung in self._walk[self._position + 1 :]:
                row = self._rows[rung.name]
                row.status, row.reason = "skipped", f"{best.name!r} was confirmed faster and holds its work"
            return self._settle()
        if self._position + 1 < len(self._walk):
            self._position += 1
            return self.current
        return self._settle()

    def failed(self, reason: str) -> Rung | None:
        """The current rung failed: where the climb goes next.

        Returns:
            The next narrower rung to try; with none left, or when the first rung failed, the best rung confirmed to
            go back to (``None`` if it is the current one) or :data:`EAGER`.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        if 0 < self._position < len(self._walk) - 1:
            self._position += 1
            return self.current
        return self._settle()

    def _settle(self) -> Rung | None:
        self.settled = True
        if self._best is None:
            self.report.level = None
            return EAGER
        self.report.level = self._best.name
        if self._best is self.current:
            return None
        self._position = self._walk.index(self._best)
        return self._best

    def describe(self) -> str:
        """One line per the report's rows: what each rung measured and became."""
        parts = []
        for row in self.report.ladder:
            timing = f" {row.step_ms:.2f} ms" if not math.isnan(row.step_ms) else ""
            why = f" ({row.reason})" if row.reason else ""
            parts.append(f"{row.level}: {row.status}{timing}{why}")
        return "; ".join(parts)


def _walk(rungs: Sequence[Rung]) -> list[Rung]:
    """The order of the climb: the narrowest rung, then from the widest down."""
    return [*rungs[:1], *reversed(rungs[1:])]

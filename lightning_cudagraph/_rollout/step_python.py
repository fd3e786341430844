"""The step's Python, judged: may one graph hold the whole training step?

A whole-step replay runs no Python, so the step's Python must do the same thing on every step. The eager steps before
the first capture are observed, and one eager step at every epoch boundary once the whole step replays (an epoch's
hooks can change what the step does). Python a graph would freeze (a per-step value read, a random draw, a skipped
batch, changed attributes or operations, optimizer step hooks) rolls a fixed ``full_iteration`` back; under
``scope="auto"`` the whole step is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.optimizers import describe_step_hooks
from lightning_cudagraph._graphs.accumulation import Position
from lightning_cudagraph._lightning import step_loss
from lightning_cudagraph._options.batches import batch_key
from lightning_cudagraph._options.config import FULL_ITERATION
from lightning_cudagraph._trust.capture_hints import known_cause
from lightning_cudagraph._trust.observation import SKIP_FIX, Behaviour, Observer, frozen_by_a_graph
from lightning_cudagraph._trust.reads import watched_index
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import Stage

if TYPE_CHECKING:
    from lightning_cudagraph._graphs.base import Driver
    from lightning_cudagraph._rollout.ladder import Ladder

__all__ = ["StepPython", "step_python_reason"]

#: Where the graph-safe way to feed a per-step value to a captured step is documented.
DOCS = "docs/python.md"
#: The package's own modules (its callback's state is not the step's).
_PACKAGE = __name__.partition(".")[0]
#: No step is planned to run observed.
_UNOBSERVED = object()


class StepPython:
    """The observed eager steps of one fit, by batch key, and what they showed (``problem``).

    The rollout hands it each whole step: :meth:`plan` before the driver plans it, :meth:`run` around it.
    ``setup_steps``: observed steps per batch key that may set things up once (a lazy buffer, Lightning's first
    ``self.log``; under DDP also the second, where DDP rebuilds its gradient buckets), whose changes are not compared.
    """

    def __init__(self, observer: Observer, component: str = "CUDAGraphCallback", setup_steps: int = 1) -> None:
        self.observer, self.component, self.setup_steps = observer, component, setup_steps
        #: Why the step's Python cannot be held by a whole-step graph (``None`` while nothing showed it).
        self.problem: str | None = None
        #: Per batch key: the set-up steps, the first one after them (the reference) and the latest.
        self._spans: dict[Any, list[Behaviour]] = {}
        self._current: Behaviour | None = None
        self._updates = 0  # optimizer steps the observed step took itself (manual optimization)
        self._epoch: int | None = None
        self._planned: Any = _UNOBSERVED  # (batch key, whether it re-checks) of the step planned to run observed

    def recheck_due(self, epoch: int) -> bool:
        """Whether an epoch started since the last observed step (once graphs replay, one eager step re-checks)."""
        return self.problem is None and self._epoch is not None and epoch != self._epoch

    # ------------------------------------------------------------------ a whole step (from the rollout)
    def refuse_optimizer_hooks(self, trainer: pl.Trainer, machine: StageMachine, ladder: Ladder) -> None:
        """Optimizer step hooks run once at a whole-step capture and never on replay: no whole step for this fit."""
        if not any(level.whole_step for level in ladder.to_try):
            return
        hooks = next(filter(None, map(describe_step_hooks, trainer.optimizers)), None)
        if hooks is None:
            return
        self.problem = step_python_reason(
            f"runs optimizer step hooks ({hooks}), which a replay never runs",
            "remove the hooks for the fit (handle.remove()), or use a scoped level (strategy='cudagraph' or"
            " scope=['layer']), whose optimizer step runs eagerly with its hooks",
        )
        self._leave_out_whole_step(machine, ladder)

    def plan(self, trainer: pl.Trainer, driver: Driver, ladder: Ladder, stage: Stage) -> None:
        """Before the driver plans a step: an epoch's first step re-checks (eagerly) while the whole step replays."""
        self._planned = _UNOBSERVED
        level = ladder.current
        replaying = stage in (Stage.CONFIRMING, Stage.REPLAYING)
        due = replaying and self.recheck_due(trainer.current_epoch) and Position.of(trainer).place.zeroes
        if level is not None and level.whole_step and due:
            driver.eager_next = f"step_python_recheck: epoch {trainer.current_epoch} started"
            self._planned = None, True

    def planned(self, trainer: pl.Trainer, batch: Any, driver: Driver, stage: Stage) -> None:
        """The driver planned the step: observe it when it re-checks, or runs eagerly before the first capture."""
        recheck = self._planned is not _UNOBSERVED
        before_capture = stage == Stage.WARMUP and not driver.captured_any and not driver.plans_capture
        if self.problem is None and (recheck or before_capture):
            self._planned = (batch_key(batch, values=True), Position.of(trainer).place), recheck

    def run(
        self, trainer: pl.Trainer, driver: Driver, machine: StageMachine, ladder: Ladder, step: Callable[[], Any]
    ) -> Any:
        """Run the planned step (``step``: the driver's), observed when planned so; act on what it showed."""
        planned, self._planned = self._planned, _UNOBSERVED
        # A scoped level captures its regions after the plan (at the batch's start): that step is not eager.
        if planned is _UNOBSERVED or (driver.captured_any and not planned[1]):
            return step()
        output = self.observe(planned[0], trainer.lightning_module, trainer.current_epoch, step)
        self._act(machine, ladder)
        return output

    def _act(self, machine: StageMachine, ladder: Ladder) -> None:
        """After an observed step, taken by every rank at once: the whole step is left out, or rolled back."""
        found = self.problem
        if not machine.agreement.any_of([found is not None])[0]:
            return
        self.problem = found or step_python_reason(  # every rank stops observing at once
            "training_step's Python differs between steps on another rank", "see that rank's log"
        )
        self._leave_out_whole_step(machine, ladder)

    def _leave_out_whole_step(self, machine: StageMachine, ladder: Ladder) -> None:
        """The whole step is rolled back where training is on it (fixed, or auto's current); else auto skips it.

        Under ``scope="auto"`` the whole step is the walk's first level: found before the walk starts (fit start:
        optimizer step hooks), it is skipped like any level preflight refuses.
        """
        reason = self.problem or ""
        level = ladder.current
        if level is not None and level.whole_step and (ladder.started or not ladder.climbs):
            machine.rollback(reason)
        elif ladder.climbs and any(level.whole_step for level in ladder.to_try):
            ladder.skip(FULL_ITERATION, reason)
            rank_zero_info(f"{self.component}: scope='auto' leaves the whole step out: {reason}")

    # ------------------------------------------------------------------ an observed step
    def observe(self, key: Any, module: torch.nn.Module, epoch: int, run_step: Callable[[], Any]) -> Any:
        """Run one eager optimizer step under observation; what it shows may set :attr:`problem`."""
        reader = module if isinstance(module, pl.LightningModule) else None
        trainer = reader._trainer if reader is not None else None
        callbacks = [
            (type(callback).__name__, callback)
            for callback in getattr(trainer, "callbacks", ())
            if not type(callback).__module__.startswith(_PACKAGE)  # the package's own bookkeeping is not the step's
        ]
        with self.observer.span([module], reader=reader, paused=True, others=callbacks) as seen:
            self._current, self._updates = seen, 0
            try:
                output = run_step()
            finally:
                self._current = None
        self._epoch = epoch
        self._judge(key, seen, module)
        return output

    def step_arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``training_step`` 's arguments in an observed step: ``batch_idx`` notes where user code uses it."""
        if self._current is None:
            return args
        self.observer.resume()
        if len(args) < 2 or type(args[1]) is not int:
            return args
        return (args[0], watched_index(args[1], self._current.reads), *args[2:])

    def step_output(self, output: Any) -> None:
        """``training_step`` returned ``output`` in an observed step (``None``: the batch was skipped)."""
        if (
            self._current is not None and step_loss(output) is None and not self._updates
        ):  # a manual step may return None
            self._current.skipped = True

    def pause_trace(self) -> None:
        """The optimizer's update starts (``on_before_optimizer_step``): its settings are watched apart."""
        if self._current is not None:
            self.observer.pause()

    def resume_trace(self) -> None:
        """A manual ``training_step`` 's optimizer step ended: the rest of the step is traced again."""
        if self._current is not None:
            self._updates += 1
            self.observer.resume()

    def _judge(self, key: Any, seen: Behaviour, module: torch.nn.Module) -> None:
        """Weigh one observed step against the steps of its batch key before it (:func:`frozen_by_a_graph`)."""
        spans = self._spans.setdefault(key, [])
        spans.append(seen)
        del spans[self.setup_steps + 1 : -1]  # the steps between were weighed already: keep the set-up and reference
        found = frozen_by_a_graph(spans, self.setup_steps)
        if found is None or self.problem is not None:
            return
        known = known_cause(module) if not (seen.skipped or seen.random or seen.reads) else None
        if known is not None:  # operations that follow the data, in a layout whose fix is known
            self.problem = step_python_reason(f"training_step {found} ({known[0]})", known[1])
        else:
            self.problem = step_python_reason(f"training_step {found}", _fix(seen))


def _fix(seen: Behaviour) -> str:
    if seen.skipped:
        return SKIP_FIX
    if seen.random:
        return (
            "draw with torch on the device (torch.rand(..., device=self.device)), which a replay draws anew, or use a"
            " scoped level (strategy='cudagraph' or scope=['layer'])"
        )
    if seen.reads:
        return (
            "keep the per-step value in a device tensor that on_train_batch_start updates in place"
            " (self.register_buffer('weight', torch.tensor(1.0), persistent=False), then"
            f" self.weight.fill_(...)): a replay reads it ({DOCS}); or use a scoped level (strategy='cudagraph' or"
            " scope=['layer']), which runs training_step's Python every step"
        )
    return (
        "keep state changes out of training_step (on_train_batch_end receives the step's outputs), or use a scoped"
        f" level (strategy='cudagraph' or scope=['layer']), which runs training_step's Python every step ({DOCS})"
    )


def step_python_reason(found: str, fix: str) -> str:
    """The rollback (or level-skipping) reason of a step whose Python a whole-step graph would freeze."""
    return (
        f"step_python: {found}; a whole-step graph runs none of the step's Python, so every replay would repeat"
        f" what the captured step decided. Fix: {fix}"
    )

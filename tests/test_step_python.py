"""The Python a graph cannot see: per-step Python in ``training_step`` against the same fit without the package.

A whole-step replay runs no Python, so what ``training_step`` decides per step (skip the batch, a weight read from
``self.global_step``, a branch on the epoch, Python ``random``, a list it appends to, a counter) would be frozen at
capture. Each case below is a user's module as it is written in ordinary Lightning code, trained three ways on the
strict fake backend (``cudagraph_full``, ``strategy="cudagraph"`` and ``scope=["layer"]``) and compared with the
same fit without the package: losses, logged values, parameters and the user's own Python state. A run either trains
on graphs equal to eager, or trains eagerly and says why; it never trains a wrong step, and ``scope="auto"`` keeps a
lower level wherever the step's Python allows.
"""

from __future__ import annotations

import itertools
import random
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import LEVEL_MS, StepHookedAt, graph_callback, parameters_of, timed_by_level, trainer
from tests.models import TINY, TINY_DATA, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: Enough for scope="auto" to climb to the whole step and settle (16 batches an epoch: three epochs and a half).
STEPS = 56
#: Rounding of the capturable optimizer against the user's own stays far below this; a frozen Python value does not.
TOLERANCE = 1e-4


# =================================================================== the users' modules
class Constant(DecoderModule):
    """The control: nothing per step but ``self.log``."""


class SkipEveryThird(DecoderModule):
    """Lightning's documented way to skip a batch: ``training_step`` returns ``None``."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 3 == 2:
            return None
        return super().training_step(batch, batch_idx)


class SkipAtCapture(DecoderModule):
    """Skips the batch the whole step would be captured on (``warmup_steps=1``)."""

    def training_step(self, batch, batch_idx):
        if batch_idx in (1, 9):
            return None
        return super().training_step(batch, batch_idx)


class AnnealedWeight(DecoderModule):
    """A loss weight from Python state, as KL annealing does."""

    def training_step(self, batch, batch_idx):
        weight = 1.0 if self.global_step < 5 else 0.1
        loss = weight * self.loss(batch)
        self.log("train_loss", loss)
        return loss


class EpochBranch(DecoderModule):
    """A curriculum switch on the epoch: an L2 term from the second epoch on."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.current_epoch >= 1:
            loss = loss + 1e-2 * self.model.head.weight.pow(2).sum()
        self.log("train_loss", loss)
        return loss


class BatchIndexWeight(DecoderModule):
    """A weight from ``batch_idx``."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch) * (1.0 + 0.5 * (batch_idx % 2))
        self.log("train_loss", loss)
        return loss


class PythonRandom(DecoderModule):
    """A ratio drawn from Python's ``random`` in the step."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch) * (0.5 + random.random())
        self.log("train_loss", loss)
        return loss


class OutputsList(DecoderModule):
    """Losses appended to a list in the step and read in ``on_train_epoch_end``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: list[torch.Tensor] = []
        self.epoch_means: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.step_losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.epoch_means.append(float(torch.stack(self.step_losses).mean()))
        self.step_losses.clear()


class Counter(DecoderModule):
    """A counter attribute incremented in the step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)


class SecondForward(DecoderModule):
    """An auxiliary term from a second forward, from step 6 on."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.global_step >= 6:
            x, y = batch
            loss = loss + 0.5 * self.loss((x.flip(1), y.flip(1)))
        self.log("train_loss", loss)
        return loss


class Flagged(DecoderModule):
    """Reads a flag that a callback flips at an epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.l2 = False

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.l2:
            loss = loss + 1e-2 * self.model.head.weight.pow(2).sum()
        self.log("train_loss", loss)
        return loss


class Settings:
    """A user's settings object, neither a dict nor a dataclass: the guards do not hold what it contains."""

    def __init__(self) -> None:
        self.l2 = False


class FlaggedOnSettings(DecoderModule):
    """Reads a flag kept on a settings object, which a callback flips at an epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = Settings()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.settings.l2:
            loss = loss + 1e-2 * self.model.head.weight.pow(2).sum()
        self.log("train_loss", loss)
        return loss


class StepHooked(DecoderModule):
    """An optimizer with a step post-hook that counts steps, as libraries register them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer_steps = 0

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        optimizer.register_step_post_hook(lambda *_: setattr(self, "optimizer_steps", self.optimizer_steps + 1))
        return optimizer


# =================================================================== callbacks that change things mid-fit
class FlipFlagAtEpoch(pl.Callback):
    """Sets ``pl_module.l2`` from the second epoch on."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= 1:
            pl_module.l2 = True


class FlipSettingsAtEpoch(pl.Callback):
    """Sets ``pl_module.settings.l2`` from the second epoch on (the epoch's re-check sees the step change)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= 1:
            pl_module.settings.l2 = True


class FirstBlockEvalAtEpoch(pl.Callback):
    """Puts the first block in eval mode (its dropout off) from the second epoch on."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= 1:
            pl_module.model.blocks[0].eval()


class HookInsideALayerAt(pl.Callback):
    """At a step, halves what the second block's MLP returns: a forward hook, or a forward set on the instance."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        mlp = pl_module.model.blocks[1].mlp
        if self.how == "hook":
            mlp.register_forward_hook(lambda module, args, output: output * 0.5)
        else:
            original = mlp.forward
            mlp.forward = types.MethodType(lambda module, x: original(x) * 0.5, mlp)


# =================================================================== what a user compares
class Observed(pl.Callback):
    """Each batch's loss (``None`` for a skipped one) and the logged ``train_loss``, as a user's monitor reads them."""

    def __init__(self) -> None:
        self.losses: list[float | None] = []
        self.logged: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(None if loss is None else float(loss))
        logged = trainer.callback_metrics.get("train_loss")
        self.logged.append(None if logged is None else float(logged))


@dataclass
class Case:
    """A user's module, the callbacks of the fit, and the Python state a user reads after it."""

    module: type[DecoderModule]
    callbacks: Callable[[], list[pl.Callback]] = list
    state: Callable[[Any], Any] = lambda model: None
    options: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = WARMUP
    #: Whether a scoped level can keep its graphs (a hook inside a captured layer cannot: the graph holds the layer).
    scoped_keeps_graphs: bool = True
    #: Options of the Trainer (``gradient_clip_val``).
    trainer_options: dict[str, Any] = field(default_factory=dict)


CASES = {
    "constant": Case(Constant),
    "skip_every_third": Case(SkipEveryThird),
    "skip_at_capture": Case(SkipAtCapture, warmup_steps=1),
    "global_step_weight": Case(AnnealedWeight),
    "epoch_branch": Case(EpochBranch),
    "batch_idx_weight": Case(BatchIndexWeight),
    "python_random": Case(PythonRandom, state=lambda model: random.random()),
    "outputs_list": Case(OutputsList, state=lambda model: model.epoch_means),
    "counter": Case(Counter, state=lambda model: model.calls),
    "second_forward": Case(SecondForward),
    "flag_flipped_at_epoch": Case(Flagged, callbacks=lambda: [FlipFlagAtEpoch()], state=lambda model: model.l2),
    "settings_flag_flipped_at_epoch": Case(  # 12 batches an epoch: the flip falls between two audits
        FlaggedOnSettings,
        callbacks=lambda: [FlipSettingsAtEpoch()],
        state=lambda model: model.settings.l2,
        options={"train_samples": 48},
    ),
    "mode_flipped_at_epoch": Case(Constant, callbacks=lambda: [FirstBlockEvalAtEpoch()], options={"dropout": 0.1}),
    "hook_added_mid_fit": Case(Constant, callbacks=lambda: [HookInsideALayerAt(6, "hook")], scoped_keeps_graphs=False),
    "forward_set_mid_fit": Case(
        Constant, callbacks=lambda: [HookInsideALayerAt(6, "forward")], scoped_keeps_graphs=False
    ),
    "optimizer_step_hook": Case(StepHooked, state=lambda model: model.optimizer_steps),
}


@dataclass
class Outcome:
    """What one fit left: per-batch losses and logged values, parameters, the user's state, and the report."""

    losses: list[float | None]
    logged: list[float | None]
    params: dict[str, torch.Tensor]
    state: Any
    report: Any = None


def run_case(case: Case, variant: str | None, cuda: bool = False) -> Outcome:
    """Fit ``case`` eagerly (``variant=None``) or through one of the package's ways in.

    On the strict fake backend, or with real CUDA graphs on a GPU (``cuda``).
    """
    model, data = decoder(TINY, case.module, **{**TINY_DATA, **case.options})
    observed = Observed()
    callbacks: list[pl.Callback] = [observed, *case.callbacks()]
    options: dict[str, Any] = {}

    def backend(**timing: Any) -> Any:
        return None if cuda else FakeBackend(**timing)

    if variant == "cudagraph_full":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=case.warmup_steps)
        strategy.capture_backend = backend()
        options["strategy"] = strategy
    elif variant == "cudagraph":
        strategy = CUDAGraphStrategy(warmup_steps=case.warmup_steps)
        strategy.capture_backend = backend(step_ms=timed_by_level(LEVEL_MS))
        options["strategy"] = strategy
    elif variant == "layer":
        callback = CUDAGraphCallback(scope=["layer"], warmup_steps=case.warmup_steps)
        callback.capture_backend = backend()
        callbacks.append(callback)
    device = {"accelerator": "cuda", "devices": 1} if cuda else CPU
    fit = trainer(STEPS, callbacks, **options, **case.trainer_options, **device)
    fit.fit(model, data)
    report = graph_callback(fit).report if variant is not None else None
    return Outcome(observed.losses, observed.logged, parameters_of(model), case.state(model), report)


_EAGER: dict[str, Outcome] = {}


def eager(name: str) -> Outcome:
    """The fit without the package, once per case."""
    if name not in _EAGER:
        _EAGER[name] = run_case(CASES[name], None)
    return _EAGER[name]


def assert_same_training(expected: Outcome, actual: Outcome) -> None:
    """Losses, logged values, parameters and the user's state as without the package."""
    assert [loss is None for loss in actual.losses] == [loss is None for loss in expected.losses], "skips differ"
    for name, values in (("loss", (expected.losses, actual.losses)), ("logged", (expected.logged, actual.logged))):
        off = [i for i, (a, b) in enumerate(zip(*values, strict=True)) if a is not None and abs(a - b) >= TOLERANCE]
        assert not off, f"{name} off eager from step {off[0]}: {values[0][off[0]]} eager, {values[1][off[0]]} here"
    worst = max(float((expected.params[k] - actual.params[k]).abs().max()) for k in expected.params)
    assert worst < TOLERANCE, f"parameters off eager by {worst:.3g}"
    assert actual.state == pytest.approx(expected.state, abs=TOLERANCE), "the user's Python state differs from eager"


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph", "layer"])
@pytest.mark.parametrize("name", list(CASES))
def test_per_step_python_never_trains_off_eager(name, variant):
    case = CASES[name]
    outcome = run_case(case, variant)
    assert_same_training(eager(name), outcome)
    report = outcome.report
    on_graphs = report.stage in (Stage.CONFIRMING, Stage.REPLAYING) and report.replays > 0
    assert on_graphs or (report.stage == Stage.DISABLED and report.reason), "graphs off without a reason"
    if variant == "cudagraph" or (variant == "layer" and case.scoped_keeps_graphs):
        assert report.stage == Stage.REPLAYING, f"graphs given up where a scoped level holds: {report.reason}"
    if name == "constant":
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
        if variant == "cudagraph":
            assert report.level == "full_iteration", report.ladder


# =================================================================== what the reasons say
def whole_step_reason(module: type[DecoderModule], **options: Any) -> str:
    outcome = run_case(Case(module, **options), "cudagraph_full")
    assert outcome.report.stage == Stage.DISABLED
    return outcome.report.reason


@pytest.mark.parametrize(
    ("module", "named"),
    [
        (AnnealedWeight, r"self\.global_step.*weight = 1\.0 if self\.global_step < 5 else 0\.1"),
        (EpochBranch, r"self\.current_epoch.*if self\.current_epoch >= 1"),
        (BatchIndexWeight, r"batch_idx.*1\.0 \+ 0\.5 \* \(batch_idx % 2\)"),
        (SkipEveryThird, r"batch_idx.*if batch_idx % 3 == 2"),
        (PythonRandom, r"Python's random"),
        (OutputsList, r"step_losses"),
        (Counter, r"calls: 2 -> 3|calls"),
        (StepHooked, r"step post-hook"),
    ],
)
def test_the_reason_names_what_the_step_depends_on_and_the_fix(module, named):
    reason = whole_step_reason(module)
    assert reason.startswith("rollback: step_python:") or reason.startswith("step_python:"), reason
    assert pytest.importorskip("re").search(named, reason), reason
    assert "Fix:" in reason, reason


_HIDDEN = itertools.count()


class HiddenSkip(DecoderModule):
    """Skips the second batch by a counter no watch can see (a module-level iterator), as if data decided it."""

    def training_step(self, batch, batch_idx):
        if next(_HIDDEN) == 1:
            return None
        return super().training_step(batch, batch_idx)


def test_a_whole_step_captured_on_a_skipped_batch_is_refused_at_capture():
    global _HIDDEN
    _HIDDEN = itertools.count()
    model, data = decoder(TINY, HiddenSkip, **TINY_DATA)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=1)
    strategy.capture_backend = backend = FakeBackend()
    fit = trainer(8, [], strategy=strategy, **CPU)
    fit.fit(model, data)
    report = graph_callback(fit).report
    assert report.stage == Stage.DISABLED and "skipped_step" in report.reason, report.reason
    assert backend.live_graphs == 0


def test_a_second_call_of_a_region_in_one_step_runs_eagerly_and_says_why():
    outcome = run_case(CASES["second_forward"], "layer")
    assert outcome.report.stage == Stage.REPLAYING
    assert any("called_again" in reason for reason in outcome.report.fallback_reasons), outcome.report.fallback_reasons


class AlwaysTwice(DecoderModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(batch) + 0.5 * self.loss((x.flip(1), y.flip(1)))
        self.log("train_loss", loss)
        return loss


def test_targets_called_twice_in_every_step_are_named_as_such():
    outcome = run_case(Case(AlwaysTwice), "layer")
    assert outcome.report.stage == Stage.DISABLED
    assert "2 times" in outcome.report.reason and "no target module ran" not in outcome.report.reason


# =================================================================== the graph-safe way
class ScheduledWeight(DecoderModule):
    """The supported way: the weight lives in a device tensor that a hook outside the step updates in place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("weight", torch.tensor(1.0), persistent=False)

    def on_train_batch_start(self, batch, batch_idx):
        self.weight.fill_(1.0 if self.global_step < 5 else 0.1)

    def training_step(self, batch, batch_idx):
        loss = self.weight * self.loss(batch)
        self.log("train_loss", loss)
        return loss


def test_a_weight_kept_in_a_device_tensor_keeps_the_whole_step_and_anneals():
    expected = run_case(Case(ScheduledWeight), None)
    outcome = run_case(Case(ScheduledWeight), "cudagraph_full")
    assert_same_training(expected, outcome)
    assert outcome.report.stage == Stage.REPLAYING and outcome.report.rollbacks == 0, outcome.report.reason
    assert outcome.report.replays > STEPS // 2


# =================================================================== regions, and no false alarm
class StochasticDepth(torch.nn.Module):
    """A block skipped at random in training, by Python's ``random`` in its forward (a layer drop)."""

    def __init__(self, block: torch.nn.Module, p: float) -> None:
        super().__init__()
        self.block, self.p = block, p

    def forward(self, x):
        if self.training and random.random() < self.p:
            return x
        return self.block(x)


class LayerDrop(DecoderModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.blocks[1] = StochasticDepth(self.model.blocks[1], p=0.5)


def test_a_region_whose_forward_draws_from_python_random_stays_eager_and_the_others_keep_graphs():
    expected = run_case(Case(LayerDrop), None)
    callback = CUDAGraphCallback(scope=["layer"], modules={"layer": "model.blocks.*"}, warmup_steps=3)
    callback.capture_backend = backend = FakeBackend()
    model, data = decoder(TINY, LayerDrop, **TINY_DATA)
    observed = Observed()
    trainer(STEPS, [observed, callback], **CPU).fit(model, data)
    assert_same_training(expected, Outcome(observed.losses, observed.logged, parameters_of(model), None))
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert [region.name for region in backend.regions] == ["model.blocks.0"]
    assert "Python's random" in report.exclusions.get("model.blocks.1", ""), report.exclusions


def test_the_examples_gpt_captures_whole_with_its_logs():
    from examples.gpt import GPTModule, TokenDataModule

    size = {"vocab_size": 64, "seq_len": 16}
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=3)
    strategy.capture_backend = FakeBackend()
    pl.seed_everything(0, verbose=False)
    model = GPTModule(**size, n_layer=2, width=32, heads=2)
    data = TokenDataModule(**size, batch_size=4, train_samples=256, val_samples=16)
    fit = trainer(24, [], strategy=strategy, **CPU)
    fit.fit(model, data)
    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
    assert report.steps_replayed >= 24 - 3 - 2


def test_an_optimizer_step_hook_added_after_capture_rolls_back_before_a_replay_skips_it():
    hooked = StepHookedAt(6)
    outcome = run_case(Case(Constant, callbacks=lambda: [hooked]), "cudagraph_full")
    assert outcome.report.stage == Stage.DISABLED and "hook" in outcome.report.reason, outcome.report.reason
    assert hooked.calls == STEPS - 6, "the hook ran on every step from its registration, as without the package"


class FlipFlagAtEpochFour(pl.Callback):
    """Sets ``pl_module.l2`` from the fifth epoch on, once ``scope="auto"`` has settled."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= 4:
            pl_module.l2 = True


def test_auto_settled_on_the_whole_step_goes_down_a_level_when_an_epoch_changes_the_steps_python():
    case = Case(Flagged, callbacks=lambda: [FlipFlagAtEpochFour()], state=lambda model: model.l2)
    steps = 96
    model, data = decoder(TINY, Flagged, **TINY_DATA)
    expected_observed, observed = Observed(), Observed()
    trainer(steps, [expected_observed, *case.callbacks()], **CPU).fit(model, data)
    expected = Outcome(expected_observed.losses, expected_observed.logged, parameters_of(model), model.l2)
    model, data = decoder(TINY, Flagged, **TINY_DATA)
    strategy = CUDAGraphStrategy(warmup_steps=WARMUP)
    strategy.capture_backend = FakeBackend(step_ms=timed_by_level(LEVEL_MS))
    fit = trainer(steps, [observed, *case.callbacks()], strategy=strategy, **CPU)
    levels: list[str | None] = []
    fit.callbacks.append(LevelAtEpochStart(levels))
    fit.fit(model, data)
    assert_same_training(expected, Outcome(observed.losses, observed.logged, parameters_of(model), model.l2))
    report = graph_callback(fit).report
    assert levels[4] == "full_iteration", f"the fit had not settled on the whole step before the flip: {levels}"
    assert report.stage == Stage.REPLAYING and report.level not in (None, "full_iteration"), report.ladder
    assert any("step_python" in (row.reason or "") for row in report.ladder if row.level == "full_iteration")


class LevelAtEpochStart(pl.Callback):
    def __init__(self, levels: list[str | None]) -> None:
        self.levels = levels

    def on_train_epoch_start(self, trainer, pl_module):
        self.levels.append(graph_callback(trainer).report.level)


# =================================================================== a callback's hooks inside the step
class BackwardCounter(pl.Callback):
    """Counts ``on_after_backward`` calls: a hook inside the optimizer step, so inside a whole-step graph."""

    def __init__(self) -> None:
        self.calls = 0

    def on_after_backward(self, trainer, pl_module):
        self.calls += 1


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph"])
def test_a_callback_that_counts_inside_the_step_counts_every_step_as_eager(variant):
    counters: list[BackwardCounter] = []

    def counting() -> list[pl.Callback]:
        counters.append(BackwardCounter())
        return [counters[-1]]

    expected = run_case(Case(Constant, callbacks=counting), None)
    outcome = run_case(Case(Constant, callbacks=counting), variant)
    assert counters[1].calls == counters[0].calls, "the callback's hook ran once at capture, not every step"
    assert_same_training(expected, outcome)
    report = outcome.report
    if variant == "cudagraph_full":
        assert report.stage == Stage.DISABLED and "BackwardCounter.calls" in report.reason, report.reason
    else:
        assert report.stage == Stage.REPLAYING and report.level != "full_iteration", report.ladder

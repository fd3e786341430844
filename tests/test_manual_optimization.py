"""Manual optimization (``automatic_optimization = False``) against the same fit without the package.

With manual optimization ``training_step`` calls ``manual_backward`` and the optimizers itself, so gradients may
accumulate across steps at any time, several optimizers may take turns (``toggle_optimizer``), and one step may run
backward more than once. Each case below is a user's module as Lightning documents it, trained under
``strategy=CUDAGraphStrategy()`` (``scope="auto"``), the whole step (``scope=["full_iteration"]``) and
``scope=["layer"]`` on the strict fake backend and compared with the same fit without the package: losses, logged
values, parameters and the optimizer steps Lightning counted. A run either trains on graphs equal to eager, or trains
eagerly and says why; the climb of ``scope="auto"`` never trains a wrong step at a level it leaves. The whole step
holds ``training_step`` with its ``manual_backward``, clipping and optimizer calls, and refuses, before any replay,
the Python it cannot hold: a branch on ``batch_idx``, a scheduler stepped inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import LEVEL_MS, graph_callback, parameters_of, timed_by_level, trainer
from tests.models import TINY, TINY_DATA, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: Optimizer steps (Lightning's ``max_steps`` counts them under manual optimization too): enough for
#: ``scope="auto"`` to climb its levels and settle.
STEPS = 48
#: Rounding of the fake backend's replays against eager stays far below this; a gradient lost or doubled does not.
TOLERANCE = 1e-4


# =================================================================== the users' modules
class Manual(DecoderModule):
    """The control: one optimizer, one backward and one optimizer step per training step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        self.log("train_loss", loss)
        return loss


class ManualAccumulation(Manual):
    """Lightning's documented manual accumulation: ``manual_backward`` every step, the optimizer every second one."""

    every = 2

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch) / self.every
        self.manual_backward(loss)
        if (batch_idx + 1) % self.every == 0:
            optimizer.step()
            optimizer.zero_grad()
        self.log("train_loss", loss)
        return loss


class ZeroedInPlace(Manual):
    """Gradients zeroed in place (``set_to_none=False``): ``param.grad`` keeps its tensor from step to step."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=False)
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss


class GeneratorAndCritic(Manual):
    """A GAN-like pair: the decoder generates, a critic scores token distributions; each has its optimizer.

    The generator's turn runs the decoder (the critic frozen by ``toggle_optimizer``); the critic's turn sees the
    generated distributions detached. Both clip their gradients by norm.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vocab = self.hparams.vocab_size
        self.critic = nn.Sequential(nn.Linear(vocab, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizers(self):
        lr = self.hparams.lr
        return torch.optim.AdamW(self.model.parameters(), lr=lr), torch.optim.AdamW(self.critic.parameters(), lr=lr)

    def training_step(self, batch, batch_idx):
        generator, critic = self.optimizers()
        x, y = batch
        self.toggle_optimizer(generator)
        logits = self(x)
        language = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        fake = logits.softmax(-1)
        generator_loss = language + 0.1 * F.softplus(-self.critic(fake)).mean()
        self.manual_backward(generator_loss)
        self.clip_gradients(generator, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        generator.step()
        generator.zero_grad()
        self.untoggle_optimizer(generator)

        self.toggle_optimizer(critic)
        real = self.real(y, logits.shape[-1])
        critic_loss = F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(fake.detach())).mean()
        self.manual_backward(critic_loss)
        self.clip_gradients(critic, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        critic.step()
        critic.zero_grad()
        self.untoggle_optimizer(critic)
        self.log("train_loss", generator_loss)
        return generator_loss

    def real(self, y: torch.Tensor, vocab: int) -> torch.Tensor:
        """The real tokens' distributions (one-hot rows), built without a host sync."""
        return torch.eye(vocab, device=y.device)[y]


class OneHotCritic(GeneratorAndCritic):
    """The pair, with ``F.one_hot``: on a CPU it checks its input on the host, which fails a capture mid-step."""

    def real(self, y: torch.Tensor, vocab: int) -> torch.Tensor:
        return F.one_hot(y, vocab).float()


class SchedulerInStep(Manual):
    """Lightning's documented manual scheduling: ``self.lr_schedulers().step()`` inside ``training_step``."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.lr_schedulers().step()
        return loss


class SchedulerAfterStep(SchedulerInStep):
    """The same schedule, stepped in ``on_train_batch_end``: outside the step, every step."""

    def training_step(self, batch, batch_idx):
        return Manual.training_step(self, batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lr_schedulers().step()


#: Calls of ``StepsButOnce.training_step`` in the current fit: Python state outside the modules, which no observation
#: sees.
_CALLS = [0]


class StepsButOnce(Manual):
    """Steps its optimizer on every call but the third (the whole step's capture after two warmup steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _CALLS[0] = 0

    def training_step(self, batch, batch_idx):
        _CALLS[0] += 1
        if _CALLS[0] != 3:
            return super().training_step(batch, batch_idx)
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.optimizers().zero_grad()
        return loss


class BackwardTwice(Manual):
    """Two forwards and two ``manual_backward`` calls per step (the second on the flipped sequences), one update."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        first = self.loss(batch)
        self.manual_backward(first)
        second = 0.5 * self.loss((x.flip(1), y.flip(1)))
        self.manual_backward(second)
        optimizer.step()
        optimizer.zero_grad()
        loss = first.detach() + second.detach()
        self.log("train_loss", loss)
        return loss


# =================================================================== what a user compares
class Observed(pl.Callback):
    """Each batch's loss and the logged ``train_loss``, as a user's monitor reads them."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


@dataclass
class Outcome:
    """What one fit left: per-batch losses and logged values, parameters, and the report."""

    losses: list[float]
    logged: list[float]
    params: dict[str, torch.Tensor]
    report: Any = None
    #: ``trainer.global_step`` at the end: the optimizer steps Lightning counted.
    steps: int = 0


def run(module: type[Manual], variant: str | None, scope: list[str] | None = None) -> Outcome:
    """Fit ``module`` eagerly (``variant=None``), under ``"cudagraph"`` (``scope="auto"``), ``"full"`` or ``"scoped"``.

    ``"full"`` is ``CUDAGraphStrategy(scope=["full_iteration"])``; ``"scoped"`` is a :class:`CUDAGraphCallback` with
    ``scope`` (``["layer"]`` unless given).
    """
    model, data = decoder(TINY, module, **TINY_DATA)
    observed = Observed()
    callbacks: list[pl.Callback] = [observed]
    options: dict[str, Any] = {}
    if variant == "cudagraph":
        strategy = CUDAGraphStrategy(warmup_steps=WARMUP)
        strategy.capture_backend = FakeBackend(step_ms=timed_by_level(LEVEL_MS))
        options["strategy"] = strategy
    elif variant == "full":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
        strategy.capture_backend = FakeBackend()
        options["strategy"] = strategy
    elif variant == "scoped":
        callback = CUDAGraphCallback(scope=scope or ["layer"], warmup_steps=WARMUP)
        callback.capture_backend = FakeBackend()
        callbacks.append(callback)
    fit = trainer(STEPS, callbacks, **options, **CPU)
    fit.fit(model, data)
    report = graph_callback(fit).report if variant is not None else None
    return Outcome(observed.losses, observed.logged, parameters_of(model), report, fit.global_step)


_EAGER: dict[type[Manual], Outcome] = {}


def eager(module: type[Manual]) -> Outcome:
    """The fit without the package, once per module."""
    if module not in _EAGER:
        _EAGER[module] = run(module, None)
    return _EAGER[module]


def assert_same_training(expected: Outcome, actual: Outcome) -> None:
    """Losses, logged values and parameters as without the package."""
    assert len(actual.losses) == len(expected.losses), "a different number of training steps"
    assert actual.steps == expected.steps, f"{actual.steps} optimizer steps counted, {expected.steps} eagerly"
    for name, values in (("loss", (expected.losses, actual.losses)), ("logged", (expected.logged, actual.logged))):
        off = [i for i, (a, b) in enumerate(zip(*values, strict=True)) if abs(a - b) >= TOLERANCE]
        assert not off, f"{name} off eager from step {off[0]}: {values[0][off[0]]} eager, {values[1][off[0]]} here"
    worst = max(float((expected.params[k] - actual.params[k]).abs().max()) for k in expected.params)
    assert worst < TOLERANCE, f"parameters off eager by {worst:.3g}"


def assert_graphs_or_a_reason(report: Any) -> None:
    """Either replaying, or graphs off with the reason why: never graphs off without one."""
    replaying = report.stage == Stage.REPLAYING and report.replays > 0
    assert replaying or (report.stage == Stage.DISABLED and report.reason), f"graphs off without a reason: {report}"


CASES = {
    "control": Manual,
    "accumulation": ManualAccumulation,
    "zeroed_in_place": ZeroedInPlace,
    "two_optimizers": GeneratorAndCritic,
    "backward_twice": BackwardTwice,
}


# =================================================================== the tests
@pytest.mark.parametrize("name", list(CASES))
def test_a_layer_scope_trains_as_eager(name):
    module = CASES[name]
    outcome = run(module, "scoped")
    assert_same_training(eager(module), outcome)
    assert_graphs_or_a_reason(outcome.report)
    if module is not BackwardTwice:
        assert outcome.report.stage == Stage.REPLAYING and outcome.report.rollbacks == 0, outcome.report.reason


@pytest.mark.parametrize("name", list(CASES))
def test_scope_auto_never_trains_a_wrong_step_on_its_climb(name):
    module = CASES[name]
    outcome = run(module, "cudagraph")
    # Parameters equal eager at the end: no level tried on the way trained a wrong step, kept or left.
    assert_same_training(eager(module), outcome)
    report = outcome.report
    assert_graphs_or_a_reason(report)
    if module is ManualAccumulation:  # the optimizer steps every second batch: a whole step would freeze the choice
        assert report.level != "full_iteration", report.ladder
        assert any(row.level == "full_iteration" and "batch_idx" in (row.reason or "") for row in report.ladder)
    else:  # the fake times the whole step fastest, as on the GPU
        assert report.level == "full_iteration", report.ladder
    if module is not BackwardTwice:
        assert report.stage == Stage.REPLAYING and report.level is not None, report.ladder


def test_two_forwards_in_a_step_run_their_second_calls_eagerly_and_say_why():
    report = run(BackwardTwice, "scoped").report
    reasons = " ".join([report.reason or "", *report.fallback_reasons])
    assert "2 times" in reasons or "called_again" in reasons, reasons


@pytest.mark.parametrize("name", list(CASES))
def test_the_whole_step_holds_a_manual_step_and_trains_as_eager(name):
    module = CASES[name]
    outcome = run(module, "full")
    assert_same_training(eager(module), outcome)
    report = outcome.report
    if module is ManualAccumulation:  # refused from the observed warmup steps, before any capture
        assert report.stage == Stage.DISABLED and report.replays == 0, report
        assert report.reason.startswith("rollback: step_python") and "batch_idx" in report.reason, report.reason
    else:
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
        assert report.replays > outcome.steps // 3, report  # most steps replayed, not a few before a fallback


def test_a_whole_step_capture_that_fails_between_the_toggles_gives_the_parameters_back():
    """The critic's ``F.one_hot`` syncs on a CPU: the capture fails after ``toggle_optimizer(critic)``."""
    outcome = run(OneHotCritic, "full")
    assert_same_training(eager(OneHotCritic), outcome)
    report = outcome.report
    assert report.stage == Stage.DISABLED and report.reason.startswith("rollback: capture_failed"), report.reason
    assert report.replays == 0


def test_a_scheduler_stepped_inside_a_manual_step_is_refused_and_its_fix_replays_as_eager():
    refused = run(SchedulerInStep, "full")
    assert_same_training(eager(SchedulerInStep), refused)
    report = refused.report
    assert report.replays == 0 and report.stage == Stage.DISABLED, report
    assert "stepped LambdaLR" in report.reason and "on_train_batch_end" in report.reason, report.reason
    # The fix its reason names: the rate changes every step, and the replays read it from the device.
    fixed = run(SchedulerAfterStep, "full")
    assert_same_training(eager(SchedulerAfterStep), fixed)
    assert fixed.report.stage == Stage.REPLAYING and fixed.report.replays > fixed.steps // 3, fixed.report.reason
    scheduled, constant = eager(SchedulerAfterStep).params, eager(Manual).params
    assert any(not torch.equal(scheduled[k], constant[k]) for k in constant)  # the schedule changed the training


def test_a_manual_step_that_steps_no_optimizer_at_its_capture_is_refused():
    """A replay of that capture would train nothing: refused before any replay, with the reason."""
    report = run(StepsButOnce, "full").report
    assert report.replays == 0 and report.stage == Stage.DISABLED, report
    assert report.reason.startswith("rollback: skipped_step") and "stepped no optimizer" in report.reason, report.reason

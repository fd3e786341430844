"""Values a graph read, changed between steps: each run trains as the same fit without the package, step by step.

A graph bakes in each Python value its code read at capture. Lightning code changes such values between steps all
the time: a learning rate written by hand (Lightning's documented warm-up in ``optimizer_step``, or a callback), a
module's temperature, a flag, ``self.hparams``, a module-level dict of settings, the Trainer's clipping value. Each
case is trained eagerly and through ``cudagraph_full``, ``strategy="cudagraph"`` and ``scope=["layer"]`` on the
strict fake backend, which like CUDA runs no Python at a replay. A run trains on graphs equal to eager, or acts before
the first replay that would differ (a fed value, or a guard that rolls back with the value and the line that read
it): it never trains a wrong step, not even one that a later audit would catch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_cudagraph import CUDAGraphStrategy, Stage
from lightning_cudagraph._trust.guards import GuardSet
from tests.fake_backend import FakeBackend
from tests.helpers import graph_callback, trainer
from tests.models import TINY, TINY_DATA, DecoderModule, decoder
from tests.test_step_python import CPU, STEPS, Case, Flagged, Observed, assert_same_training, run_case

#: The step the callbacks below change a value at: mid-epoch (16 batches an epoch), after the captures.
CHANGE_AT = 9
#: The learning rate the warm-ups below ramp up to.
BASE_LR = 2e-3
#: Steps of warm-up: the rate moves on every step the graphs replay.
WARMUP_STEPS = 40


def warmed_up(step: int) -> float:
    return BASE_LR * min(1.0, (step + 1) / WARMUP_STEPS)


# =================================================================== the users' modules
class WarmupInOptimizerStep(DecoderModule):
    """Lightning's documented warm-up: override ``optimizer_step``, step, then write the param groups' ``lr``."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < WARMUP_STEPS:
            for pg in optimizer.param_groups:
                pg["lr"] = warmed_up(self.trainer.global_step)


class WarmupAtBatchStart(DecoderModule):
    """The rate written in the module's own ``on_train_batch_start``."""

    def on_train_batch_start(self, batch, batch_idx):
        for pg in self.trainer.optimizers[0].param_groups:
            pg["lr"] = warmed_up(self.trainer.global_step)


class Tempered(nn.Module):
    """A submodule whose forward reads a Python float: ``inner(x) / temperature``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.temperature = inner, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) / self.temperature


class TemperedMLP(DecoderModule):
    """The second block's MLP divided by a temperature, inside a captured layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        block = self.model.blocks[1]
        block.mlp = Tempered(block.mlp)


class HparamWeight(DecoderModule):
    """A loss weight read from ``self.hparams``."""

    def __init__(self, *args: Any, aux_weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = self.weighted(self.loss(batch))
        self.log("train_loss", loss)
        return loss

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:  # the value is read in a method the step calls
        return self.hparams.aux_weight * loss


#: Settings a user keeps at module level and reads in the step.
SETTINGS = {"scale": 1.0}


class GlobalSettings(DecoderModule):
    """A loss scale read from a module-level dict."""

    def training_step(self, batch, batch_idx):
        loss = SETTINGS["scale"] * self.loss(batch)
        self.log("train_loss", loss)
        return loss


# =================================================================== callbacks that change a value between steps
class WarmupCallback(pl.Callback):
    """A callback writes the param groups' ``lr`` as a number every step, without a scheduler."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for pg in trainer.optimizers[0].param_groups:
            pg["lr"] = warmed_up(trainer.global_step)


class SetAt(pl.Callback):
    """At :data:`CHANGE_AT`, before the step: ``change(trainer, pl_module)``."""

    def __init__(self, change: Any) -> None:
        self.change = change

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == CHANGE_AT:
            self.change(trainer, pl_module)


def _set_temperature(trainer: pl.Trainer, module: Any) -> None:
    module.model.blocks[1].mlp.temperature = 2.0


def _set_flag(trainer: pl.Trainer, module: Any) -> None:
    module.l2 = True


def _set_hparam(trainer: pl.Trainer, module: Any) -> None:
    module.hparams.aux_weight = 0.25


def _set_global(trainer: pl.Trainer, module: Any) -> None:
    SETTINGS["scale"] = 0.25


def _set_clipping(trainer: pl.Trainer, module: Any) -> None:
    trainer.gradient_clip_val = 1e-3


def _reset_settings(model: Any) -> float:
    scale, SETTINGS["scale"] = SETTINGS["scale"], 1.0
    return scale


#: Cases whose value is fed to the graph: the whole step keeps its graphs.
FED = {
    "warmup_in_optimizer_step": Case(WarmupInOptimizerStep, options={"lr": BASE_LR}),
    "warmup_by_callback": Case(DecoderModule, callbacks=lambda: [WarmupCallback()], options={"lr": BASE_LR}),
    "warmup_at_batch_start": Case(WarmupAtBatchStart, options={"lr": BASE_LR}),
}
#: Cases whose value a replay cannot read: guarded.
GUARDED = {
    "submodule_attribute": Case(TemperedMLP, callbacks=lambda: [SetAt(_set_temperature)]),
    "flag_mid_epoch": Case(Flagged, callbacks=lambda: [SetAt(_set_flag)], state=lambda model: model.l2),
    "hparams": Case(HparamWeight, callbacks=lambda: [SetAt(_set_hparam)]),
    "module_level_dict": Case(GlobalSettings, callbacks=lambda: [SetAt(_set_global)], state=_reset_settings),
    "trainer_clipping": Case(  # clips from the start, then tightens it
        DecoderModule, callbacks=lambda: [SetAt(_set_clipping)], trainer_options={"gradient_clip_val": 1.0}
    ),
}
CASES = {**FED, **GUARDED}


def run(name: str, variant: str | None, cuda: bool = False) -> Any:
    """Fit case ``name`` eagerly (``variant=None``) or through the package: on the fake backend, or on a GPU."""
    SETTINGS["scale"] = 1.0
    return run_case(CASES[name], variant, cuda)


_EAGER: dict[tuple[str, bool], Any] = {}


def eager(name: str, cuda: bool = False) -> Any:
    """The fit without the package, once per case and device."""
    if (name, cuda) not in _EAGER:
        _EAGER[name, cuda] = run(name, None, cuda)
    return _EAGER[name, cuda]


def check_never_trains_a_wrong_step(name: str, variant: str, cuda: bool = False) -> Any:
    """Case ``name`` through ``variant`` trains as eager, on graphs or eagerly with a reason; no audit had to act."""
    outcome = run(name, variant, cuda)
    assert_same_training(eager(name, cuda), outcome)
    report = outcome.report
    on_graphs = report.stage in (Stage.CONFIRMING, Stage.REPLAYING) and report.replays > 0
    assert on_graphs or (report.stage == Stage.DISABLED and report.reason), "graphs off without a reason"
    audits_caught = [reason for reason in report.rollback_reasons if reason.startswith("parity")]
    assert not audits_caught, f"an audit caught what a guard should have, after wrong steps: {audits_caught}"
    return report


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph", "layer"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_value_changed_between_steps_never_trains_a_wrong_step(name, variant):
    report = check_never_trains_a_wrong_step(name, variant)
    if variant == "cudagraph":
        assert report.stage == Stage.REPLAYING, f"graphs given up where a scoped level holds: {report.reason}"


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph"])
@pytest.mark.parametrize("name", list(FED))
def test_a_learning_rate_written_by_hand_keeps_the_whole_step(name, variant):
    report = run(name, variant).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
    assert variant == "cudagraph_full" or report.level == "full_iteration", report.ladder


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("submodule_attribute", r"model\.blocks\.1\.mlp\.temperature changed from 1\.0 to 2\.0.*inner\(x\) / self"),
        ("flag_mid_epoch", r"l2 changed from False to True.*if self\.l2"),
        ("hparams", r"hparams\['aux_weight'\] changed from 1\.0 to 0\.25.*self\.hparams\.aux_weight"),
        ("module_level_dict", r"SETTINGS changed.*'scale', 1\.0.*'scale', 0\.25.*SETTINGS\[\"scale\"\]"),
        ("trainer_clipping", r"Trainer\.gradient_clip_val changed from 1\.0 to 0\.001"),
    ],
)
def test_a_guard_names_the_value_and_the_line_that_read_it_before_the_replay(name, named):
    outcome = run(name, "cudagraph_full")
    assert outcome.report.stage == Stage.DISABLED
    reason = outcome.report.reason
    assert pytest.importorskip("re").search(named, reason), reason
    assert reason.startswith("rollback: step_python:") and "Fix:" in reason, reason


def test_the_regions_guard_what_their_forward_reads_and_only_that():
    """Under ``scope=["layer"]`` a temperature inside a layer is guarded; the step's own flag runs eagerly."""
    flag = run("flag_mid_epoch", "layer").report
    assert flag.stage == Stage.REPLAYING and flag.rollbacks == 0, flag.reason
    tempered = run("submodule_attribute", "layer").report
    assert tempered.stage == Stage.DISABLED and "temperature changed" in tempered.reason, tempered.reason


def test_the_write_log_is_gone_after_the_fit():
    setattr_before = torch.nn.Module.__setattr__
    run("submodule_attribute", "cudagraph_full")
    run("flag_mid_epoch", "layer")
    assert torch.nn.Module.__setattr__ is setattr_before


def test_a_value_written_back_unchanged_is_not_a_change():
    net = nn.Sequential(nn.Linear(2, 2), Tempered(nn.Linear(2, 2)))
    guards = GuardSet("the regions", list(net.named_modules()))
    try:
        net[1].temperature = 1.0
        assert guards.problem() is None
        net[1].temperature = 3.0
        assert "temperature changed from 1.0 to 3.0" in (guards.problem() or "")
    finally:
        guards.release()


def test_a_container_changed_in_place_is_a_change():
    net = Tempered(nn.Linear(2, 2))
    net.temperature = [1.0, 2.0]  # type: ignore[assignment]
    guards = GuardSet("the regions", [("", net)])
    try:
        net.temperature.append(3.0)  # type: ignore[attr-defined]
        assert "temperature changed" in (guards.problem() or "")
    finally:
        guards.release()


def test_a_scoped_fit_under_the_callback_trains_the_warmup_as_eager():
    """The optimizer graph of a scoped level takes the hand-written rate too (``CUDAGraphCallback`` with a strategy)."""
    case = FED["warmup_by_callback"]
    expected = eager("warmup_by_callback")
    model, data = decoder(TINY, case.module, **{**TINY_DATA, **case.options})
    strategy = CUDAGraphStrategy(scope=["layer"], warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    observed = Observed()
    fit = trainer(STEPS, [observed, *case.callbacks()], strategy=strategy, **CPU)
    fit.fit(model, data)
    report = graph_callback(fit).report
    assert report.optimizer_replays > 0 and report.rollbacks == 0, report.reason
    off = [i for i, (a, b) in enumerate(zip(expected.losses, observed.losses, strict=True)) if abs(a - b) >= 1e-4]
    assert not off, f"losses off eager from step {off[0]}"


def test_the_guards_are_unused_without_a_change():
    """A fit where nothing changes replays every step with no rollback, under each variant."""
    for variant in ("cudagraph_full", "layer"):
        report = run_case(Case(DecoderModule), variant).report
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason


# =================================================================== evaluation graphs
class TemperedValidation(DecoderModule):
    """``validation_step`` divides its loss by a temperature that a callback changes before each validation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.val_temperature = 1.0

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch) / self.val_temperature)


class AnnealBeforeValidation(pl.Callback):
    def on_validation_start(self, trainer, pl_module):
        pl_module.val_temperature = 1.0 + trainer.global_step / 4


@pytest.mark.parametrize("variant", ["whole_step", "scoped"])
def test_evaluation_graphs_are_captured_again_when_a_value_their_code_read_changed(tmp_path, variant):
    from tests.test_evaluation import VAL, interleaved, scoped, val_losses, whole_step

    eager = interleaved(tmp_path, "eager", callbacks=[AnnealBeforeValidation()])
    eager.fit(*decoder(TINY, TemperedValidation, **VAL))
    backend = FakeBackend()
    way = {"strategy": whole_step(backend)} if variant == "whole_step" else {}
    extra = [scoped(backend)] if variant == "scoped" else []
    run = interleaved(tmp_path, variant, callbacks=[AnnealBeforeValidation(), *extra], **way)
    run.fit(*decoder(TINY, TemperedValidation, **VAL))
    assert val_losses(run) == pytest.approx(val_losses(eager), rel=1e-4)
    assert graph_callback(run).report.evaluation.captures > 1, "no evaluation graph was captured again"

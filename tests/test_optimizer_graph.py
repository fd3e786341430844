"""The optimizer step of a scoped fit as its own graph, on a CPU through the fake capture backend.

A scoped level through the package's strategy captures the optimizer's update once, checks its first replays against
the eager update from the same state, replays it after each eager backward, falls back for a step whose gradients
are not the capture's, rolls back when a baked-in setting moves, and gives the optimizer back on every exit.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from lightning_cudagraph._backend.backend import StepGraph
from tests.fake_backend import FakeBackend
from tests.helpers import (
    RaiseAtStep,
    StepHookedAt,
    assert_losses_close,
    dense_audits,
    fit,
    graph_callback,
    max_param_diff,
    trainer,
)
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
STEPS = 8
WARMUP = 2
CONFIRM = 2  # confirm_steps' default
#: Fused (graphed) against foreach (eager) AdamW on the CPU: the same update up to float rounding.
TOL = 1e-5


def scoped(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    """``cudagraph_layer`` whose captures go to a fake backend."""
    strategy = CUDAGraphStrategy(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


def optimizer_graphs(backend: FakeBackend) -> list:
    """The step graphs the fake captured: a scoped fit captures only the optimizer's update as one."""
    return backend.step_graphs


def assert_optimizer_given_back(model: pl.LightningModule, backend: FakeBackend) -> None:
    optimizer = model.trainer.optimizers[0] if model._trainer is not None else None
    assert optimizer is not None
    group = optimizer.param_groups[0]
    assert isinstance(group["lr"], float), "the learning rate is a number again"
    assert group.get("capturable", False) is False and group.get("fused") is None, "the optimizer's own flags are back"
    assert "step" not in vars(optimizer), "optimizer.step is the class's again"
    assert backend.live_graphs == 0, "a graph was not reset"
    assert backend.optimizers and all(prepared.restored for prepared in backend.optimizers)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_update_is_captured_confirmed_and_replayed_at_eager_parity(optimizer):
    backend = FakeBackend()
    eager = fit(*decoder(TINY, optimizer=optimizer), STEPS, **CPU)
    run = fit(*decoder(TINY, optimizer=optimizer), STEPS, strategy=scoped(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0
    assert report.optimizer_graph == "replaying"
    [graph] = optimizer_graphs(backend)
    assert graph.replays == STEPS - WARMUP == report.optimizer_replays  # the capture step's shadow replay included
    # Each check counts: the update's confirmation (its first updates), the regions' (their forwards on the first
    # step), then the audits of both kinds, each starting dense.
    audits = CONFIRM + 1 + 2 * dense_audits(STEPS - WARMUP - CONFIRM, 1000)
    assert report.audits == audits and report.optimizer_parity_err <= 1e-5
    assert report.metrics()["cudagraph/optimizer_graph"] == 2.0
    assert_losses_close(eager.losses, run.losses, TOL)
    assert max_param_diff(eager.params, run.params) < TOL
    assert_optimizer_given_back(run.model, backend)


def test_without_the_optimizer_graph_or_without_the_strategy_the_update_stays_eager():
    backend = FakeBackend()
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = backend
    alone = fit(*decoder(TINY), STEPS, [callback], **CPU)
    assert callback.report.stage == Stage.REPLAYING
    assert callback.report.optimizer_graph is None and "cudagraph/optimizer_graph" not in callback.report.metrics()

    off = FakeBackend()
    run = fit(*decoder(TINY), STEPS, strategy=scoped(off, optimizer_graph=False), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.optimizer_graph == "optimizer_graph=False"
    assert report.metrics()["cudagraph/optimizer_graph"] == -1.0
    assert off.step_graphs == [] and off.optimizers == []
    assert_losses_close(alone.losses, run.losses, 1e-6)


class WrongUpdate(FakeBackend):
    """Captures an update that also moves the first parameter (a graph that reads a wrong buffer does as much)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def capture_step(self, body: Callable[[], None]) -> StepGraph:
        first = next(self.model.parameters())

        def wrong() -> None:
            body()
            with torch.no_grad():
                first.add_(0.01)

        return super().capture_step(wrong)


def test_a_wrong_optimizer_graph_rolls_back_at_its_first_check_and_never_trains():
    eager = fit(*decoder(TINY), STEPS, **CPU)
    model, data = decoder(TINY)
    backend = WrongUpdate(model)
    with pytest.warns(UserWarning, match="rolled back to eager training: optimizer_parity"):
        run = fit(model, data, STEPS, strategy=scoped(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.rollbacks == 1
    assert report.rollback_reasons[0].startswith("optimizer_parity: ")
    assert report.optimizer_parity_err > 1e-3
    assert_losses_close(eager.losses, run.losses, TOL)  # the eager update was kept: no step trained on the graph
    assert max_param_diff(eager.params, run.params) < TOL
    assert_optimizer_given_back(run.model, backend)


def test_a_wrong_optimizer_graph_raises_with_on_failure_raise():
    model, data = decoder(TINY)
    backend = WrongUpdate(model)
    with pytest.raises(RuntimeError, match=r"on_failure='raise'.*optimizer_parity"):
        trainer(STEPS, strategy=scoped(backend, on_failure="raise"), **CPU).fit(model, data)
    assert_optimizer_given_back(model, backend)


class SometimesUnused(DecoderModule):
    """A parameter that only even batches use: on odd batches its gradient is ``None`` (``zero_grad`` set it so)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = nn.Parameter(torch.full((), 0.5))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if batch_idx % 2 == 0:
            loss = loss + self.offset**2
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize(
    ("warmup", "detail"),
    [(WARMUP, "no gradient for ['offset']"), (WARMUP + 1, "a gradient for ['offset'], which had none at capture")],
    ids=["used-at-capture", "unused-at-capture"],
)
def test_a_step_whose_parameter_has_no_gradient_runs_the_eager_update_counted(warmup, detail):
    eager = fit(*decoder(TINY, SometimesUnused, weight_decay=0.1), STEPS, **CPU)
    backend = FakeBackend()
    strategy = scoped(backend, warmup_steps=warmup)
    run = fit(*decoder(TINY, SometimesUnused, weight_decay=0.1), STEPS, strategy=strategy, **CPU)

    report = graph_callback(run.trainer).report
    assert report.rollbacks == 0 and report.optimizer_graph == "replaying"
    fallbacks = {reason: n for reason, n in report.fallback_reasons.items() if reason.startswith("optimizer_grads")}
    [(reason, count)] = fallbacks.items()
    assert detail in reason
    other_steps = len([step for step in range(warmup, STEPS) if step % 2 != warmup % 2])  # capture on step `warmup`
    assert count == other_steps
    assert report.optimizer_replays == STEPS - warmup - other_steps
    # A stale gradient (or weight decay from the graph) would have moved offset on the steps without one.
    assert abs(float(eager.params["offset"]) - float(run.params["offset"])) < TOL
    assert_losses_close(eager.losses, run.losses, TOL)
    assert max_param_diff(eager.params, run.params) < TOL


class SetAt(pl.Callback):
    """At the start of the given steps, sets a hyperparameter of the first param group."""

    def __init__(self, key: str, values: Callable[[int], object | None]) -> None:
        self.key, self.values = key, values

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        value = self.values(trainer.global_step)
        if value is not None:
            trainer.optimizers[0].param_groups[0][self.key] = value


def test_a_setting_the_graph_baked_in_that_moves_rolls_back_and_the_step_takes_it():
    change = SetAt("weight_decay", lambda step: 0.5 if step == WARMUP + 3 else None)
    eager = fit(*decoder(TINY), STEPS, [change], **CPU)
    backend = FakeBackend()
    with pytest.warns(UserWarning, match="optimizer_setting_changed"):
        run = fit(*decoder(TINY), STEPS, [change], strategy=scoped(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.rollbacks == 1
    assert report.rollback_reasons[0].startswith("optimizer_setting_changed: ")
    assert "after the optimizer graph was captured" in report.rollback_reasons[0]
    assert_losses_close(eager.losses, run.losses, TOL)
    assert max_param_diff(eager.params, run.params) < TOL  # the step of the change used the new weight decay
    assert_optimizer_given_back(run.model, backend)


def test_a_setting_that_moves_every_step_keeps_the_update_eager_and_the_regions_graphed():
    change = SetAt("betas", lambda step: (0.9 - 0.01 * step, 0.999))
    eager = fit(*decoder(TINY), STEPS, [change], **CPU)
    backend = FakeBackend()
    with pytest.warns(UserWarning, match="the optimizer step stays eager"):
        run = fit(*decoder(TINY), STEPS, [change], strategy=scoped(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0
    assert report.optimizer_graph.startswith("optimizer_not_graphed: ")
    assert "betas" in report.optimizer_graph
    assert backend.step_graphs == [] and report.metrics()["cudagraph/optimizer_graph"] == -1.0
    assert_losses_close(eager.losses, run.losses, TOL)


def test_a_step_wise_scheduler_reaches_the_graph_and_clipping_stays_in_the_eager_closure():
    clip = {"gradient_clip_val": 0.05}  # small enough to clip on every step
    eager = fit(*decoder(TINY, lr_step_size=2, lr_gamma=0.3), STEPS, **clip, **CPU)
    backend = FakeBackend()
    run = fit(*decoder(TINY, lr_step_size=2, lr_gamma=0.3), STEPS, strategy=scoped(backend), **clip, **CPU)

    report = graph_callback(run.trainer).report
    assert report.optimizer_replays == STEPS - WARMUP and report.rollbacks == 0
    optimizer = run.trainer.optimizers[0]
    assert getattr(vars(optimizer)["step"], "_wrapped_by_lr_sched", False), "the scheduler's own step wrapper is back"
    assert_losses_close(eager.losses, run.losses, TOL)
    assert max_param_diff(eager.params, run.params) < TOL  # a frozen lr would be off by the decays
    assert run.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        eager.trainer.optimizers[0].param_groups[0]["lr"]
    )


def test_an_exception_after_capture_releases_the_graph_and_gives_the_optimizer_back():
    backend = FakeBackend()
    model, data = decoder(TINY)
    with pytest.raises(RuntimeError, match="user error"):
        trainer(STEPS, [RaiseAtStep(WARMUP + 2)], strategy=scoped(backend), **CPU).fit(model, data)
    assert backend.step_graphs, "the update had been captured"
    assert_optimizer_given_back(model, backend)


class FailsInStep(DecoderModule):
    """``training_step`` raises at one step: inside the optimizer's replaced ``step`` (Lightning's closure)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == WARMUP + 2:
            raise RuntimeError("training_step failed")
        return super().training_step(batch, batch_idx)


def test_an_exception_inside_the_closure_puts_the_optimizer_step_back():
    backend = FakeBackend()
    model, data = decoder(TINY, FailsInStep)
    with pytest.raises(RuntimeError, match="training_step failed"):
        trainer(STEPS, strategy=scoped(backend), **CPU).fit(model, data)
    assert_optimizer_given_back(model, backend)


def test_a_failed_optimizer_capture_keeps_the_update_eager_and_the_regions_graphed():
    eager = fit(*decoder(TINY), STEPS, **CPU)
    backend = FakeBackend(fail_step=RuntimeError("capture broke"))
    with pytest.warns(UserWarning, match="its capture failed: RuntimeError: capture broke"):
        run = fit(*decoder(TINY), STEPS, strategy=scoped(backend), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0
    assert report.optimizer_graph.startswith("optimizer_not_graphed: its capture failed")
    assert_losses_close(eager.losses, run.losses, TOL)
    assert_optimizer_given_back(run.model, backend)


class ManualStep(DecoderModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_keeps_the_update_eager_with_the_reason():
    run = fit(*decoder(TINY, ManualStep), STEPS, strategy=scoped(), **CPU)
    report = graph_callback(run.trainer).report
    assert report.optimizer_graph == (
        "optimizer_not_graphed: manual optimization (training_step calls the optimizer itself)"
    )


def test_a_checkpoint_saved_mid_fit_holds_the_optimizer_as_built(tmp_path):
    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == WARMUP + 3:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    run = fit(*decoder(TINY), STEPS, [SaveAt()], strategy=scoped(), default_root_dir=tmp_path, **CPU)
    assert graph_callback(run.trainer).report.optimizer_graph == "replaying"
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False)["optimizer_states"][0]["param_groups"][0]
    assert isinstance(saved["lr"], float) and saved["capturable"] is False and saved["fused"] is None


def test_bf16_mixed_with_clipping_replays_the_update():
    # The optimizer becomes fused after it was built: Lightning's mixed-precision clipping still accepts it.
    options = {"precision": "bf16-mixed", "gradient_clip_val": 0.05, **CPU}
    eager = fit(*decoder(TINY), STEPS, **options)
    run = fit(*decoder(TINY), STEPS, strategy=scoped(), **options)
    report = graph_callback(run.trainer).report
    assert report.optimizer_graph == "replaying" and report.optimizer_replays == STEPS - WARMUP
    assert_losses_close(eager.losses, run.losses, 2e-2)


def test_optimizer_graph_must_be_a_bool():
    with pytest.raises(ValueError, match=r"optimizer_graph.*True or False"):
        CUDAGraphStrategy(scope=["layer"], optimizer_graph="off")


SKIPPED = "skipped_step: training_step returned None, so the update runs eagerly"


class _SkipsEveryThird(DecoderModule):
    """``training_step`` returns ``None`` on every third batch (Lightning's way to skip one), the capture's included."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == WARMUP else loss


def test_a_skipped_batch_runs_the_optimizer_step_as_eager_does_and_the_graph_serves_the_other_steps():
    eager, data = decoder(TINY, module=_SkipsEveryThird)
    skipping, _ = decoder(TINY, module=_SkipsEveryThird)
    backend = FakeBackend()
    trainer(STEPS + 4, **CPU).fit(eager, data)
    trainer(STEPS + 4, strategy=scoped(backend), **CPU).fit(skipping, data)

    report = graph_callback(skipping.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0
    assert report.optimizer_graph == "replaying" and report.optimizer_replays > 0
    assert report.fallback_reasons[SKIPPED] > 0
    params = {name: p.detach().clone() for name, p in skipping.named_parameters()}
    assert max_param_diff({n: p.detach() for n, p in eager.named_parameters()}, params) < TOL
    assert_optimizer_given_back(skipping, backend)


def test_a_step_hook_added_after_the_update_is_captured_rolls_back_naming_the_optimizer_graph():
    hooked_eager, hooked = StepHookedAt(WARMUP + 3), StepHookedAt(WARMUP + 3)
    eager = fit(*decoder(TINY), STEPS, [hooked_eager], **CPU)
    backend = FakeBackend()
    with pytest.warns(UserWarning, match="step_python"):
        run = fit(*decoder(TINY), STEPS, [hooked], strategy=scoped(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.rollbacks == 1
    reason = report.rollback_reasons[0]
    assert reason.startswith("step_python: ") and "since the optimizer graph was captured" in reason, reason
    assert "CUDAGraphCallback alone" in reason, "the fix keeps the optimizer step eager"
    assert hooked.calls == hooked_eager.calls == STEPS - WARMUP - 3, "the hook ran on every step, as in eager"
    assert_losses_close(eager.losses, run.losses, TOL)
    assert max_param_diff(eager.params, run.params) < TOL
    assert_optimizer_given_back(run.model, backend)

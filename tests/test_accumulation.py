"""Gradient accumulation inside the whole step, on a CPU, driven for real through the fake capture backend.

Every micro-batch of an accumulation window replays a graph of its own (first, middle, last): the fit must train,
count steps, step schedulers and log exactly as eager Lightning does, across partial windows at an epoch's end,
shape changes inside a window, and failures.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphStrategy, Stage
from lightning_cudagraph._graphs.accumulation import Place, Position
from tests.fake_backend import FakeBackend
from tests.helpers import (
    LossRecorder,
    assert_losses_close,
    fit,
    graph_callback,
    max_param_diff,
    parameters_of,
    trainer,
)
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
#: Ten batches of four per epoch: with four micro-batches per window, each epoch ends on a window of two.
DATA = {"batch_size": 4, "train_samples": 40, "lr_step_size": 2, "lr_gamma": 0.7}
TRAIN = {"gradient_clip_val": 0.5, "max_epochs": 3, **CPU}


def whole_step(backend: FakeBackend, **options) -> CUDAGraphStrategy:
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": 2, **options})
    strategy.capture_backend = backend
    return strategy


def last_lr(trainer: pl.Trainer) -> float:
    return float(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])


@pytest.mark.parametrize("accumulate", [2, 3, 4])
def test_every_micro_batch_replays_and_training_equals_eager(accumulate):
    eager = fit(*decoder(TINY, **DATA), -1, accumulate_grad_batches=accumulate, **TRAIN)
    backend = FakeBackend()
    run = fit(*decoder(TINY, **DATA), -1, strategy=whole_step(backend), accumulate_grad_batches=accumulate, **TRAIN)

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    places = 3 if accumulate > 2 else 2
    assert report.captures >= places, f"expected a graph per place in the window, got {report.captures}"
    # After capture, only the first window of each later epoch runs eagerly: it re-checks the step's Python.
    rechecks = run.trainer.current_epoch - 1
    assert report.steps_eager == rechecks * accumulate, report.fallback_reasons
    assert report.replays > len(eager.losses) // 3, "most micro-batches should replay"
    assert run.trainer.global_step == eager.trainer.global_step
    assert last_lr(run.trainer) == pytest.approx(last_lr(eager.trainer), rel=1e-6)  # a float32 tensor in the graph
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-5
    assert backend.live_graphs == 0 and not backend.entered


def test_accumulation_equals_eager_with_scope_auto():
    eager = fit(*decoder(TINY, **DATA), -1, accumulate_grad_batches=2, **TRAIN)
    strategy = CUDAGraphStrategy(scope="auto", warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    run = fit(*decoder(TINY, **DATA), -1, strategy=strategy, accumulate_grad_batches=2, **TRAIN)

    assert graph_callback(run.trainer).report.rollbacks == 0
    assert run.trainer.global_step == eager.trainer.global_step
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-5


@pytest.mark.parametrize("short", [4, 5, 7], ids=["first", "middle", "last"])
def test_a_micro_batch_of_another_shape_runs_eagerly_and_the_window_stays_right(short):
    model, data = decoder(TINY, **DATA)
    data.setup("fit")
    batches = list(data.train_dataloader())
    batches[short] = (batches[short][0][:2], batches[short][1][:2])  # a short micro-batch in the second window
    eager_model, _ = decoder(TINY, **DATA)

    def loader() -> DataLoader:
        return DataLoader(batches, batch_size=None)

    eager = fit(eager_model, loader(), -1, accumulate_grad_batches=4, **TRAIN)
    run = fit(model, loader(), -1, strategy=whole_step(FakeBackend()), accumulate_grad_batches=4, **TRAIN)

    report = graph_callback(run.trainer).report
    assert report.rollbacks == 0 and report.fallbacks > 0, "the short micro-batch should fall back, counted"
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-5


def test_a_failed_capture_of_a_later_micro_batch_rolls_back_and_training_stays_eager_exact():
    class FailSecondStepCapture(FakeBackend):
        def capture_step(self, body):
            if self.step_graphs:  # the first micro-batch's graph captured; the next capture fails
                raise RuntimeError("capture failed (injected)")
            return super().capture_step(body)

    eager = fit(*decoder(TINY, **DATA), -1, accumulate_grad_batches=4, **TRAIN)
    run = fit(
        *decoder(TINY, **DATA), -1, strategy=whole_step(FailSecondStepCapture()), accumulate_grad_batches=4, **TRAIN
    )

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and "capture_failed" in (report.reason or "")
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-5


class OwnOptimizerStep(DecoderModule):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


def test_an_overridden_optimizer_step_with_accumulation_is_refused_before_training():
    model, data = decoder(TINY, OwnOptimizerStep, **DATA)
    trainer = pl.Trainer(
        strategy=whole_step(FakeBackend()), accumulate_grad_batches=2, max_steps=4, logger=False, **CPU
    )
    with pytest.raises(ValueError, match="optimizer_step") as error:
        trainer.fit(model, datamodule=data)
    assert "Fix:" in str(error.value) and trainer.global_step == 0


@pytest.mark.parametrize(
    ("index", "accumulate", "last", "place"),
    [
        (0, 1, False, Place.SINGLE),
        (0, 4, False, Place.FIRST),
        (2, 4, False, Place.MIDDLE),
        (3, 4, False, Place.LAST),
        (9, 4, True, Place.LAST),  # an epoch's last batch steps, whatever the window
        (8, 4, True, Place.SINGLE),
    ],
)
def test_positions_follow_lightnings_rule(index, accumulate, last, place):
    assert Position.at(index, accumulate, last).place is place


def test_the_strategy_hands_micro_batches_to_the_whole_step_only_when_one_is_planned():
    eager_only = CUDAGraphStrategy(scope=["layer"])
    eager_only.capture_backend = FakeBackend()
    run = fit(*decoder(TINY, **DATA), 6, strategy=eager_only, accumulate_grad_batches=2, **CPU)
    assert not run.trainer.strategy.handles_gradient_accumulation
    assert torch.isfinite(torch.tensor(run.losses)).all()


class LogsEveryWay(DecoderModule):
    """Logs the loss on step and as an epoch mean, and a non-finite check's input: the loss itself."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("loss_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


def test_logged_values_from_replayed_micro_batches_equal_eager(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    def run(strategy):
        model, data = decoder(TINY, LogsEveryWay, **DATA)
        logger = CSVLogger(tmp_path, name=str(strategy is None))
        options = {} if strategy is None else {"strategy": strategy}
        fitted = fit(model, data, -1, accumulate_grad_batches=4, logger=logger, log_every_n_steps=1, **options, **TRAIN)
        return fitted.trainer

    eager, graphed = run(None), run(whole_step(FakeBackend()))

    assert graph_callback(graphed).report.replays > 0
    for key in ("train_loss_step", "train_loss_epoch", "loss_sum"):
        assert float(graphed.callback_metrics[key]) == pytest.approx(float(eager.callback_metrics[key]), abs=1e-6)
    rows = [(Path(t.logger.log_dir) / "metrics.csv").read_text().splitlines() for t in (eager, graphed)]
    assert len(rows[0]) == len(rows[1]), "the graphed fit logged a different number of rows"


def test_validation_between_windows_then_an_eager_micro_batch_keeps_the_window_right():
    # Lightning sets every .grad to None before validation; the next window's first replay must point them back,
    # or the eager micro-batch after it would start new gradients that the window's last graph never reads.
    model, data = decoder(TINY, **DATA)
    data.setup("fit")
    batches = list(data.train_dataloader())
    batches[5] = (batches[5][0][:2], batches[5][1][:2])  # right after the validation that follows batch 3
    eager_model, _ = decoder(TINY, **DATA)
    validation = {"limit_val_batches": 2, "val_check_interval": 4, "num_sanity_val_steps": 0}

    def fitted(module, **options):
        losses = LossRecorder()
        run = trainer(-1, [losses], accumulate_grad_batches=4, **validation, **options, **TRAIN)
        run.fit(module, DataLoader(batches, batch_size=None), data.val_dataloader())
        return losses.losses, parameters_of(module), run

    eager_losses, eager_params, _ = fitted(eager_model)
    losses, params, run = fitted(model, strategy=whole_step(FakeBackend()))

    assert graph_callback(run).report.rollbacks == 0 and graph_callback(run).report.replays > 0
    assert_losses_close(eager_losses, losses, 1e-6)
    assert max_param_diff(eager_params, params) < 1e-5


class _Writes:
    """A stand-in for a CUDA graph whose replay writes the next value into a buffer (as a backward graph does)."""

    def __init__(self, buffer: torch.Tensor, values: list[float]) -> None:
        self.buffer, self.values = buffer, iter(values)

    def replay(self) -> None:
        self.buffer.fill_(next(self.values))


@pytest.mark.parametrize("copies", [True, False])
def test_accumulated_parameter_gradients_survive_the_next_backward_replay(copies):
    # Under accumulation a region's backward hands autograd copies of its gradient buffers: the first micro-batch's
    # gradient is adopted as param.grad, and the next replay rewrites the buffer before autograd adds to it.
    from lightning_cudagraph._backend.local import GraphedRegion, _GraphedCall

    weight = torch.nn.Parameter(torch.zeros(3))
    weight_grad = torch.zeros(3)
    region = GraphedRegion(
        name="block", module=torch.nn.Identity(), signature=None, params=(weight,),  # type: ignore[arg-type]
        static_inputs=(torch.zeros(3),), static_outputs=(torch.zeros(3),), output_leaves=[None],
        output_spec=None, output_positions=(0,), differentiable=(True,),  # type: ignore[arg-type]
        static_grad_outputs=(torch.zeros(3),), static_grad_inputs=(torch.zeros(3), weight_grad),
        fwd_graph=_Writes(torch.zeros(3), [0.0, 0.0]), bwd_graph=_Writes(weight_grad, [2.0, 5.0]),  # type: ignore[arg-type]
        copy_param_grads=copies,
    )  # fmt: skip
    for _ in range(2):  # two micro-batches
        (output,) = _GraphedCall.apply(region, torch.ones(3, requires_grad=True), weight)
        output.sum().backward()

    assert weight.grad is not None
    if copies:
        assert weight.grad.tolist() == [7.0] * 3, "the sum of both micro-batches' gradients"
        assert weight.grad.data_ptr() != weight_grad.data_ptr()
    else:  # what the copies prevent: the adopted buffer was rewritten, then added to itself
        assert weight.grad.tolist() == [10.0] * 3

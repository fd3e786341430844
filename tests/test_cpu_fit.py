"""Short CPU fits: without CUDA the package trains eagerly, says so once, and leaves no trace on the model.

Every fit here is a few optimizer steps of a tiny GPT (2 layers, width 32), so the whole file runs in seconds.
Configuration errors that need the Trainer (scopes that match nothing, ``full_iteration`` with the wrong Trainer
settings, activation checkpointing inside a target) must be raised at ``fit`` before the first training step, on
a CPU as on a GPU. The graphed lifecycle on a CPU (capture, replay, rollback, release, resume) runs through the
fake capture backend in ``tests/test_lifecycle_*.py``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import LossRecorder, RaiseAtStep, StepCounter, cpu_trainer, graph_callback, trainer
from tests.models import TINY, TINY_DATA, decoder

MAX_STEPS = 6


class PlainModule(pl.LightningModule):
    """A model with no attention, MLP or layer modules: a plain ``nn.Sequential`` of ``Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator))
        return DataLoader(data, batch_size=4)


class LooseModule(PlainModule):
    """:class:`PlainModule` with a trainable scale of its own: no submodule holds every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x) * self.scale, y)


def plain_fit() -> tuple[pl.LightningModule, dict[str, Any]]:
    """:class:`PlainModule` and what its ``fit`` needs besides (nothing: it has its own loader)."""
    return PlainModule(), {}


def tiny_fit() -> tuple[pl.LightningModule, dict[str, Any]]:
    """The tiny decoder and its data module, as ``fit`` arguments."""
    model, data = decoder(TINY, **TINY_DATA)
    return model, {"datamodule": data}


def fit_recording_warnings(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(*args, **kwargs)
    return caught


def messages(caught: list[warnings.WarningMessage], word: str) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and word in str(w.message)]


def package_messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "CUDAGraph" in str(w.message) or "cudagraph" in str(w.message)]


# How a user turns the package on: a callback, or a Trainer strategy flag.
SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    "callback": lambda: {"callbacks": [CUDAGraphCallback()]},
    "strategy_layer": lambda: {"strategy": "cudagraph_layer"},
    "strategy_full": lambda: {"strategy": "cudagraph_full"},
}
SETUP_IDS = list(SETUPS)


# Validation inside the fit (sanity check, then every 3 steps), and a step-wise LR schedule, as a user would have.
WITH_VALIDATION = {"num_sanity_val_steps": 2, "val_check_interval": 3, "limit_val_batches": 2}
WITH_SCHEDULE = {"lr_step_size": 2}


def eager_reference(tmp_path: Any) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The same fit with plain Lightning: the losses and final weights the package must reproduce on a CPU."""
    (model, data), recorder = decoder(TINY, **TINY_DATA, **WITH_SCHEDULE), LossRecorder()
    trainer = cpu_trainer(tmp_path / "eager", MAX_STEPS, [recorder], **WITH_VALIDATION)
    trainer.fit(model, datamodule=data)
    return recorder.losses, model.state_dict(), float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_cpu_fit_trains_eagerly_with_one_no_cuda_warning(tmp_path, setup):
    expected_losses, expected_weights, expected_val_loss = eager_reference(tmp_path)

    (model, data), recorder = decoder(TINY, **TINY_DATA, **WITH_SCHEDULE), LossRecorder()
    options = SETUPS[setup]()
    callbacks = [*options.pop("callbacks", []), recorder]
    trainer = cpu_trainer(tmp_path / "graphs", MAX_STEPS, callbacks, **options, **WITH_VALIDATION)
    caught = fit_recording_warnings(trainer, model, datamodule=data)

    assert trainer.state.finished
    assert trainer.global_step == MAX_STEPS
    assert recorder.losses == expected_losses, "training on a CPU must be exactly eager training"
    assert float(trainer.callback_metrics["val_loss"]) == expected_val_loss
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected_weights[name]), f"{name} differs from the eager run"

    report = graph_callback(trainer).report
    assert report.stage == Stage.DISABLED
    assert report.reason == "no_cuda"
    assert (report.graphs, report.replays, report.rollbacks) == (0, 0, 0)
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_validate_test_predict_and_second_fit_work_after_fit(tmp_path, setup):
    model, data = decoder(TINY, **TINY_DATA)
    trainer = cpu_trainer(tmp_path, -1, max_epochs=1, limit_train_batches=3, limit_val_batches=None, **SETUPS[setup]())
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3

    val_loader = data.val_dataloader()
    assert "val_loss" in trainer.validate(model, dataloaders=val_loader, verbose=False)[0]
    assert "test_loss" in trainer.test(model, dataloaders=val_loader, verbose=False)[0]
    predictions = trainer.predict(model, dataloaders=val_loader)
    assert predictions[0].shape == (TINY_DATA["batch_size"], TINY["seq_len"], TINY["vocab_size"])
    with torch.no_grad():
        assert torch.equal(predictions[0], model.eval()(next(iter(val_loader))[0])), "predict is the plain forward"

    trainer.fit_loop.max_epochs = 2
    caught = fit_recording_warnings(trainer, model, datamodule=data)
    assert trainer.state.finished
    assert trainer.current_epoch == 2
    assert trainer.global_step == 6

    report = graph_callback(trainer).report
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_cuda")
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_resume_from_checkpoint_trains_on(tmp_path, setup):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    options = SETUPS[setup]()
    callbacks = [*options.pop("callbacks", []), checkpoint]
    trainer = cpu_trainer(tmp_path, 3, callbacks, enable_checkpointing=True, **options)
    trainer.fit(*decoder(TINY, **TINY_DATA))
    saved = torch.load(checkpoint.last_model_path, weights_only=False)
    assert graph_callback(trainer).state_key in saved["callbacks"], "the callback's counters travel in checkpoints"

    model, data = decoder(TINY, **TINY_DATA)
    resumed = cpu_trainer(tmp_path, MAX_STEPS, enable_checkpointing=True, **SETUPS[setup]())
    caught = fit_recording_warnings(resumed, model, datamodule=data, ckpt_path=checkpoint.last_model_path)

    assert resumed.state.finished
    assert resumed.global_step == MAX_STEPS
    report = graph_callback(resumed).report
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_cuda")
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)


def test_impl_none_turns_everything_off_without_warning(tmp_path):
    model, data = decoder(TINY, **TINY_DATA)
    callback = CUDAGraphCallback(impl="none")
    trainer = cpu_trainer(tmp_path, MAX_STEPS, [callback])
    caught = fit_recording_warnings(trainer, model, datamodule=data)

    assert trainer.global_step == MAX_STEPS
    assert callback.report.stage == Stage.DISABLED
    assert callback.report.reason == "impl_none"
    assert package_messages(caught) == []


def test_auto_scope_without_targets_warns_and_trains(tmp_path):
    model = LooseModule()
    trainer = cpu_trainer(tmp_path, MAX_STEPS, callbacks=[CUDAGraphCallback()])
    caught = fit_recording_warnings(trainer, model)

    assert trainer.state.finished
    assert trainer.global_step == MAX_STEPS
    report = graph_callback(trainer).report
    assert report.stage == Stage.DISABLED
    assert report.reason == "no_targets"
    warned = messages(caught, "no_targets")
    assert len(warned) == 1, package_messages(caught)
    assert "net" in warned[0], "the warning should name the model's modules so the user can pick some"
    assert messages(caught, "no_cuda") == [], "one warning says why graphs are off, not two"


def test_auto_through_the_callback_plans_the_models_submodules_on_a_model_without_regions(tmp_path):
    trainer = cpu_trainer(tmp_path, MAX_STEPS, callbacks=[CUDAGraphCallback()])
    caught = fit_recording_warnings(trainer, PlainModule())

    report = graph_callback(trainer).report
    assert [(row.level, row.status) for row in report.ladder][2:4] == [("layer", "skipped"), ("model", "planned")]
    assert report.scopes["model"] == ["net"]
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_cuda")  # on a GPU, net is captured
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)


def test_auto_through_the_strategy_still_has_the_whole_step_on_a_model_without_regions(tmp_path):
    trainer = cpu_trainer(tmp_path, MAX_STEPS, strategy="cudagraph")
    caught = fit_recording_warnings(trainer, PlainModule())

    report = graph_callback(trainer).report
    assert [(row.level, row.status) for row in report.ladder] == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "planned"),
        ("full_iteration", "planned"),
    ]
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_cuda")  # on a GPU, the whole step is captured
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)


@pytest.mark.parametrize(
    ("make_model", "options", "unmatched", "candidates"),
    [
        pytest.param(
            plain_fit,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["attn"])]},
            "attn",
            ["net.* (Linear)"],
            id="plain",
        ),
        pytest.param(
            plain_fit, lambda: {"strategy": "cudagraph_attn"}, "attn", ["net.* (Linear)"], id="plain-strategy"
        ),
        pytest.param(
            tiny_fit,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["moe"])]},
            "moe",
            ["model.blocks.*.attn", "model.blocks.*.mlp"],
            id="gpt-moe",
        ),
        pytest.param(
            tiny_fit,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["attn", "mamba"])]},
            "mamba",
            ["model.blocks.*.attn"],
            id="gpt-attn-mamba",
        ),
    ],
)
def test_explicit_scope_matching_nothing_raises_before_training(tmp_path, make_model, options, unmatched, candidates):
    (model, fit_args), counter = make_model(), StepCounter()
    options = options()
    trainer = cpu_trainer(tmp_path, MAX_STEPS, **{**options, "callbacks": [*options.get("callbacks", []), counter]})

    with pytest.raises(ValueError, match="matches no module") as error:
        trainer.fit(model, **fit_args)

    message = str(error.value)
    assert repr(unmatched) in message
    for candidate in candidates:
        assert candidate in message, f"the error should list candidate modules, got: {message}"
    assert counter.batches == 0
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("trainer_options", "match"),
    [
        pytest.param(
            lambda: {"callbacks": [CUDAGraphCallback(scope=["full_iteration"])]}, "cudagraph_full", id="plain-strategy"
        ),
        pytest.param(lambda: {"strategy": "cudagraph_full", "detect_anomaly": True}, "detect_anomaly", id="anomaly"),
    ],
)
def test_full_iteration_refuses_trainer_settings_before_training(tmp_path, trainer_options, match):
    (model, data), counter = decoder(TINY, **TINY_DATA), StepCounter()
    trainer_options = trainer_options()
    options = {**trainer_options, "callbacks": [*trainer_options.get("callbacks", []), counter]}
    trainer = cpu_trainer(tmp_path, MAX_STEPS, **options)

    with pytest.raises(ValueError, match=match) as error:
        trainer.fit(model, datamodule=data)

    assert "Fix:" in str(error.value)
    assert counter.batches == 0
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("scope", "checkpointed", "where"),
    [
        pytest.param(["layer"], lambda gpt: gpt.model.blocks[0], "model.blocks.0", id="layer-block"),
        pytest.param(["attn"], lambda gpt: gpt.model.blocks[1].attn, "model.blocks.1.attn", id="attn-attn"),
        pytest.param(["layer"], lambda gpt: gpt.model.blocks[1].mlp, "model.blocks.1.mlp", id="layer-inner-mlp"),
    ],
)
def test_activation_checkpointing_inside_target_raises(tmp_path, scope, checkpointed, where):
    (model, data), counter = decoder(TINY, **TINY_DATA), StepCounter()
    checkpointed(model).gradient_checkpointing = True
    trainer = cpu_trainer(tmp_path, MAX_STEPS, [CUDAGraphCallback(scope=scope), counter])

    with pytest.raises(ValueError, match="activation checkpointing") as error:
        trainer.fit(model, datamodule=data)

    assert where in str(error.value)
    assert counter.batches == 0


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_exception_mid_training_on_cpu_leaves_an_ordinary_model(tmp_path, setup):
    model, data = decoder(TINY, **TINY_DATA)
    options = SETUPS[setup]()
    trainer = cpu_trainer(
        tmp_path, MAX_STEPS, **{**options, "callbacks": [*options.get("callbacks", []), RaiseAtStep(3)]}
    )

    with pytest.raises(RuntimeError, match="user error at step 3"):
        trainer.fit(model, datamodule=data)

    assert trainer.global_step == 3
    assert trainer.state.status == "interrupted"
    assert graph_callback(trainer).report.stage == Stage.DISABLED
    # The model is still an ordinary model: a plain Lightning fit trains it.
    plain = cpu_trainer(tmp_path / "after", 2)
    plain.fit(model, datamodule=data)
    assert plain.global_step == 2


def test_on_a_cpu_no_plan_is_announced_only_that_graphs_are_off(caplog):
    """A new user on a CPU reads one message: graphs are off (no_cuda), not a plan of graphs that never come."""
    logs = caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    with logs, pytest.warns(UserWarning, match=r"CUDA graphs off \(no_cuda\)"):
        trainer(2, strategy="cudagraph_full", accelerator="cpu", devices=1).fit(*decoder(TINY))
    assert not [r.getMessage() for r in caplog.records if "captured as one graph" in r.getMessage()]

"""Short CPU fits: without CUDA the package trains eagerly, says so once, and leaves no trace on the model.

Every fit here is a few optimizer steps of a tiny GPT (2 layers, width 32), so the whole file runs in seconds.
Configuration errors that need the Trainer (scopes that match nothing, ``full_iteration`` with the wrong Trainer
settings, activation checkpointing inside a target) must be raised at ``fit`` before the first training step, on
a CPU as on a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPTModule, TokenDataModule
from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import LossRecorder, RaiseAtStep

TINY_MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "width": 32, "heads": 2}
TINY_DATA = {"vocab_size": 64, "seq_len": 16, "batch_size": 4, "train_samples": 64}
MAX_STEPS = 6


class TinyGPT(GPTModule):
    """The example GPT, with the test and predict steps a user would add."""

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])


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


def tiny_gpt(**options: Any) -> TinyGPT:
    seed_everything(0, verbose=False)
    return TinyGPT(**{**TINY_MODEL, **options})


def tiny_data() -> TokenDataModule:
    return TokenDataModule(**TINY_DATA)


def make_trainer(tmp_path: Any, **kwargs: Any) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "max_steps": MAX_STEPS,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def graph_callback(trainer: pl.Trainer) -> CUDAGraphCallback:
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)]
    assert len(callbacks) == 1, f"expected one CUDAGraphCallback, found {len(callbacks)}"
    return callbacks[0]


def patched_forwards(model: nn.Module) -> list[str]:
    """Modules that carry an instance attribute ``forward`` (a patched forward left behind)."""
    return [name or "<root>" for name, module in model.named_modules() if "forward" in module.__dict__]


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
    model, recorder = tiny_gpt(**WITH_SCHEDULE), LossRecorder()
    trainer = make_trainer(tmp_path / "eager", callbacks=[recorder], **WITH_VALIDATION)
    trainer.fit(model, datamodule=tiny_data())
    return recorder.losses, model.state_dict(), float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_cpu_fit_trains_eagerly_with_one_no_cuda_warning(tmp_path, setup):
    expected_losses, expected_weights, expected_val_loss = eager_reference(tmp_path)

    model, recorder = tiny_gpt(**WITH_SCHEDULE), LossRecorder()
    options = SETUPS[setup]()
    callbacks = [*options.pop("callbacks", []), recorder]
    trainer = make_trainer(tmp_path / "graphs", callbacks=callbacks, **options, **WITH_VALIDATION)
    caught = fit_recording_warnings(trainer, model, datamodule=tiny_data())

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
    assert patched_forwards(model) == []


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_validate_test_predict_and_second_fit_work_after_fit(tmp_path, setup):
    data = tiny_data()
    model = tiny_gpt()
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=1, limit_train_batches=3, **SETUPS[setup]())
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3

    val_loader = data.val_dataloader()
    assert "val_loss" in trainer.validate(model, dataloaders=val_loader, verbose=False)[0]
    assert "test_loss" in trainer.test(model, dataloaders=val_loader, verbose=False)[0]
    predictions = trainer.predict(model, dataloaders=val_loader)
    assert predictions[0].shape == (TINY_DATA["batch_size"], TINY_DATA["seq_len"], TINY_DATA["vocab_size"])
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
    assert patched_forwards(model) == []


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_resume_from_checkpoint_trains_on(tmp_path, setup):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    options = SETUPS[setup]()
    callbacks = [*options.pop("callbacks", []), checkpoint]
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=callbacks, enable_checkpointing=True, **options)
    trainer.fit(tiny_gpt(), datamodule=tiny_data())
    saved = torch.load(checkpoint.last_model_path, weights_only=False)
    assert graph_callback(trainer).state_key in saved["callbacks"], "the callback's counters travel in checkpoints"

    model = tiny_gpt()
    resumed = make_trainer(tmp_path, enable_checkpointing=True, **SETUPS[setup]())
    caught = fit_recording_warnings(resumed, model, datamodule=tiny_data(), ckpt_path=checkpoint.last_model_path)

    assert resumed.state.finished
    assert resumed.global_step == MAX_STEPS
    report = graph_callback(resumed).report
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_cuda")
    assert len(messages(caught, "no_cuda")) == 1, package_messages(caught)
    assert patched_forwards(model) == []


def test_impl_none_turns_everything_off_without_warning(tmp_path):
    model = tiny_gpt()
    callback = CUDAGraphCallback(impl="none")
    trainer = make_trainer(tmp_path, callbacks=[callback])
    caught = fit_recording_warnings(trainer, model, datamodule=tiny_data())

    assert trainer.global_step == MAX_STEPS
    assert callback.report.stage == Stage.DISABLED
    assert callback.report.reason == "impl_none"
    assert package_messages(caught) == []
    assert patched_forwards(model) == []


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(lambda: {"callbacks": [CUDAGraphCallback()]}, id="callback"),
        pytest.param(lambda: {"strategy": "cudagraph"}, id="strategy"),
    ],
)
def test_auto_scope_without_targets_warns_and_trains(tmp_path, options):
    model = PlainModule()
    trainer = make_trainer(tmp_path, **options())
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
    assert patched_forwards(model) == []


class StepCounter(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1


@pytest.mark.parametrize(
    ("make_model", "options", "unmatched", "candidates"),
    [
        pytest.param(
            PlainModule,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["attn"])]},
            "attn",
            ["net.* (Linear)"],
            id="plain",
        ),
        pytest.param(
            PlainModule, lambda: {"strategy": "cudagraph_attn"}, "attn", ["net.* (Linear)"], id="plain-strategy"
        ),
        pytest.param(
            tiny_gpt,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["moe"])]},
            "moe",
            ["model.blocks.*.attn", "model.blocks.*.mlp"],
            id="gpt-moe",
        ),
        pytest.param(
            tiny_gpt,
            lambda: {"callbacks": [CUDAGraphCallback(scope=["attn", "mamba"])]},
            "mamba",
            ["model.blocks.*.attn"],
            id="gpt-attn-mamba",
        ),
    ],
)
def test_explicit_scope_matching_nothing_raises_before_training(tmp_path, make_model, options, unmatched, candidates):
    model, counter = make_model(), StepCounter()
    options = options()
    trainer = make_trainer(tmp_path, **{**options, "callbacks": [*options.get("callbacks", []), counter]})
    fit_args = {} if isinstance(model, PlainModule) else {"datamodule": tiny_data()}

    with pytest.raises(ValueError, match="matches no module") as error:
        trainer.fit(model, **fit_args)

    message = str(error.value)
    assert repr(unmatched) in message
    for candidate in candidates:
        assert candidate in message, f"the error should list candidate modules, got: {message}"
    assert counter.batches == 0
    assert trainer.global_step == 0
    assert patched_forwards(model) == []


@pytest.mark.parametrize(
    ("trainer_options", "match"),
    [
        pytest.param(
            lambda: {"callbacks": [CUDAGraphCallback(scope=["full_iteration"])]}, "cudagraph_full", id="plain-strategy"
        ),
        pytest.param(
            lambda: {"strategy": "cudagraph_full", "accumulate_grad_batches": 2}, "accumulate_grad_batches", id="accum"
        ),
        pytest.param(lambda: {"strategy": "cudagraph_full", "detect_anomaly": True}, "detect_anomaly", id="anomaly"),
    ],
)
def test_full_iteration_refuses_trainer_settings_before_training(tmp_path, trainer_options, match):
    model, counter = tiny_gpt(), StepCounter()
    trainer_options = trainer_options()
    options = {**trainer_options, "callbacks": [*trainer_options.get("callbacks", []), counter]}
    trainer = make_trainer(tmp_path, **options)

    with pytest.raises(ValueError, match=match) as error:
        trainer.fit(model, datamodule=tiny_data())

    assert "Fix:" in str(error.value)
    assert counter.batches == 0
    assert trainer.global_step == 0
    assert patched_forwards(model) == []


@pytest.mark.parametrize(
    ("scope", "checkpointed", "where"),
    [
        pytest.param(["layer"], lambda gpt: gpt.model.blocks[0], "model.blocks.0", id="layer-block"),
        pytest.param(["attn"], lambda gpt: gpt.model.blocks[1].attn, "model.blocks.1.attn", id="attn-attn"),
        pytest.param(["layer"], lambda gpt: gpt.model.blocks[1].mlp, "model.blocks.1.mlp", id="layer-inner-mlp"),
    ],
)
def test_activation_checkpointing_inside_target_raises(tmp_path, scope, checkpointed, where):
    model, counter = tiny_gpt(), StepCounter()
    checkpointed(model).gradient_checkpointing = True
    trainer = make_trainer(tmp_path, callbacks=[CUDAGraphCallback(scope=scope), counter])

    with pytest.raises(ValueError, match="activation checkpointing") as error:
        trainer.fit(model, datamodule=tiny_data())

    assert where in str(error.value)
    assert counter.batches == 0
    assert patched_forwards(model) == []


@pytest.mark.parametrize("setup", SETUP_IDS)
def test_exception_mid_training_leaves_no_patched_forward(tmp_path, setup):
    model = tiny_gpt()
    options = SETUPS[setup]()
    trainer = make_trainer(tmp_path, **{**options, "callbacks": [*options.get("callbacks", []), RaiseAtStep(3)]})

    with pytest.raises(RuntimeError, match="user error at step 3"):
        trainer.fit(model, datamodule=tiny_data())

    assert trainer.global_step == 3
    assert trainer.state.status == "interrupted"
    assert graph_callback(trainer).report.stage == Stage.DISABLED
    assert patched_forwards(model) == []
    # The model is still an ordinary model: a plain Lightning fit trains it.
    plain = make_trainer(tmp_path / "after", max_steps=2)
    plain.fit(model, datamodule=tiny_data())
    assert plain.global_step == 2

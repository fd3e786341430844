"""The main example, ``examples/gpt.py``: data a model can learn and be validated on, one log folder, a CPU preset
that keeps the run to about a minute, and a closing line that says what the graphs did and where the logs are."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from examples.gpt import CPU_PRESET, GPTCLI, GPTModule, TokenDataModule, closing_line
from lightning_cudagraph import CUDAGraphCallback
from tests.fake_backend import FakeBackend
from tests.helpers import OLD_LIGHTNING, cpu_trainer

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "examples" / "gpt_small.yaml"
TINY = {"vocab_size": 64, "seq_len": 16}
TINY_MODEL = {**TINY, "n_layer": 1, "width": 32, "heads": 2}


def transitions(tokens: torch.Tensor) -> set[tuple[int, int]]:
    """The (token, next token) pairs in a batch of sequences."""
    pairs = torch.stack([tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)], dim=1)
    return {tuple(pair) for pair in pairs.tolist()}


def test_validation_sequences_follow_the_training_chain():
    data = TokenDataModule(**TINY, train_samples=512, val_samples=64)
    data.setup("fit")
    train, val = data.train_set.tokens, data.val_set.tokens
    chain = {(token, successor) for token, row in enumerate(data.train_set.successors.tolist()) for successor in row}
    assert transitions(train) <= chain
    unknown = transitions(val) - chain
    assert not unknown, f"{len(unknown)} validation transitions the training chain never makes"
    assert not {tuple(row) for row in val.tolist()} & {tuple(row) for row in train.tolist()}, "val repeats train"


def test_the_training_data_stay_as_the_benchmarks_measured_them():
    # The training split is drawn as before the validation fix: benchmark figures stay comparable.
    generator = torch.Generator().manual_seed(0)
    successors = torch.randint(64, (64, 4), generator=generator)
    choices = torch.randint(4, (8, 16), generator=generator)
    first = torch.randint(64, (8,), generator=generator)
    data = TokenDataModule(**TINY, train_samples=8)
    data.setup("fit")
    tokens = data.train_set.tokens
    assert torch.equal(tokens[:, 0], first)
    assert torch.equal(tokens[:, 1], successors[first, choices[:, 0]])


class ValLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def test_val_loss_falls_as_the_model_learns_the_chain(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = GPTModule(**TINY_MODEL, lr=3e-3)
    data = TokenDataModule(**TINY, batch_size=8, train_samples=512, val_samples=64)
    val = ValLosses()
    options = {"val_check_interval": 20, "limit_val_batches": 4, "num_sanity_val_steps": 0}
    cpu_trainer(tmp_path, 60, [val], **options).fit(model, datamodule=data)
    assert len(val.losses) == 3
    assert val.losses == sorted(val.losses, reverse=True), f"val_loss did not fall: {val.losses}"
    assert val.losses[-1] < val.losses[0] - 0.3, val.losses


@pytest.mark.skipif(
    OLD_LIGHTNING,
    reason="the CPU preset is not applied under lightning 2.4 and jsonargparse 4.27.7 (seen at the floors)",
)
def test_without_cuda_the_preset_caps_the_run_and_keeps_smaller_values(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpt.py"])
    base = [f"--config={CONFIG}", "--trainer.accelerator=cpu", "--trainer.logger=false"]

    cli = GPTCLI(GPTModule, TokenDataModule, run=False, args=base)
    assert cli.trainer.max_steps == CPU_PRESET["trainer.max_steps"] < 100
    assert cli.trainer.val_check_interval == CPU_PRESET["trainer.val_check_interval"]
    assert (cli.model.hparams.n_layer, cli.model.hparams.width) == (2, 128)
    assert (cli.datamodule.hparams.batch_size, cli.datamodule.hparams.seq_len) == (8, 128), "the same batches"
    assert "trainer.max_steps 100 -> 40" in capsys.readouterr().out

    cli = GPTCLI(GPTModule, TokenDataModule, run=False, args=[*base, "--trainer.max_steps=5", "--model.n_layer=1"])
    assert (cli.trainer.max_steps, cli.model.hparams.n_layer) == (5, 1)

    cli = GPTCLI(GPTModule, TokenDataModule, run=False, args=[*base, "--cpu_preset=false"])
    assert (cli.trainer.max_steps, cli.model.hparams.n_layer, cli.model.hparams.width) == (100, 6, 256)


def run_example(cwd: Path, *flags: str, timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "examples" / "gpt.py"), "fit", f"--config={CONFIG}", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_a_run_writes_one_log_folder_and_ends_with_the_closing_line(tmp_path):
    flags = [
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.log_every_n_steps=2",
        *(f"--model.{key}={value}" for key, value in TINY_MODEL.items()),
        *(f"--data.{key}={value}" for key, value in TINY.items()),
        "--data.train_samples=64",
    ]
    result = run_example(tmp_path, *flags, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    assert [path.relative_to(tmp_path).as_posix() for path in sorted(tmp_path.rglob("*"))] == [
        "lightning_logs",
        "lightning_logs/version_0",
        "lightning_logs/version_0/config.yaml",
        "lightning_logs/version_0/hparams.yaml",
        "lightning_logs/version_0/metrics.csv",
    ]
    last = result.stdout.strip().splitlines()[-1]
    assert last == "CUDA graphs off (no_cuda): trained eagerly; logs in lightning_logs/version_0"


def test_the_closing_line_gives_the_speedup_when_graphs_were_on(tmp_path):
    model = GPTModule(**TINY_MODEL)
    data = TokenDataModule(**TINY, train_samples=64)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2)
    callback.capture_backend = FakeBackend(step_ms=lambda backend: 1.0 if backend.live_graphs else 3.0)
    trainer = cpu_trainer(tmp_path, 8, [callback], log_every_n_steps=2, logger=pl.loggers.CSVLogger(tmp_path))
    trainer.fit(model, datamodule=data)
    line = closing_line(trainer)
    assert line.startswith("CUDA graphs on (replaying): speedup 3.00x (eager 3.00 ms/step, graphed 1.00 ms/step)")
    assert line.endswith(f"; logs in {tmp_path}/lightning_logs/version_0")


def test_the_closing_line_without_the_package_or_a_logger(tmp_path):
    trainer = cpu_trainer(tmp_path, 1)
    trainer.fit(GPTModule(**TINY_MODEL), datamodule=TokenDataModule(**TINY, train_samples=8))
    assert closing_line(trainer) == "CUDA graphs not used (no cudagraph strategy or callback); no logger"


def test_the_readme_command_trains_with_val_loss_falling(tmp_path):
    # The README's first command, as a user runs it (on a CPU: the preset, about a minute on two cores).
    result = run_example(tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", newline="") as file:
        val = [float(row["val_loss"]) for row in csv.DictReader(file) if row["val_loss"]]
    assert len(val) >= 2 and val == sorted(val, reverse=True), f"val_loss did not fall: {val}"
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"CUDA graphs (on|off) \(.+\).*; logs in lightning_logs/version_0", last), last
    if not torch.cuda.is_available():
        assert last.startswith("CUDA graphs off (no_cuda)")

"""Strategy names, the callback a strategy adds, LightningCLI flags, and DDP on CPU (gloo).

A user picks graphs with a Trainer flag (``Trainer(strategy="cudagraph_attn_mlp")``) or through LightningCLI
(``--trainer.strategy=...``, ``--trainer.callbacks+=lightning_cudagraph.CUDAGraphCallback``). These tests build
those Trainers on a CPU and check the options that reach the strategy and the callback, then train a few steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

import lightning_cudagraph
from lightning_cudagraph import (
    CUDAGraphCallback,
    CUDAGraphStrategy,
    DDPCUDAGraphStrategy,
    ModelParallelCUDAGraphStrategy,
    Stage,
)
from tests.helpers import OLD_LIGHTNING, cpu_trainer, graph_callbacks
from tests.models import TINY, TINY_DATA, DecoderModule, TokenData, decoder

MAX_STEPS = 3

# name -> (class, scope, warmup_steps), as DESIGN.md registers them.
REGISTERED = {
    "cudagraph": (CUDAGraphStrategy, ("auto",), 3),
    "cudagraph_attn": (CUDAGraphStrategy, ("attn",), 3),
    "cudagraph_mlp": (CUDAGraphStrategy, ("mlp",), 3),
    "cudagraph_attn_mlp": (CUDAGraphStrategy, ("attn", "mlp"), 3),
    "cudagraph_layer": (CUDAGraphStrategy, ("layer",), 3),
    "cudagraph_full": (CUDAGraphStrategy, ("full_iteration",), 3),
    "ddp_cudagraph": (DDPCUDAGraphStrategy, ("auto",), 3),
    "ddp_cudagraph_full": (DDPCUDAGraphStrategy, ("full_iteration",), 11),
    "fsdp2_cudagraph": (ModelParallelCUDAGraphStrategy, ("auto",), 3),
    "fsdp2_cudagraph_full": (ModelParallelCUDAGraphStrategy, ("full_iteration",), 3),
}
NAMES = list(REGISTERED)


# =================================================================== registry and Trainer flags
def test_package_docstring_lists_every_registered_name():
    for name in NAMES:
        assert f"``{name}``" in lightning_cudagraph.__doc__


@pytest.mark.parametrize("name", NAMES)
def test_name_is_registered(name):
    assert name in StrategyRegistry
    assert name in StrategyRegistry.available_strategies()
    assert StrategyRegistry[name]["strategy"] is REGISTERED[name][0]
    assert StrategyRegistry[name]["description"], "every registered name should say what it does"


@pytest.mark.parametrize("name", NAMES)
def test_name_builds_trainer_on_cpu(tmp_path, name):
    cls, scope, warmup_steps = REGISTERED[name]
    trainer = cpu_trainer(tmp_path, MAX_STEPS, strategy=name)

    assert type(trainer.strategy) is cls
    assert trainer.strategy.cudagraph_config.scope == scope
    assert trainer.strategy.cudagraph_config.warmup_steps == warmup_steps
    assert trainer.strategy.root_device == torch.device("cpu")
    assert graph_callbacks(trainer) == [], "the strategy adds its callback at fit, not at Trainer construction"


def test_strategy_adds_exactly_one_callback_and_reuses_it_on_refit(tmp_path):
    model, data = decoder(TINY, **TINY_DATA)
    trainer = cpu_trainer(tmp_path, MAX_STEPS, strategy="cudagraph_attn")
    trainer.fit(model, datamodule=data)

    added = graph_callbacks(trainer)
    assert len(added) == 1
    callback = added[0]
    assert callback.config.scope == ("attn",)
    assert trainer.strategy.rollout is callback.rollout
    assert (callback.report.stage, callback.report.reason) == (Stage.DISABLED, "no_cuda")

    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 5
    assert graph_callbacks(trainer) == [callback], "a second fit must not add a second callback"


@pytest.mark.parametrize("name", ["cudagraph", "cudagraph_attn_mlp"])
def test_strategy_uses_the_users_callback(tmp_path, name):
    model, data = decoder(TINY, **TINY_DATA)
    callback = CUDAGraphCallback(scope=["mlp"], warmup_steps=2)
    trainer = cpu_trainer(tmp_path, MAX_STEPS, [callback], strategy=name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)

    assert graph_callbacks(trainer) == [callback]
    assert trainer.strategy.rollout is callback.rollout
    assert callback.config.scope == ("mlp",)
    assert callback.config.warmup_steps == 2
    assert callback.report.scopes == {"mlp": ["model.blocks.0.mlp", "model.blocks.1.mlp"]}
    assert (callback.report.stage, callback.report.reason) == (Stage.DISABLED, "no_cuda")
    if name != "cudagraph":  # the strategy asked for other options: the user must hear which ones apply
        assert any("strategy" in str(w.message) and "callback" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(lambda: {"callbacks": [CUDAGraphCallback(scope=["attn"])]}, id="users-callback"),
        pytest.param(lambda: {"strategy": "cudagraph_attn"}, id="strategy-adds-callback"),
    ],
)
def test_checkpoint_callbacks_stay_last(tmp_path, options):
    """Lightning runs Checkpoint callbacks last so that they save every other callback's final state of a step.

    The callback a strategy adds must keep that order, as a callback the user passes does.
    """
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    options = options()
    callbacks = [*options.pop("callbacks", []), checkpoint]
    trainer = cpu_trainer(tmp_path, MAX_STEPS, callbacks, enable_checkpointing=True, **options)
    trainer.fit(*decoder(TINY, **TINY_DATA))

    order = [type(cb).__name__ for cb in trainer.callbacks]
    assert len(graph_callbacks(trainer)) == 1
    assert isinstance(trainer.callbacks[-1], Checkpoint), f"ModelCheckpoint should run last, callbacks run as {order}"


# =================================================================== LightningCLI
CLI_TINY = [
    *(f"--model.{key}={value}" for key, value in TINY.items()),
    f"--data.vocab_size={TINY['vocab_size']}",
    f"--data.seq_len={TINY['seq_len']}",
    *(f"--data.{key}={value}" for key, value in TINY_DATA.items()),
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=0",
]

CLI_CASES = {
    "strategy-name": (["--trainer.strategy=cudagraph_attn_mlp"], CUDAGraphStrategy, ("attn", "mlp"), 3),
    "strategy-class": (
        [
            "--trainer.strategy=lightning_cudagraph.CUDAGraphStrategy",
            "--trainer.strategy.scope=[attn,mlp]",
            "--trainer.strategy.warmup_steps=5",
        ],
        CUDAGraphStrategy,
        ("attn", "mlp"),
        5,
    ),
    "strategy-short-class": (
        [
            "--trainer.strategy=CUDAGraphStrategy",
            "--trainer.strategy.scope=[layer]",
            "--trainer.strategy.warmup_steps=4",
        ],
        CUDAGraphStrategy,
        ("layer",),
        4,
    ),
    "callback": (
        ["--trainer.callbacks+=lightning_cudagraph.CUDAGraphCallback", "--trainer.callbacks.scope=[attn]"],
        None,
        ("attn",),
        3,
    ),
}


def build_cli(tmp_path: Path, flags: list[str], monkeypatch: pytest.MonkeyPatch) -> LightningCLI:
    monkeypatch.setattr("sys.argv", ["gpt.py"])  # only `args` reach the parser, not pytest's own arguments
    args = [*CLI_TINY, f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", *flags]
    return LightningCLI(DecoderModule, TokenData, run=False, args=args)


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_flags_reach_strategy_and_callback(tmp_path, monkeypatch, case):
    flags, strategy_cls, scope, warmup_steps = CLI_CASES[case]
    cli = build_cli(tmp_path, flags, monkeypatch)

    if strategy_cls is not None:
        assert type(cli.trainer.strategy) is strategy_cls
        assert cli.trainer.strategy.cudagraph_config.scope == scope
        assert cli.trainer.strategy.cudagraph_config.warmup_steps == warmup_steps
    else:
        callbacks = graph_callbacks(cli.trainer)
        assert len(callbacks) == 1
        assert callbacks[0].config.scope == scope
        assert callbacks[0].config.warmup_steps == warmup_steps
    assert cli.model.hparams.n_layer == TINY["n_layer"]


def test_cli_strategy_options_by_class_name_and_in_a_config_file(tmp_path, monkeypatch):
    options = ["--trainer.strategy.scope=[layer]", "--trainer.strategy.max_pool_mib=512"]
    cli = build_cli(tmp_path, ["--trainer.strategy=CUDAGraphStrategy", *options], monkeypatch)
    assert cli.trainer.strategy.cudagraph_config.max_pool_mib == 512
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_cudagraph.CUDAGraphStrategy\n"
        "    init_args: {scope: [full_iteration], max_pool_mib: 256}\n"
    )
    cli = build_cli(tmp_path, [f"--config={config}"], monkeypatch)
    assert (cli.trainer.strategy.cudagraph_config.scope, cli.trainer.strategy.cudagraph_config.max_pool_mib) == (
        ("full_iteration",),
        256,
    )


def test_cli_registered_name_takes_no_options_and_says_so(tmp_path, monkeypatch, capsys):
    # A registered name is a string to LightningCLI; options go with the class name (README: Trainer flags).
    with pytest.raises(SystemExit):
        build_cli(tmp_path, ["--trainer.strategy=cudagraph_layer", "--trainer.strategy.max_pool_mib=512"], monkeypatch)
    assert "max_pool_mib" in capsys.readouterr().err


def test_cli_misspelt_name_ends_with_the_error_the_troubleshooting_page_quotes(tmp_path, monkeypatch):
    # LightningCLI hands the string to the Trainer, so Lightning's own check refuses it (docs/troubleshooting.md).
    with pytest.raises(ValueError, match="invalid strategy name") as raised:
        build_cli(tmp_path, ["--trainer.strategy=cudagraph_atn"], monkeypatch)
    page = (Path(__file__).parents[1] / "docs" / "troubleshooting.md").read_text()
    assert f"ValueError: {raised.value}\n" in page


@pytest.mark.skipif(
    OLD_LIGHTNING, reason="the README's callback command fails under lightning 2.4's LightningCLI (seen at the floors)"
)
def test_readme_callback_command_runs_without_a_conflict_warning(tmp_path):
    command = [
        sys.executable,
        "examples/gpt.py",
        "fit",
        "--config=examples/gpt_small.yaml",
        "--trainer.strategy=auto",
        "--trainer.callbacks+=lightning_cudagraph.CUDAGraphCallback",
        "--trainer.callbacks.scope=[attn]",
        "--trainer.max_steps=2",
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.limit_val_batches=0",
        *(f"--model.{key}={value}" for key, value in TINY.items()),
        f"--data.vocab_size={TINY['vocab_size']}",
        f"--data.seq_len={TINY['seq_len']}",
        "--data.train_samples=16",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no_cuda" in result.stderr
    assert "given both as a callback and through the strategy" not in result.stderr


@pytest.mark.parametrize("case", ["strategy-class", "callback"])
def test_cli_fit_on_cpu(tmp_path, monkeypatch, case):
    flags, _, scope, _ = CLI_CASES[case]
    cli = build_cli(tmp_path, [*flags, "--trainer.max_steps=3"], monkeypatch)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 3
    (callback,) = graph_callbacks(cli.trainer)
    assert callback.config.scope == scope
    assert (callback.report.stage, callback.report.reason) == (Stage.DISABLED, "no_cuda")
    assert set(callback.report.scopes) == set(scope)


# =================================================================== DDP on CPU
class ReportToFile(pl.Callback):
    """Writes each rank's graph report to ``out/rank<N>.json`` (reports live in the spawned processes only)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (callback,) = graph_callbacks(trainer)
        report = {
            "stage": int(callback.report.stage),
            "reason": callback.report.reason,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "strategy": type(trainer.strategy).__name__,
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
@pytest.mark.skipif(
    torch.distributed.is_available() and not torch.distributed.is_gloo_available(), reason="needs the gloo backend"
)
def test_ddp_spawn_two_cpu_processes_train_eagerly(tmp_path):
    """Two spawned gloo processes train a few steps; each rank reports stage -1 for ``no_cuda``.

    This takes about 8 s on a 2-core machine (two interpreters importing torch and Lightning), which is the cost
    of the only DDP check that runs without a GPU. The model, data module and callbacks are module-level, so they
    pickle into the spawned processes.
    """
    model, data = decoder(TINY, **TINY_DATA)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    strategy = DDPCUDAGraphStrategy(start_method="spawn", process_group_backend="gloo")
    trainer = cpu_trainer(tmp_path, MAX_STEPS, [ReportToFile(str(tmp_path))], strategy=strategy, devices=2)
    trainer.fit(model, datamodule=data)

    assert trainer.state.finished
    assert any(not torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "stage": int(Stage.DISABLED),
            "reason": "no_cuda",
            "world_size": 2,
            "global_step": 3,
            "strategy": "DDPCUDAGraphStrategy",
        }

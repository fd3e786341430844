"""LightningCLI: every option of the callback and both strategies has its description, and errors come first.

jsonargparse reads the ``Args:`` of a class docstring (docstring_parser); they are written from one declaration,
``lightning_cudagraph._options.options.OPTIONS`` (tests/test_option_signatures.py checks they agree). A configuration
error under LightningCLI ends the program with the package's message, not a jsonargparse Union traceback.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse", reason="LightningCLI's parser (the `examples` and `test` extras install it)")
from jsonargparse import ArgumentParser

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy
from lightning_cudagraph._options.options import OPTION_DOCS
from lightning_cudagraph._options.options import OPTIONS as DECLARED
from tests.test_strategies import build_cli

CLASSES = [CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy]
OPTIONS = [option.name for option in DECLARED]
ROOT = Path(__file__).parents[1]


def opening(text: str, words: int = 6) -> str:
    """The first words of a description, as help wraps it onto one line or several."""
    return " ".join(text.split()[:words])


def test_every_option_has_a_description():
    assert [name for name in OPTIONS if not OPTION_DOCS.get(name, "").strip()] == []
    assert set(OPTION_DOCS) == set(OPTIONS), "a description for an option that does not exist"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_signature_and_help_show_every_option_with_its_description(cls):
    assert [name for name in OPTIONS if name not in inspect.signature(cls).parameters] == []
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "graph")
    helps = {action.dest.removeprefix("graph."): " ".join((action.help or "").split()) for action in parser._actions}
    for name in OPTIONS:
        assert opening(OPTION_DOCS[name]) in helps[name], f"{cls.__name__} --{name}: {helps[name]!r}"


def test_the_real_cli_help_shows_the_descriptions():
    command = [sys.executable, "examples/gpt.py", "fit", "--config=examples/gpt_small.yaml"]
    result = subprocess.run(
        [*command, "--trainer.strategy.help", "CUDAGraphStrategy"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shown = " ".join(result.stdout.split())
    for name in OPTIONS:
        assert opening(OPTION_DOCS[name]) in shown, f"--trainer.strategy.{name} has no description"


# =================================================================== the package's message first
@pytest.mark.parametrize(
    ("flags", "first"),
    [
        pytest.param(
            ["--trainer.strategy=CUDAGraphStrategy", "--trainer.strategy.scope=[atn]"],
            "CUDAGraphStrategy: `scope=['atn']` is not supported",
            id="strategy",
        ),
        pytest.param(
            ["--trainer.callbacks+=lightning_cudagraph.CUDAGraphCallback", "--trainer.callbacks.confirm_steps=0"],
            "CUDAGraphCallback: `confirm_steps=0` is not supported",
            id="callback",
        ),
    ],
)
def test_a_bad_option_through_lightning_cli_ends_with_the_packages_message(tmp_path, monkeypatch, flags, first):
    with pytest.raises(SystemExit) as exit_:
        build_cli(tmp_path, flags, monkeypatch)
    message = str(exit_.value.code)
    assert message.startswith(first), message
    assert "Union" not in message and "Fix:" in message, message


def test_the_real_cli_prints_the_packages_message_without_a_traceback():
    command = [sys.executable, "examples/gpt.py", "fit", "--config=examples/gpt_small.yaml"]
    flags = ["--trainer.strategy=CUDAGraphStrategy", "--trainer.strategy.scope=[atn]", "--trainer.accelerator=cpu"]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "seed" not in line.lower() and line.strip()]
    assert errors[0].startswith("CUDAGraphStrategy: `scope=['atn']` is not supported"), result.stderr
    assert "did you mean 'attn'?" in errors[0]

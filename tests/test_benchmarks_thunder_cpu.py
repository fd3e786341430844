"""benchmarks/thunder_peer.py without a GPU (and without thunder): its import, its checks and its pure helpers."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks import thunder_peer as peer
from benchmarks.variants import CONFIGS, Result, model_args
from examples.gpt import GPTModule

REPO = Path(__file__).resolve().parent.parent


def test_module_imports_and_answers_where_thunder_cannot_be_imported():
    code = (
        "import sys; sys.modules['thunder'] = None\n"  # any `import thunder` now raises ImportError
        "from benchmarks.thunder_peer import THUNDER_SKIPPED, thunder_available\n"
        "print(thunder_available(), sys.modules['thunder'], THUNDER_SKIPPED)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False None skipped: lightning-thunder not installed"


def test_thunder_available_follows_what_can_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "thunder", None)
    assert peer.thunder_available() is False
    fake = types.ModuleType("thunder")
    fake.__spec__ = importlib.machinery.ModuleSpec("thunder", None)
    monkeypatch.setitem(sys.modules, "thunder", fake)
    assert peer.thunder_available() is True


def test_autocast_dtype_per_precision():
    assert peer.autocast_dtype("32-true") is None
    assert peer.autocast_dtype("bf16-mixed") is torch.bfloat16
    with pytest.raises(ValueError, match="precision must be one of 32-true, bf16-mixed"):
        peer.autocast_dtype("16-mixed")


@pytest.mark.parametrize(
    ("config", "precision", "message"),
    [(CONFIGS["moe"], "32-true", "dense GPT only"), (CONFIGS["tiny"], "bf16-true", "precision must be")],
)
def test_bad_requests_are_refused_before_thunder_is_imported(monkeypatch, config, precision, message):
    monkeypatch.setitem(sys.modules, "thunder", None)  # an import would raise ImportError, not ValueError
    with pytest.raises(ValueError, match=message):
        peer.thunder_variant(config, precision, steps=4, skip=1)


def test_loss_is_the_gpt_modules_training_loss():
    torch.manual_seed(0)
    module = GPTModule(**model_args(CONFIGS["tiny"]))
    x = torch.randint(CONFIGS["tiny"]["vocab_size"], (2, CONFIGS["tiny"]["seq_len"]))
    y = torch.randint(CONFIGS["tiny"]["vocab_size"], (2, CONFIGS["tiny"]["seq_len"]))
    with torch.no_grad():
        expected = module._loss((x, y))
        got = peer.next_token_loss(module.model(x), y)
    assert got.shape == ()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_thunder_result_is_a_result_with_losses_and_first_step():
    result = peer.ThunderResult(peer.VARIANT, [1.0, 2.0, 3.0], losses=[5.5, 5.0], first_step_s=12.0)
    assert isinstance(result, Result)
    assert (result.variant, result.median_ms, result.losses, result.first_step_s) == ("thunder", 2.0, [5.5, 5.0], 12.0)
    assert peer.ThunderResult("thunder").losses == []

"""The Transformer Engine driver's bookkeeping on a CPU, through the fake capture backend.

Transformer Engine itself is only on the GPU machine (``tests/test_gpu_te.py``); here its three entry points (the
FP8 recipe of the precision plugin, TE's "skip the FP8 weight update" flag, and the installed-package check) are
replaced, so the driver's own decisions run for real: FP8 weights quantized once per optimizer step with gradient
accumulation, and trusted only after a micro-batch on which every region replayed.
"""

from __future__ import annotations

import importlib.util

import pytest

from lightning_cudagraph import CUDAGraphCallback, Stage
from lightning_cudagraph._backend import te
from lightning_cudagraph._trust.tolerance import FORWARD_TOL
from tests.fake_backend import FakeBackend
from tests.helpers import fit
from tests.models import TINY, decoder

CPU = {"accelerator": "cpu", "devices": 1}


@pytest.fixture
def te_stand_in(monkeypatch):
    """Transformer Engine's entry points, recorded: returns the list of skip flags the driver set."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else find_spec(name, *a)
    )
    monkeypatch.setattr(te, "fp8_recipe_of", lambda plugin: "delayed-scaling")
    flags: list[bool] = []
    monkeypatch.setattr(te, "_set_te_skip_flag", flags.append)
    return flags


def test_fp8_weights_are_quantized_on_the_first_micro_batch_of_each_window(te_stand_in):
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=2)
    callback.capture_backend = FakeBackend()
    fit(*decoder(TINY), 6, [callback], accumulate_grad_batches=2, **CPU)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    # From capture on, the first micro-batch of each window quantizes (skip False) and the second reuses (True);
    # the capture window's first micro-batch replays each forward for its parity check, which quantizes too.
    assert te_stand_in == [False, True] * 4, te_stand_in


def test_fp8_uses_its_own_parity_tolerance(te_stand_in):
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=1)
    callback.capture_backend = FakeBackend(distort={"model.blocks.0": 1 + FORWARD_TOL["fp8"] / 2})
    fit(*decoder(TINY), 4, [callback], **CPU)
    assert callback.report.stage == Stage.REPLAYING, "an FP8-sized difference passes under FP8"
    assert callback.report.parity_err == pytest.approx(FORWARD_TOL["fp8"] / 2, rel=1e-3)

"""impl="transformer_engine" on a GPU: TE's graphs in bf16 and FP8. Run with `pytest -m cuda` where TE is installed."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import (
    SMALL,
    LossRecorder,
    assert_losses_close,
    gpt,
    graph_pool_bytes,
    patched_forwards,
    settled_memory,
    trainer,
)

te = pytest.importorskip("transformer_engine.pytorch")
pytestmark = [pytest.mark.cuda, pytest.mark.te, pytest.mark.timeout(300)]

STEPS, WARMUP = 20, 3


def _precision(fp8: bool):
    if not fp8:
        return "bf16-mixed"
    from lightning.pytorch.plugins.precision import TransformerEnginePrecision
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    return TransformerEnginePrecision(weights_dtype=torch.float32, recipe=recipe, fallback_compute_dtype=torch.bfloat16)


def _train(callback, fp8, steps=STEPS, probe=None):
    from examples.te_gpt import TEGPTModule

    pl.seed_everything(0, verbose=False)
    model = TEGPTModule(**SMALL)
    _, data = gpt(SMALL)
    losses = LossRecorder()
    callbacks = [losses] + ([callback] if callback else []) + ([probe] if probe else [])
    precision = _precision(fp8)
    kwargs = {"plugins": [precision]} if fp8 else {"precision": precision}
    trainer(steps, callbacks, accelerator="cuda", devices=1, **kwargs).fit(model, data)
    return losses.losses, model


def test_te_layers_bf16_graphed_match_te_eager():
    eager, _ = _train(None, fp8=False)
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    graphed, model = _train(callback, fp8=False)
    report = callback.report
    assert report.scopes["layer"] == [f"model.blocks.{i}" for i in range(SMALL["n_layer"])]
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays == (STEPS - WARMUP) * SMALL["n_layer"]
    assert report.fallbacks == 0
    assert_losses_close(eager, graphed, 2e-2)
    assert patched_forwards(model) == []
    assert not any(hasattr(m, "reset") and "reset" in m.__dict__ for m in model.modules())


class _ScalingProbe(pl.Callback):
    """Reads one FP8 scale of the first layer after every step (the delayed-scaling state)."""

    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layer = pl_module.model.blocks[0]
        te_module = next(m for m in layer.modules() if hasattr(m, "fp8_meta") and "scaling_fwd" in m.fp8_meta)
        self.scales.append(te_module.fp8_meta["scaling_fwd"].amax_history.detach().clone().cpu())


def test_te_fp8_delayed_scaling_tracks_eager_and_keeps_updating():
    eager, _ = _train(None, fp8=True)
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    probe = _ScalingProbe()
    graphed, _ = _train(callback, fp8=True, probe=probe)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert all(torch.isfinite(torch.tensor(graphed)))
    # FP8 (E4M3 forward, E5M2 backward) keeps 2-3 mantissa bits: the two runs drift apart slowly; they must stay
    # within a few percent of each other, far closer than to the untrained loss (log 1024 = 6.9).
    assert max(abs(a - b) / b for a, b in zip(eager, graphed, strict=True)) < 0.05
    after_capture = probe.scales[WARMUP + 1 :]
    assert any(not torch.equal(a, b) for a, b in itertools.pairwise(after_capture))


def test_te_release_frees_memory_after_an_exception():
    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 8:
                raise RuntimeError("boom")

    def failed():
        callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
        with pytest.raises(RuntimeError, match="boom"):
            _train(callback, fp8=False, probe=Boom())
        report = callback.report
        del callback
        return settled_memory(), report

    (first, report), (second, _) = failed(), failed()
    assert report.captures == 1
    assert report.graphs == 0
    assert graph_pool_bytes() == 0
    assert second == first

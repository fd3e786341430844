"""impl="transformer_engine" on a GPU: TE's graphs in bf16 and FP8. Run with `pytest -m cuda` where TE is installed."""

from __future__ import annotations

import itertools
import statistics

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import (
    RaiseAtStep,
    assert_losses_close,
    fit_cuda,
    graph_pool_bytes,
    patched_forwards,
    settled_memory,
)
from tests.models import SMALL, TEDecoderModule, decoder

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


def _train_te(callback, fp8, steps=STEPS, probe=None, accumulate=1, dropout=0.0, module=TEDecoderModule):
    """Train the TE decoder (bf16, or FP8 with delayed scaling); return the per-step losses and the model."""
    model, data = decoder(SMALL, module=module, dropout=dropout)
    callbacks = ([callback] if callback else []) + ([probe] if probe else [])
    precision = _precision(fp8)
    kwargs = {"plugins": [precision]} if fp8 else {"precision": precision}
    losses, _, _, model = fit_cuda(model, data, steps, callbacks, accumulate_grad_batches=accumulate, **kwargs)
    return losses, model


def test_te_layers_bf16_graphed_match_te_eager():
    eager, _ = _train_te(None, fp8=False)
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    graphed, model = _train_te(callback, fp8=False)
    report = callback.report
    assert report.scopes["layer"] == [f"model.blocks.{i}" for i in range(SMALL["n_layer"])]
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays == (STEPS - WARMUP) * SMALL["n_layer"]
    assert report.fallbacks == 0
    assert_losses_close(eager, graphed, 2e-2)
    assert patched_forwards(model) == []
    assert not any(hasattr(m, "reset") and "reset" in m.__dict__ for m in model.modules())


def test_te_dropout_draws_the_masks_eager_training_draws():
    """TE's graphs register the generators dropout draws from: graphed training tracks TE eager with dropout on."""
    eager, _ = _train_te(None, fp8=False, dropout=0.1)
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    graphed, _ = _train_te(callback, fp8=False, dropout=0.1)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert_losses_close(eager, graphed, 2e-2)


def test_te_dropout_masks_are_fresh_on_every_replay():
    class DropoutProbe(TEDecoderModule):
        """Replays its first layer twice on one input late in training, before the step's own forward."""

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == STEPS - 2:
                x = torch.randn(8, SMALL["seq_len"], SMALL["width"], device=self.device, requires_grad=True)
                self.probes = [self.model.blocks[0](x).detach().clone() for _ in range(2)]
            return super().training_step(batch, batch_idx)

    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    _, model = _train_te(callback, fp8=False, dropout=0.5, module=DropoutProbe)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.replays == (STEPS - WARMUP) * SMALL["n_layer"] + 2  # the probe's two calls replayed
    first, second = model.probes
    assert float((first.float() - second.float()).abs().max()) > 1e-2  # another dropout mask on the second replay


class _ScalingProbe(pl.Callback):
    """Reads one FP8 scale of the first layer after every step (the delayed-scaling state)."""

    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layer = pl_module.model.blocks[0]
        te_module = next(m for m in layer.modules() if hasattr(m, "fp8_meta") and "scaling_fwd" in m.fp8_meta)
        self.scales.append(te_module.fp8_meta["scaling_fwd"].amax_history.detach().clone().cpu())


def test_te_fp8_delayed_scaling_tracks_eager_and_keeps_updating():
    eager, _ = _train_te(None, fp8=True)
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    probe = _ScalingProbe()
    graphed, _ = _train_te(callback, fp8=True, probe=probe)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert all(torch.isfinite(torch.tensor(graphed)))
    # FP8 (E4M3 forward, E5M2 backward) keeps 2-3 mantissa bits: the two runs drift apart slowly; they must stay
    # within a few percent of each other, far closer than to the untrained loss (log 1024 = 6.9).
    assert max(abs(a - b) / b for a, b in zip(eager, graphed, strict=True)) < 0.05
    after_capture = probe.scales[WARMUP + 1 :]
    assert any(not torch.equal(a, b) for a, b in itertools.pairwise(after_capture))


class _FC1ZeroedOnSecondMicrobatches(pl.Callback):
    """From batch ``start`` on, zeroes the first layer's FP8 GEMM weight ``fc1`` for the second micro-batch of each
    accumulation window of two, and puts it back before the optimizer step (so the weights trained stay the same).

    A forward that quantizes the weights again sees zeros there; one that reuses the window's cached FP8 weights
    does not see the change at all.
    """

    def __init__(self, start: int) -> None:
        self.start, self.saved = start, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.start and batch_idx % 2 == 1:
            weight = pl_module.model.blocks[0].layernorm_mlp.fc1_weight
            self.saved = weight.detach().clone()
            with torch.no_grad():
                weight.zero_()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.saved is not None:
            with torch.no_grad():
                pl_module.model.blocks[0].layernorm_mlp.fc1_weight.copy_(self.saved)
            self.saved = None


def test_te_fp8_weights_quantized_once_per_accumulation_window():
    accumulate, batches = 2, 2 * STEPS
    start = 2 * (WARMUP + 4)  # past capture and confirmation: only steady replays see the zeroed weight

    def graphed_run(probe):
        callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
        losses, _ = _train_te(callback, fp8=True, probe=probe, accumulate=accumulate)
        return losses, callback.report

    eager, _ = _train_te(None, fp8=True, accumulate=accumulate)
    eager_zeroed, _ = _train_te(None, fp8=True, probe=_FC1ZeroedOnSecondMicrobatches(start), accumulate=accumulate)
    graphed, report = graphed_run(None)
    graphed_zeroed, _ = graphed_run(_FC1ZeroedOnSecondMicrobatches(start))

    assert report.stage == Stage.REPLAYING, report.reason
    assert report.fallbacks == 0
    assert report.replays == (batches - 2 * WARMUP) * SMALL["n_layer"]
    assert all(torch.isfinite(torch.tensor(graphed)))
    # Graphed FP8 with cached weights tracks eager FP8 (which quantizes on every micro-batch) as closely as the
    # test without accumulation requires: the weights are the same within a window, only their scales may move.
    assert max(abs(a - b) / b for a, b in zip(eager, graphed, strict=True)) < 0.05
    zeroed = range(start + 1, batches, 2)
    eager_effect = statistics.mean(abs(eager_zeroed[i] - eager[i]) / eager[i] for i in zeroed)
    graphed_effect = max(abs(graphed_zeroed[i] - graphed[i]) / graphed[i] for i in zeroed)
    # Eager quantizes on every micro-batch and sees the zeroed weight; the graphs reuse the FP8 weights of the
    # window's first micro-batch, so the change never reaches their forward.
    assert eager_effect > 0.01, eager_effect
    assert graphed_effect < eager_effect / 20, (graphed_effect, eager_effect)


def test_te_release_frees_memory_after_an_exception():
    def failed():
        callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
        with pytest.raises(RuntimeError, match="boom"):
            _train_te(callback, fp8=False, probe=RaiseAtStep(8, "boom"))
        report = callback.report
        del callback
        return settled_memory(), report

    (first, report), (second, _) = failed(), failed()
    assert report.captures == 1
    assert report.graphs == 0
    assert graph_pool_bytes() == 0
    assert second == first

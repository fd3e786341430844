"""torchmetrics under graphs on a GPU: a metric updated from the step's outputs counts every step, in every scope."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torchmetrics import MeanMetric

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import fit_cuda, graph_callback
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP = 12, 3


class LossMean(pl.Callback):
    """A torchmetrics mean of the training loss, updated from ``outputs`` in ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.metric: MeanMetric | None = None

    def on_fit_start(self, trainer, pl_module):
        self.metric = MeanMetric().to(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metric.update(outputs["loss"].detach())


@pytest.mark.parametrize("scope", [["attn"], ["attn", "mlp"], ["layer"], ["full_iteration"]])
def test_a_metric_updated_from_outputs_counts_every_replayed_step(scope):
    eager = LossMean()
    fit_cuda(*decoder(SMALL), STEPS, [eager])
    graphed = LossMean()
    if scope == ["full_iteration"]:
        run = fit_cuda(*decoder(SMALL), STEPS, [graphed], strategy=CUDAGraphStrategy(scope=scope, warmup_steps=WARMUP))
        report = graph_callback(run.trainer).report
    else:
        callback = CUDAGraphCallback(scope=scope, warmup_steps=WARMUP)
        fit_cuda(*decoder(SMALL), STEPS, [callback, graphed])
        report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert graphed.metric.update_count == eager.metric.update_count == STEPS
    torch.testing.assert_close(graphed.metric.compute(), eager.metric.compute(), rtol=1e-5, atol=1e-6)

"""The optimizer step as a graph of its own under scoped capture, on a GPU. Run with `pytest -m cuda`.

A scoped fit through the package's strategy captures the update once and replays it after the eager backward; it
must train as eager training does, fall back for a step whose gradients are not the capture's, and leave nothing.

The optimizer graph runs AdamW fused and capturable for the whole fit. The eager reference here is built the same way
(``fused=True``, a learning rate a float32 tensor holds exactly), so both runs do the same arithmetic: Adam turns the
rounding noise of a gradient that is zero in exact arithmetic (the key bias of attention) into steps of ``lr``, so a
``foreach`` reference would differ by about ``lr`` per step on that parameter, right or wrong.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cudagraph import CUDAGraphStrategy, Stage
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, graph_pool_bytes, max_param_diff
from tests.models import SMALL, DecoderModule, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP, CONFIRM = 20, 3, 2
#: AdamW in the optimizer graph's arithmetic (see the module's docstring).
SAME_ARITHMETIC = {"fused": True, "lr": 2**-10}


def layer_strategy(**options) -> CUDAGraphStrategy:
    return CUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP, **options)


def assert_given_back(run) -> None:
    group = run.trainer.optimizers[0].param_groups[0]
    assert isinstance(group["lr"], float) and group["capturable"] is False and group["fused"] is True
    own = vars(run.trainer.optimizers[0]).get("step")  # an LR scheduler wraps the step on the instance
    assert own is None or getattr(own, "_wrapped_by_lr_sched", False), "optimizer.step is its own again"
    assert graph_pool_bytes() == 0, "a graph's pool outlived the fit"


# Lightning refuses clipping under mixed precision for an optimizer built with fused=True (it would unscale itself).
@pytest.mark.parametrize(("precision", "clip"), [("32-true", 0.5), ("bf16-mixed", None)])
def test_the_replayed_update_trains_as_eager_with_clipping_and_a_step_wise_scheduler(precision, clip):
    options, tolerance = {"precision": precision, "gradient_clip_val": clip}, 1e-5
    model_options = {"lr_step_size": 4, "lr_gamma": 0.5, "weight_decay": 0.1, **SAME_ARITHMETIC}
    eager = fit_cuda(*decoder(SMALL, **model_options), STEPS, **options)
    run = fit_cuda(*decoder(SMALL, **model_options), STEPS, strategy=layer_strategy(), **options)

    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.rollback_reasons
    assert report.optimizer_graph == "replaying"
    assert report.optimizer_replays == STEPS - WARMUP
    assert report.optimizer_parity_err < 1e-5  # same fused kernel, same state, same gradients
    assert_losses_close(eager.losses, run.losses, tolerance)
    assert max_param_diff(eager.params, run.params) < tolerance, max_param_diff(eager.params, run.params)
    assert_given_back(run)


class SometimesUnused(DecoderModule):
    """A parameter only even batches use: on odd batches ``zero_grad`` left its gradient ``None``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = nn.Parameter(torch.full((), 0.5))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if batch_idx % 2 == 0:
            loss = loss + self.offset**2
        self.log("train_loss", loss)
        return loss


def test_a_parameter_without_a_gradient_is_not_moved_by_a_stale_one():
    options = {"weight_decay": 0.1, **SAME_ARITHMETIC}
    eager = fit_cuda(*decoder(SMALL, SometimesUnused, **options), STEPS)
    run = fit_cuda(*decoder(SMALL, SometimesUnused, **options), STEPS, strategy=layer_strategy())

    report = graph_callback(run.trainer).report
    fallbacks = sum(n for reason, n in report.fallback_reasons.items() if reason.startswith("optimizer_grads_differ"))
    # Captured on step WARMUP: the steps of the other parity have another set of gradients, and run eagerly.
    assert fallbacks == len([step for step in range(WARMUP, STEPS) if step % 2 != WARMUP % 2])
    assert report.optimizer_replays == STEPS - WARMUP - fallbacks
    assert abs(float(eager.params["offset"]) - float(run.params["offset"])) < 1e-6
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert max_param_diff(eager.params, run.params) < 1e-5
    assert_given_back(run)

"""Safety nets on a GPU, for scoped and whole-step graphs: an unstable warmup, a parameter unfrozen after capture,
a memory budget. Run with `pytest -m cuda`."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import (
    assert_losses_close,
    fit_cuda,
    graph_callbacks,
    graph_pool_bytes,
    max_param_diff,
    parameters_of,
    patched_forwards,
)
from tests.models import SMALL, DecoderModule, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP, UNFREEZE_AT = 16, 3, 8
LR = 3e-4  # a calm run: no loss spike to amplify the last-bit differences of atomics between runs
MODES = [pytest.param("layer", id="layer"), pytest.param("full_iteration", id="full_iteration")]


def _fit(model, data, mode, callbacks=(), **options):
    """Train ``model`` with graphs in ``mode`` (or eagerly for ``mode=None``); return losses, callback and Trainer."""
    strategy, graphs = "auto", []
    if mode == "full_iteration":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, **options)
    elif mode is not None:
        graphs = [CUDAGraphCallback(scope=[mode], warmup_steps=WARMUP, **options)]
    losses, _, fit, _ = fit_cuda(model, data, STEPS, [*callbacks, *graphs], strategy=strategy)
    found = graph_callbacks(fit)
    return losses, (found[0] if found else None), fit


class _NaNLossAtStep1(DecoderModule):
    """A NaN loss at step 1, set the graph-safe way: a device tensor filled before the step, read by it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("scale", torch.ones(()), persistent=False)

    def on_train_batch_start(self, batch, batch_idx):
        self.scale.fill_(float("nan") if self.trainer.global_step == 1 else 1.0)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.scale


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_warmup_loss_keeps_graphs_off(mode):
    model, data = decoder(SMALL, module=_NaNLossAtStep1)
    _, callback, _ = _fit(model, data, mode)
    report = callback.report
    assert report.stage == Stage.DISABLED
    assert report.reason == "nonfinite_warmup"
    assert report.captures == 0
    assert patched_forwards(model) == []
    assert graph_pool_bytes() == 0


class _Unfreeze(pl.Callback):
    """Makes the first block trainable at the start of step ``UNFREEZE_AT`` (like a backbone-finetuning schedule)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == UNFREEZE_AT:
            pl_module.model.blocks[0].requires_grad_(True)


def _frozen_first_block(**overrides):
    model, data = decoder(SMALL, lr=LR, **overrides)
    model.model.blocks[0].requires_grad_(False)
    return model, data


@pytest.mark.parametrize("mode", MODES)
def test_unfreezing_a_parameter_after_capture_rolls_back_on_that_step(mode):
    # Eager reference: the optimizer in the form the whole-step graph runs it until the rollback.
    eager_model, data = _frozen_first_block(fused=mode == "full_iteration")
    eager, _, _ = _fit(eager_model, data, None, callbacks=[_Unfreeze()])
    model, data = _frozen_first_block()
    graphed, callback, _ = _fit(model, data, mode, callbacks=[_Unfreeze()])

    report = callback.report
    assert report.rollbacks == 1
    (reason,) = report.rollback_reasons
    assert reason.startswith("trainable_changed: ") and "blocks.0." in reason, reason
    # Had a graph run step UNFREEZE_AT, the first block would have missed that step's update.
    assert max_param_diff(parameters_of(eager_model), parameters_of(model)) < 1e-4
    assert_losses_close(eager, graphed, 1e-4)
    assert patched_forwards(model) == []


@pytest.mark.parametrize("mode", MODES)
def test_memory_budget_rolls_back_and_gives_the_optimizer_back(mode):
    model, data = decoder(SMALL, lr=LR)
    losses, callback, fit = _fit(model, data, mode, max_pool_mib=1.0)
    report = callback.report
    assert report.stage == Stage.DISABLED
    assert report.rollbacks == 1 and "memory_budget" in report.rollback_reasons[0], report.rollback_reasons
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert patched_forwards(model) == [] and graph_pool_bytes() == 0
    (optimizer,) = fit.optimizers
    (group,) = optimizer.param_groups
    assert isinstance(group["lr"], float) and not group["capturable"]
    # As built: step counts on the CPU, so eager AdamW does not read a device tensor on every step.
    assert all(state["step"].device.type == "cpu" for state in optimizer.state.values())

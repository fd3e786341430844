"""full_iteration on a GPU: the whole training step as one graph. Run with `pytest -m cuda`."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy, Stage
from tests.helpers import (
    RaiseAtStep,
    assert_losses_close,
    fit_cuda,
    graph_callback,
    graph_pool_bytes,
    max_param_diff,
    patched_forwards,
    settled_memory,
    trainer,
)
from tests.models import SMALL, DecoderModule, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP = 30, 3
# The package runs AdamW fused for the whole fit (same algorithm, one kernel per chunk of parameters, step counts on
# the device), so the eager reference is AdamW(fused=True): equal arithmetic, step for step.
GRAPHED_FORM = {"fused": True}


def full(**options) -> CUDAGraphStrategy:
    return CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, **options)


def _logged_losses(fit: pl.Trainer) -> dict[int, float]:
    with open(f"{fit.logger.log_dir}/metrics.csv") as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")}


def test_full_iteration_matches_eager_with_step_schedule_and_clipping(tmp_path):
    # lr 3e-4: at 1e-3 this model spikes around step 9, which amplifies the last-bit differences of
    # nondeterministic kernels (embedding backward uses atomics) far beyond 1e-5, between two eager runs as well.
    overrides = {"lr_step_size": 10, "lr_gamma": 0.5, "lr": 3e-4}
    common = {"gradient_clip_val": 0.5, "log_every_n_steps": 1}
    eager, eager_params, eager_fit, _ = fit_cuda(
        *decoder(SMALL, **overrides, **GRAPHED_FORM), STEPS, logger=CSVLogger(tmp_path, name="eager"), **common
    )
    graphed, graphed_params, fit, model = fit_cuda(
        *decoder(SMALL, **overrides), STEPS, strategy=full(), logger=CSVLogger(tmp_path, name="graphed"), **common
    )
    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.captures == 1 and report.fallbacks == 0
    assert report.replays == STEPS - WARMUP
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5
    # the schedule acted on the captured step, and the optimizer is plain again after release
    (group,) = fit.optimizers[0].param_groups
    assert isinstance(group["lr"], float) and group["lr"] == pytest.approx(3e-4 * 0.5**3)
    assert not group["capturable"]
    # what training_step logged is this step's value, not the capture step's
    eager_logged, graphed_logged = _logged_losses(eager_fit), _logged_losses(fit)
    assert sorted(graphed_logged) == sorted(eager_logged) == list(range(STEPS))
    assert max(abs(eager_logged[s] - graphed_logged[s]) for s in eager_logged) < 1e-5
    assert patched_forwards(model) == []


def test_bf16_mixed_matches_eager():
    # bf16 kernels with atomics differ run to run (two eager runs too); 12 steps keep that drift below bf16 tolerance
    eager, _, _, _ = fit_cuda(*decoder(SMALL, **GRAPHED_FORM), 12, precision="bf16-mixed")
    graphed, _, fit, _ = fit_cuda(*decoder(SMALL), 12, strategy=full(), precision="bf16-mixed")
    assert graph_callback(fit).report.stage == Stage.REPLAYING
    assert_losses_close(eager, graphed, 2e-2)


def test_16_mixed_needs_a_fused_optimizer():
    with pytest.raises(ValueError, match="fused=True"):
        fit_cuda(*decoder(SMALL), STEPS, strategy=full(), precision="16-mixed")
    eager, _, _, _ = fit_cuda(*decoder(SMALL, **GRAPHED_FORM), STEPS, precision="16-mixed")
    graphed, _, fit, _ = fit_cuda(*decoder(SMALL, fused=True), STEPS, strategy=full(), precision="16-mixed")
    assert graph_callback(fit).report.stage == Stage.REPLAYING, graph_callback(fit).report.reason
    assert_losses_close(eager, graphed, 2e-2)


def test_sgd_with_momentum_and_epoch_schedule():
    class EpochDecay(DecoderModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)]

    def run(strategy):
        return fit_cuda(*decoder(SMALL, module=EpochDecay, train_samples=8 * 8), 24, strategy=strategy)

    eager, eager_params, _, _ = run("auto")
    graphed, graphed_params, fit, _ = run(full())
    assert graph_callback(fit).report.stage == Stage.REPLAYING, graph_callback(fit).report.reason
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5


class _SyncWindow(pl.Callback):
    """Makes any host sync an error from the end of one replayed step to the end of the next."""

    def __init__(self, callback: CUDAGraphCallback, steps: int) -> None:
        self.callback, self.steps, self.checked = callback, steps, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.get_sync_debug_mode():
            torch.cuda.set_sync_debug_mode(0)
            self.checked += 1
        if self.callback.report.stage == Stage.REPLAYING and trainer.global_step < self.steps - 1:
            torch.cuda.set_sync_debug_mode("error")

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode(0)


def test_no_host_sync_in_replayed_steps():
    # Replays, not audits (each audit takes one host sync for its decision): audits off here.
    callback = CUDAGraphCallback(scope=["full_iteration"], warmup_steps=WARMUP, audit_every_n_steps=None)
    window = _SyncWindow(callback, STEPS)  # first: it opens the window before every other end-of-step hook runs
    model, data = decoder(SMALL)
    fit = trainer(STEPS, [window, callback], accelerator="cuda", devices=1, strategy=full(), log_every_n_steps=1000)
    fit.fit(model, data)
    assert callback.report.stage == Stage.REPLAYING
    assert window.checked >= STEPS - WARMUP - 4


class _PoisonedLoss(DecoderModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("loss_scale", torch.ones(()))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch) * self.loss_scale
        self.log("train_loss", loss)
        return loss


class _Poison(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            pl_module.loss_scale.fill_(float("nan"))


@pytest.mark.parametrize("on_failure", ["eager", "raise"])
def test_nan_loss_is_caught_within_one_log_interval(on_failure):
    model, data = decoder(SMALL, module=_PoisonedLoss)
    strategy = full(on_failure=on_failure)
    poison_at, interval = 12, 5
    if on_failure == "raise":
        with pytest.raises(RuntimeError, match=f"first at step {poison_at}"):
            fit_cuda(model, data, STEPS, [_Poison(poison_at)], strategy=strategy, log_every_n_steps=interval)
        return
    with pytest.warns(UserWarning, match="nonfinite_loss"):
        fit = fit_cuda(model, data, STEPS, [_Poison(poison_at)], strategy=strategy, log_every_n_steps=interval).trainer
    report = graph_callback(fit).report
    assert report.stage == Stage.DISABLED
    ((first, count),) = report.nonfinite
    assert first == poison_at
    detected_at = poison_at + count  # the steps since the poisoning that ran before the check
    assert detected_at - poison_at <= interval


def test_ragged_batch_runs_eagerly_then_is_recaptured():
    overrides = {"train_samples": 8 * 4 + 5, "drop_last": False, **GRAPHED_FORM}
    eager, _, _, _ = fit_cuda(*decoder(SMALL, **overrides), 20)
    graphed, _, fit, _ = fit_cuda(*decoder(SMALL, **overrides), 20, strategy=full())
    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING
    ragged, rechecks = _fallbacks(report)
    assert ragged == 4, report.fallback_reasons  # the ragged last batch of each epoch runs eagerly
    assert rechecks == 3, report.fallback_reasons  # each later epoch's first step re-checks the step's Python
    assert_losses_close(eager, graphed, 1e-5)

    recaptured, _, fit, _ = fit_cuda(*decoder(SMALL, **overrides), 20, strategy=full(on_shape_change="recapture"))
    report = graph_callback(fit).report
    assert report.captures == 2 and _fallbacks(report) == (1, 3), report.fallback_reasons
    assert_losses_close(eager, recaptured, 1e-5)


def _fallbacks(report) -> tuple[int, int]:
    """The eager steps of the ragged batch shape, and the epochs' re-checks of the step's Python."""
    reasons = report.fallback_reasons
    rechecks = sum(n for reason, n in reasons.items() if reason.startswith("step_python_recheck"))
    return sum(n for reason, n in reasons.items() if "[5, 128]" in reason), rechecks


def test_validation_in_between_and_resume_from_checkpoint(tmp_path):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    common = {"limit_val_batches": 2, "val_check_interval": 5, "enable_checkpointing": True}
    eager, _, _, _ = fit_cuda(*decoder(SMALL, val_samples=16, **GRAPHED_FORM), STEPS, **common)
    graphed, _, fit, _ = fit_cuda(*decoder(SMALL, val_samples=16), STEPS, [checkpoint], strategy=full(), **common)
    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING and report.fallbacks == 0
    assert_losses_close(eager, graphed, 1e-5)

    model, data = decoder(SMALL)
    resumed = trainer(STEPS, [], accelerator="cuda", devices=1, strategy=full())
    resumed.fit(model, data, ckpt_path=tmp_path / "epoch=0-step=10.ckpt")
    report = graph_callback(resumed).report
    assert report.stage == Stage.REPLAYING
    assert report.captures == 2  # one before the checkpoint, one after resuming
    assert report.replays == (10 - WARMUP) + (STEPS - 10 - WARMUP)


def test_exception_releases_graphs_pool_and_optimizer():
    def failed_fit():
        model, data = decoder(SMALL)
        fit = trainer(STEPS, [RaiseAtStep(9, "boom")], accelerator="cuda", devices=1, strategy=full())
        with pytest.raises(RuntimeError, match="boom"):
            fit.fit(model, data)
        (group,) = fit.optimizers[0].param_groups
        assert isinstance(group["lr"], float)
        assert not group["capturable"]
        assert patched_forwards(model) == []
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        report = graph_callback(fit).report
        del fit, model, data, group
        return settled_memory(), report

    first, report = failed_fit()
    second, _ = failed_fit()
    assert report.captures == 1
    assert report.graphs == 0
    assert graph_pool_bytes() == 0
    assert second == first


@pytest.mark.parametrize(
    ("scope", "warmup"), [pytest.param(["full_iteration"], 11, id="full"), pytest.param(["layer"], 3, id="layer")]
)
def test_ddp_single_process_nccl(scope, warmup):
    """DDP with one process (NCCL, world size 1): DDP built on the side stream, all-reduce inside the graph."""
    overrides = {"lr": 3e-4, **(GRAPHED_FORM if warmup > 3 else {})}
    eager, eager_params, _, _ = fit_cuda(*decoder(SMALL, **overrides), 20, strategy=DDPStrategy())
    graphed, graphed_params, fit, _ = fit_cuda(
        *decoder(SMALL, lr=3e-4), 20, strategy=DDPCUDAGraphStrategy(scope=scope, warmup_steps=warmup)
    )
    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5

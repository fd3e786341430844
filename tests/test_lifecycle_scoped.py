"""The scoped lifecycle on a CPU, driven for real through the fake capture backend.

Warmup recording, the capture decision, patched forwards, confirmation (parity, addresses, trainability), replay
counting, fallbacks, rollback and release all run here exactly as on a GPU; only the device work is the fake's.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import RaiseAtStep, RebindAt, assert_losses_close, fit, graph_callback, patched_forwards, trainer
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
STEPS = 8
WARMUP = 2
LAYERS = TINY["n_layer"]


def graphed(backend: FakeBackend | None = None, **options) -> CUDAGraphCallback:
    """A callback whose captures go to a fake backend."""
    callback = CUDAGraphCallback(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    callback.capture_backend = backend or FakeBackend()
    return callback


class Probe(pl.Callback):
    """What the package has in place at the end of every training batch (placed after the graph callback)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.patched: list[int] = []
        self.entered: list[bool] = []
        self.stages: list[Stage] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.patched.append(len(patched_forwards(pl_module)))
        self.entered.append(self.backend.entered)
        self.stages.append(graph_callback(trainer).report.stage)


def assert_released(model: nn.Module, backend: FakeBackend) -> None:
    assert patched_forwards(model) == [], "a forward stayed patched"
    assert backend.live_graphs == 0, "a graph was not reset"
    assert not backend.entered, "training stayed on the package's stream"
    assert backend.releases >= 1


def batches_of_sizes(sizes: list[int], seed: int = 0) -> DataLoader:
    """Token batches whose batch dimension follows ``sizes`` (one batch each)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(TINY["vocab_size"], (max(sizes), TINY["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)


def test_warmup_capture_confirmation_replay_and_release_run_in_order():
    backend = FakeBackend()
    callback, probe = graphed(backend), Probe(backend)
    eager = fit(*decoder(TINY), STEPS, **CPU)
    run = fit(*decoder(TINY), STEPS, [callback, probe], **CPU)

    report = callback.report
    assert probe.stages == [Stage.WARMUP] * WARMUP + [Stage.CONFIRMING] + [Stage.REPLAYING] * (STEPS - WARMUP - 1)
    assert (report.captures, report.graphs, report.rollbacks, report.fallbacks) == (1, 0, 0, 0)
    assert report.replays == (STEPS - WARMUP) * LAYERS  # the capture step's parity replays included
    assert report.parity_err == 0.0
    assert report.scopes == {"layer": [f"model.blocks.{i}" for i in range(LAYERS)]}
    assert probe.patched == [LAYERS] * STEPS and all(probe.entered)
    assert sum(region.replays for region in backend.regions) > 0
    assert_released(run.model, backend)
    assert_losses_close(eager.losses, run.losses, 1e-6)


class _RebindInside(pl.Callback):
    """Rebinds a parameter inside the first layer at ``step`` (a ``.data`` swap: same Parameter, new storage)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            weight = pl_module.model.blocks[0].mlp.fc.weight
            weight.data = weight.data.clone()


class _Unfreeze(pl.Callback):
    """Freezes the first layer's norm at fit start and unfreezes it at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer, pl_module):
        pl_module.model.blocks[0].ln1.weight.requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.model.blocks[0].ln1.weight.requires_grad_(True)


@pytest.mark.parametrize(
    ("backend", "extra", "reason"),
    [
        pytest.param(
            FakeBackend(distort={f"model.blocks.{i}": 22.0 for i in range(LAYERS)}), [], "parity", id="wrong-graphs"
        ),
        pytest.param(FakeBackend(fail_capture=RuntimeError("capture broke")), [], "capture_failed", id="capture"),
        pytest.param(FakeBackend(), [_RebindInside(step=WARMUP)], "address_changed", id="rebound-parameter"),
        pytest.param(FakeBackend(), [_Unfreeze(step=WARMUP + 3)], "trainable_changed", id="unfrozen-parameter"),
        pytest.param(FakeBackend(mib_per_graph=64.0), [], "memory_budget", id="over-budget"),
    ],
)
def test_a_failed_check_rolls_back_loudly_and_trains_on_eagerly(backend, extra, reason):
    eager = fit(*decoder(TINY), STEPS, [type(cb)(cb.step) for cb in extra], **CPU)
    callback = graphed(backend, max_pool_mib=100)
    with pytest.warns(UserWarning, match=f"rolled back to eager training: {reason}"):
        run = fit(*decoder(TINY), STEPS, [callback, *extra], **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert report.rollback_reasons[0].startswith(reason), report.rollback_reasons
    assert report.reason == f"rollback: {report.rollback_reasons[0]}"
    assert_released(run.model, backend)
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_a_parameter_rebound_mid_step_is_caught_by_the_region_that_reads_it_before_it_replays():
    backend = FakeBackend()
    model, data = decoder(TINY)

    def rebind_on_capture_step(module, args):
        if module.training and graph_callback(run_trainer).report.stage == Stage.CONFIRMING:
            module.mlp.fc.weight.data = module.mlp.fc.weight.data.clone()

    model.model.blocks[1].register_forward_pre_hook(rebind_on_capture_step)  # after block 0 has replayed
    run_trainer = trainer(STEPS, [graphed(backend)], **CPU)
    with pytest.warns(UserWarning, match="address_changed: model.blocks.1.mlp.fc.weight is not the tensor the graph"):
        run_trainer.fit(model, data)
    report = graph_callback(run_trainer).report
    assert report.rollbacks == 1 and report.steps_replayed == 0, "rolled back in the step of the rebind"
    assert_released(model, backend)


def test_on_failure_raise_raises_on_a_failed_check_and_releases():
    backend = FakeBackend(distort={"model.blocks.0": 22.0})
    model, data = decoder(TINY)
    with pytest.raises(RuntimeError, match=r"on_failure='raise'.*parity"):
        trainer(STEPS, [graphed(backend, on_failure="raise")], **CPU).fit(model, data)
    assert_released(model, backend)


class _NaNAtStep(DecoderModule):
    """Returns a non-finite loss at ``global_step == 1`` (a divergence during warmup)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 1 else loss


def test_a_nonfinite_warmup_loss_keeps_graphs_off():
    backend = FakeBackend()
    callback = graphed(backend)
    with pytest.warns(UserWarning, match="nonfinite_warmup"):
        run = fit(*decoder(TINY, module=_NaNAtStep), STEPS, [callback], **CPU)
    assert (callback.report.stage, callback.report.reason) == (Stage.DISABLED, "nonfinite_warmup")
    assert callback.report.captures == 0 and backend.regions == []
    assert_released(run.model, backend)


class _TruncatesOnOddSteps(DecoderModule):
    """Drops the last position on odd steps: the layers' inputs move although the batch shape does not."""

    def forward(self, idx):
        return super().forward(idx[:, : idx.shape[1] - self.trainer.global_step % 2])

    def loss(self, batch):
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[:, : logits.shape[1]].flatten())


def test_inputs_that_move_within_one_batch_shape_keep_graphs_off_and_say_which():
    backend = FakeBackend()
    callback = graphed(backend)
    with pytest.warns(UserWarning, match="input signatures moved during the warmup steps"):
        run = fit(*decoder(TINY, module=_TruncatesOnOddSteps), 5, [callback], **CPU)
    reason = callback.report.reason
    assert reason.startswith("shape_unstable: model.blocks.0: input 0: float32[8, 16, 32]"), reason
    assert "-> float32[8, 15, 32]" in reason
    assert callback.report.captures == 0
    assert_released(run.model, backend)


def test_shapes_that_rotate_from_the_start_each_get_their_own_warmup_and_graphs():
    callback = graphed(on_shape_change="recapture")
    sizes = [4, 3] * 8
    run = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), [callback], **CPU)
    report = callback.report
    assert (report.stage, report.captures, report.rollbacks, report.evictions) == (Stage.REPLAYING, 2, 0, 0)
    # Each shape records its own WARMUP steps (they alternate), then each replays from its capture on.
    assert report.steps_replayed == len(sizes) - 2 * WARMUP
    eager = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_a_batch_of_another_shape_falls_back_for_that_step_and_is_counted():
    callback = graphed()
    sizes = [4] * (WARMUP + 3) + [3] + [4] * 2
    run = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), [callback], **CPU)
    report = callback.report
    assert (report.stage, report.fallbacks) == (Stage.REPLAYING, LAYERS)
    [(reason, count)] = report.fallback_reasons.items()
    assert count == LAYERS and "[3, 16] differs from the captured int64[4, 16]" in reason
    eager = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_the_shape_cache_evicts_the_least_recently_used_and_captures_it_again():
    backend = FakeBackend()
    callback, probe = graphed(backend, on_shape_change="recapture", max_graphs=2), Probe(backend)
    sizes = [4] * (WARMUP + 2) + [3, 2, 4] * 3  # three shapes, the cache holds two
    run = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), [callback, probe], **CPU)
    report = callback.report
    assert report.stage == Stage.REPLAYING
    assert max(backend.live_graphs for backend in [backend]) == 0  # all released at fit end
    assert report.captures == 4 and report.evictions == 2, (report.captures, report.evictions)
    assert report.fallbacks == 3 * LAYERS, "each new or evicted shape runs one eager step of its own, counted"
    eager = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_a_sealed_set_of_shapes_raises_on_a_new_shape_and_names_the_captured_ones():
    sizes = [4] * (WARMUP + 3) + [3]
    callback = graphed(on_shape_change="recapture", seal_after_steps=WARMUP + 2)
    with pytest.raises(RuntimeError, match=r"batch shape \[int64\[3, 16\].*sealed \(captured: \[int64\[4, 16\]"):
        fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), [callback], **CPU)


def test_a_parameter_rebound_after_confirmation_rolls_back_before_the_next_replay():
    backend = FakeBackend()
    callback = graphed(backend)
    with pytest.warns(UserWarning, match="rolled back to eager training: address_changed: model.blocks.1.attn.qkv"):
        run = fit(
            *decoder(TINY),
            12,
            [callback, RebindAt(WARMUP + 4, "model.blocks.1.attn.qkv.weight")],
            log_every_n_steps=2,
            **CPU,
        )
    assert callback.report.rollbacks == 1 and callback.report.stage == Stage.DISABLED
    assert callback.report.steps_replayed >= 3, "the graphs were confirmed and replaying before the rebind"
    assert_released(run.model, backend)


def test_on_shape_change_error_raises_with_both_shapes():
    sizes = [4] * (WARMUP + 2) + [3]
    with pytest.raises(RuntimeError, match=r"on_shape_change='error'.*int64\[3, 16\].*int64\[4, 16\]"):
        fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), [graphed(on_shape_change="error")], **CPU)


class _HookWitness:
    """A forward hook that notes whether the fake backend was capturing when it ran."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend, self.calls, self.during_capture = backend, 0, 0

    def __call__(self, module, args, output):
        self.calls += 1
        self.during_capture += self.backend.capturing


def test_hooks_inside_a_region_are_stashed_while_capturing_and_the_regions_own_pre_hooks_keep_firing():
    backend = FakeBackend()
    inner = _HookWitness(backend)
    model, data = decoder(TINY)
    model.model.blocks[0].mlp.register_forward_hook(inner)
    region_calls = []
    model.model.blocks[0].register_forward_pre_hook(lambda module, args: region_calls.append(module.training))
    callback = graphed(backend)
    with pytest.warns(UserWarning, match="hook"):
        fit(model, data, STEPS, [callback], **CPU)
    assert callback.report.stage == Stage.REPLAYING
    assert inner.calls >= WARMUP, "the inner hook fires in eager steps"
    assert inner.during_capture == 0, "a hook ran while the region was being captured"
    assert region_calls.count(True) == STEPS, "the region's own pre-hook fires on every step, replays included"


class _MetricInside(nn.Module):
    """An MLP that updates a torchmetrics metric in its forward (a replay would not count the update)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inner, self.mean = mlp, MeanMetric()

    def forward(self, x):
        self.mean.update(x.detach().mean())
        return self.inner(x)


class _WithMetricInside(DecoderModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model.blocks[0].mlp = _MetricInside(self.model.blocks[0].mlp)


def test_a_metric_updated_inside_a_region_leaves_that_region_eager_with_the_fix():
    # torchmetrics' update syncs with the host (its NaN check), so the region's capture fails, as on CUDA: the region
    # stays eager (its metric counts every step), the others keep their graphs, and the reason names the metric.
    backend = FakeBackend()
    callback = graphed(backend, scope=["mlp"])
    with pytest.warns(UserWarning, match="metric_in_graph"):
        run = fit(*decoder(TINY, module=_WithMetricInside), STEPS, [callback], **CPU)
    reason = callback.report.exclusions["model.blocks.0.mlp"]
    assert reason.startswith("metric_in_graph") and "model.blocks.0.mlp.mean" in reason
    assert "on_train_batch_end" in reason
    assert callback.report.stage == Stage.REPLAYING
    assert run.model.model.blocks[0].mlp.mean.update_count == STEPS
    assert_released(run.model, backend)


@pytest.mark.parametrize("ending", ["early_stopping", "keyboard_interrupt", "exception"])
def test_every_way_a_fit_ends_releases_everything(ending):
    backend = FakeBackend()
    probe = Probe(backend)
    callbacks: list[pl.Callback] = [graphed(backend), probe]
    if ending == "early_stopping":
        callbacks.append(EarlyStopping("train_loss", stopping_threshold=100.0, check_on_train_epoch_end=True))
    elif ending == "keyboard_interrupt":
        callbacks.append(_Interrupt(step=WARMUP + 3))
    else:
        callbacks.append(RaiseAtStep(WARMUP + 3))
    model, data = decoder(TINY, train_samples=4 * (WARMUP + 4))
    run = trainer(50, callbacks, **CPU)
    try:
        run.fit(model, data)
    except (RuntimeError, SystemExit, KeyboardInterrupt):
        assert ending != "early_stopping"
    assert max(probe.patched) == LAYERS and any(probe.entered), "graphs were in use before the fit ended"
    assert run.global_step < 50
    assert_released(model, backend)


class _Interrupt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_validate_test_predict_and_a_second_fit_after_a_graphed_fit(tmp_path):
    backend = FakeBackend()
    callback = graphed(backend)
    model, data = decoder(TINY, train_samples=4 * STEPS, batch_size=4)
    run = trainer(-1, [callback], max_epochs=1, limit_val_batches=1.0, default_root_dir=tmp_path, **CPU)
    run.fit(model, data)
    assert callback.report.stage == Stage.REPLAYING and backend.regions

    loader = data.val_dataloader()
    assert "val_loss" in run.validate(model, dataloaders=loader, verbose=False)[0]
    assert "test_loss" in run.test(model, dataloaders=loader, verbose=False)[0]
    predictions = run.predict(model, dataloaders=loader)
    with torch.no_grad():
        assert torch.equal(predictions[0], model.eval()(next(iter(loader))[0])), "predict is the plain forward"
    model.train()
    assert_released(model, backend)

    run.fit_loop.max_epochs = 2
    run.fit(model, data)
    report = callback.report  # a second fit starts a fresh rollout
    assert (report.stage, report.captures, report.rollbacks) == (Stage.REPLAYING, 1, 0), report.reason
    assert len(backend.regions) == 2 * LAYERS, "the second fit captured its own graphs"
    assert_released(model, backend)


def test_resume_restores_the_counters_and_captures_again(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = graphed()
    trainer(STEPS, [first, checkpoint], enable_checkpointing=True, **CPU).fit(*decoder(TINY))
    saved = first.report.replays

    backend = FakeBackend()
    second = graphed(backend)
    model, data = decoder(TINY)
    resumed = trainer(STEPS + 4, [second], enable_checkpointing=True, default_root_dir=tmp_path, **CPU)
    resumed.fit(model, data, ckpt_path=checkpoint.last_model_path)
    report = second.report
    assert report.stage == Stage.REPLAYING and backend.regions, "graphs are captured again after a resume"
    assert report.captures == 2, "one capture restored from the checkpoint, one in this fit"
    assert report.replays == saved + (4 - WARMUP) * LAYERS
    assert_released(model, backend)


class _SealAndBreak(pl.Callback):
    """At ``step``: a captured graph starts computing something else, then the set of shapes is sealed."""

    def __init__(self, backend: FakeBackend, step: int) -> None:
        self.backend, self.step = backend, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.backend.regions[0]._distort = 22.0
            graph_callback(trainer).seal()


def test_sealing_checks_every_captured_shape_against_eager_once_more():
    backend = FakeBackend()
    callback = graphed(backend, audit_every_n_steps=0)  # no audit: only the seal's own check can find the change
    with pytest.warns(UserWarning, match="model.blocks.0 stays eager, the other regions keep their graphs: parity"):
        run = fit(*decoder(TINY), STEPS + 4, [callback, _SealAndBreak(backend, WARMUP + 3)], **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0)
    assert list(report.exclusions) == ["model.blocks.0"], "the region that no longer agrees is left eager"
    assert report.steps_replayed >= 3, "the graphs replayed before the seal"
    excluded, kept = backend.regions
    assert kept.replays > excluded.replays + 2, "the other region kept replaying its graph to the end"
    assert_released(run.model, backend)

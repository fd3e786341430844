"""Scoped capture on a GPU: graphed training must be eager training, only faster. Run with `pytest -m cuda`."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import (
    RaiseAtStep,
    assert_losses_close,
    fit_cuda,
    graph_pool_bytes,
    max_param_diff,
    patched_forwards,
    settled_memory,
    trainer,
)
from tests.models import SMALL, TINY, DecoderModule, MoEDecoderModule, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP = 20, 3


@pytest.mark.parametrize(
    ("scope", "graphs"),
    [
        pytest.param(["layer"], SMALL["n_layer"], id="layer"),
        pytest.param(["attn", "mlp"], 2 * SMALL["n_layer"], id="attn+mlp"),
        pytest.param(["attn"], SMALL["n_layer"], id="attn"),
    ],
)
def test_graphed_training_matches_eager_fp32(scope, graphs):
    eager, eager_params, _, _ = fit_cuda(*decoder(SMALL), STEPS)
    callback = CUDAGraphCallback(scope=scope, warmup_steps=WARMUP)
    graphed, graphed_params, _, model = fit_cuda(*decoder(SMALL), STEPS, [callback])

    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5
    assert report.graphs == 0  # released at fit end
    assert report.captures == 1
    assert report.replays == (STEPS - WARMUP) * graphs
    assert report.fallbacks == 0
    assert report.parity_err < 1e-4
    assert report.pool_mib > 0 and report.capture_ms > 0
    assert patched_forwards(model) == []


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_graphed_training_matches_eager_mixed_precision(precision):
    eager = fit_cuda(*decoder(SMALL), STEPS, precision=precision).losses
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed = fit_cuda(*decoder(SMALL), STEPS, [callback], precision=precision).losses
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    # Same kernels in both runs; reduced precision leaves room only for nondeterministic reductions.
    assert_losses_close(eager, graphed, 2e-2)
    assert callback.report.fallbacks == 0


def test_dropout_draws_the_masks_eager_training_draws():
    """Replays advance the CUDA generator like eager kernels do: with dropout, graphed == eager, step by step."""
    eager = fit_cuda(*decoder(SMALL, dropout=0.1), STEPS).losses
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed = fit_cuda(*decoder(SMALL, dropout=0.1), STEPS, [callback]).losses
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert_losses_close(eager, graphed, 1e-4)


class _DropoutProbe(DecoderModule):
    """Late in training, replays its first block on one fixed input, once in each of two steps, before the step's own
    forward (whose call of that block then runs eagerly: one replay per region and step)."""

    probes: list[torch.Tensor]

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step in (STEPS - 3, STEPS - 2):
            generator = torch.Generator(device=self.device).manual_seed(0)
            x = torch.randn(8, 128, 256, device=self.device, generator=generator, requires_grad=True)
            self.probes = [*getattr(self, "probes", []), self.model.blocks[0](x).detach().clone()]
        return super().training_step(batch, batch_idx)


def test_dropout_masks_are_fresh_on_every_replay():
    model, data = decoder(SMALL, module=_DropoutProbe, dropout=0.5)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, audit_every_n_steps=None)
    trainer(STEPS, [callback], accelerator="cuda", devices=1).fit(model, data)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.replays == (STEPS - WARMUP) * SMALL["n_layer"]  # the probe's calls replayed in their place
    assert callback.report.fallback_reasons and all("called_again" in r for r in callback.report.fallback_reasons)
    first, second = model.probes
    assert float((first - second).abs().max()) > 1e-2  # another dropout mask on the second replay, same input


def test_ragged_last_batch_falls_back_for_that_step_only():
    overrides = {"train_samples": 8 * 10 + 5, "drop_last": False}
    steps = 13  # epoch of 11 batches (the last has 5 rows), then 2 more
    eager = fit_cuda(*decoder(SMALL, **overrides), steps).losses
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed = fit_cuda(*decoder(SMALL, **overrides), steps, [callback]).losses
    report = callback.report
    assert report.stage == Stage.REPLAYING
    assert report.fallbacks == SMALL["n_layer"]  # the ragged step, every layer once
    (reason,) = report.fallback_reasons
    assert "[5, 128]" in reason and "[8, 128]" in reason
    assert report.replays == (steps - WARMUP - 1) * SMALL["n_layer"]
    assert_losses_close(eager, graphed, 1e-5)


def test_ragged_batch_is_captured_again_with_recapture():
    overrides = {"train_samples": 8 * 4 + 5, "drop_last": False}
    steps = 5 * 4  # four epochs of 5 batches: the 5-row batch appears four times
    eager = fit_cuda(*decoder(SMALL, **overrides), steps).losses
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, on_shape_change="recapture")
    graphed = fit_cuda(*decoder(SMALL, **overrides), steps, [callback]).losses
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.captures == 2
    assert report.fallbacks == SMALL["n_layer"]  # only its first sighting ran eagerly
    assert_losses_close(eager, graphed, 1e-5)


def test_shape_change_error_policy_raises_with_the_shapes():
    model, data = decoder(SMALL, train_samples=8 * 5 + 3, drop_last=False)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, on_shape_change="error")
    with pytest.raises(RuntimeError, match=r"\[3, 128\]"):
        trainer(8, [callback], accelerator="cuda", devices=1).fit(model, data)
    assert patched_forwards(model) == []


def test_gradient_accumulation_and_clipping_match_eager():
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    eager, eager_params, _, _ = fit_cuda(*decoder(SMALL), 10, **kwargs)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed, graphed_params, _, _ = fit_cuda(*decoder(SMALL), 10, [callback], **kwargs)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5


def _failed_fit() -> tuple[int, object]:
    """Memory once a graphed fit died mid-training and every reference to it is gone (the report is plain data)."""

    model, data = decoder(SMALL)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(STEPS, [callback, RaiseAtStep(9, "boom")], accelerator="cuda", devices=1).fit(model, data)
    assert patched_forwards(model) == []
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    report = callback.report
    del model, data, callback
    return settled_memory(), report


def test_exception_mid_training_releases_everything():
    first, report = _failed_fit()
    second, _ = _failed_fit()
    assert report.captures == 1
    assert report.graphs == 0
    assert graph_pool_bytes() == 0  # every graph and its pool are gone
    assert second == first  # nothing accumulates from one failed fit to the next
    assert first <= report.memory_before_capture


def test_hook_that_rebinds_a_parameter_is_caught_and_rolled_back():
    model, data = decoder(SMALL)
    target = model.model.blocks[2]

    def rebind(module, args):
        if module.training and callback.report.stage == Stage.CONFIRMING and not getattr(module, "_rebound", False):
            module._rebound = True
            module.mlp.fc.weight = nn.Parameter(module.mlp.fc.weight.detach().clone())

    target.register_forward_pre_hook(rebind)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, confirm_steps=3)
    with pytest.warns(UserWarning, match="rolled back"):
        trainer(STEPS, [callback], accelerator="cuda", devices=1).fit(model, data)
    report = callback.report
    assert report.stage == Stage.DISABLED
    assert report.rollbacks == 1
    assert "address_changed" in report.rollback_reasons[0]
    assert "blocks.2.mlp.fc.weight" in report.rollback_reasons[0]
    assert patched_forwards(model) == []


def test_rollback_can_raise_instead():
    model, data = decoder(SMALL)

    def rebind(module, args):
        if module.training and callback.report.stage == Stage.CONFIRMING:
            module.fc.weight = nn.Parameter(module.fc.weight.detach().clone())

    model.model.blocks[0].mlp.register_forward_pre_hook(rebind)
    callback = CUDAGraphCallback(scope=["mlp"], warmup_steps=WARMUP, on_failure="raise")
    with pytest.raises(RuntimeError, match="address_changed"):
        trainer(STEPS, [callback], accelerator="cuda", devices=1).fit(model, data)
    assert patched_forwards(model) == []


def _train_with_hooks(callback):
    model, data = decoder(SMALL)
    calls = []
    counting = model.model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append(m.training))
    model.model.blocks[3].register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))  # changes what the graph sees
    losses = fit_cuda(model, data, STEPS, [callback] if callback else []).losses
    counting.remove()  # handles stay valid through capture and release
    return losses, calls


def test_forward_pre_hooks_on_a_target_keep_firing_after_capture():
    eager, eager_calls = _train_with_hooks(None)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed, graphed_calls = _train_with_hooks(callback)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert graphed_calls.count(True) == eager_calls.count(True) == STEPS
    assert_losses_close(eager, graphed, 1e-5)


def test_validation_second_fit_checkpoint_and_resume(tmp_path):
    model, data = decoder(SMALL, val_samples=16)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    fit = trainer(
        STEPS,
        [callback, checkpoint],
        accelerator="cuda",
        devices=1,
        limit_val_batches=2,
        val_check_interval=5,
        enable_checkpointing=True,
    )
    fit.fit(model, data)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.fallbacks == 0  # validation runs eagerly, outside the graphs, uncounted

    # validation/test/predict after fit: as if the package had never been there
    results = fit.validate(model, data, verbose=False)
    assert torch.isfinite(torch.tensor(results[0]["val_loss"]))

    # a second fit on the same model and Trainer captures again
    fit.fit_loop.epoch_loop.max_steps = STEPS + 10
    fit.fit(model, data)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.captures == 1

    # a checkpoint saved while graphs were active loads into a plain model
    saved = torch.load(tmp_path / "epoch=0-step=10.ckpt", weights_only=False)
    plain, _ = decoder(SMALL)
    plain.load_state_dict(saved["state_dict"], strict=True)

    # resuming warms up and captures again, with the counters restored
    resumed_callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    resumed, data = decoder(SMALL)
    trainer(STEPS, [resumed_callback], accelerator="cuda", devices=1).fit(
        resumed, data, ckpt_path=tmp_path / "epoch=0-step=10.ckpt"
    )
    assert resumed_callback.report.stage == Stage.REPLAYING
    assert resumed_callback.report.replays == (10 - WARMUP) * 6 + (STEPS - 10 - WARMUP) * 6


class _BatchNormNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(64, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _train_batchnorm(callback):
    pl.seed_everything(0, verbose=False)
    model = _BatchNormNet()
    data = torch.utils.data.TensorDataset(torch.randn(32 * 16, 64), torch.randn(32 * 16))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    trainer(16, [callback] if callback else [], accelerator="cuda", devices=1).fit(model, loader)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_capture_leaves_batchnorm_statistics_and_rng_as_eager_training_has_them():
    eager = _train_batchnorm(None)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    graphed = _train_batchnorm(callback)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    for key in eager:
        assert torch.allclose(eager[key].float(), graphed[key].float(), atol=1e-5), key


class _TorchTransformer(pl.LightningModule):
    """nn.TransformerEncoderLayer calls its nn.MultiheadAttention with keywords (need_weights=False, masks)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(64, 64)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(self.embed(x), mask=self.mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, 64), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_multihead_attention_with_keyword_arguments_and_masks():
    def run(callback):
        pl.seed_everything(0, verbose=False)
        model = _TorchTransformer()
        tokens = torch.randint(64, (64, 17))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), 8)
        return fit_cuda(model, loader, 12, [callback] if callback else []).losses

    eager = run(None)
    callback = CUDAGraphCallback(scope=["attn"], warmup_steps=WARMUP)
    graphed = run(callback)
    report = callback.report
    assert report.scopes["attn"] == [f"encoder.layers.{i}.self_attn" for i in range(3)]
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.fallbacks == 0
    assert_losses_close(eager, graphed, 1e-5)


@pytest.mark.timing
def test_tiny_model_on_cuda_with_auto_scope():
    callback = CUDAGraphCallback()
    fit_cuda(*decoder(TINY), 40, [callback])
    report = callback.report
    assert report.scopes and "attn" in report.scopes
    assert report.stage == Stage.REPLAYING, (report.reason, report.ladder)
    assert report.level in {"attn", "attn+mlp", "layer", "model"}


@pytest.mark.parametrize(
    ("scope", "graphs"),
    [
        pytest.param(["moe_router", "moe_preprocess"], 2 * SMALL["n_layer"], id="router+preprocess"),
        pytest.param(["moe"], SMALL["n_layer"], id="moe"),
    ],
)
def test_moe_scopes_match_eager(scope, graphs):
    def run(callback):
        model, data = decoder(SMALL, module=MoEDecoderModule, experts=4)
        return fit_cuda(model, data, STEPS, [callback] if callback else []).losses

    eager = run(None)
    callback = CUDAGraphCallback(scope=scope, warmup_steps=WARMUP)
    graphed = run(callback)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays == (STEPS - WARMUP) * graphs
    assert report.fallbacks == 0
    assert_losses_close(eager, graphed, 1e-5)


class _CheckpointedMLP(nn.Module):
    """An MLP whose forward runs through ``torch.utils.checkpoint`` (activation recomputation inside a region)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_inside_a_region_is_refused_before_any_gpu_work(reentrant):
    class Checkpointed(DecoderModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            for block in self.model.blocks:
                block.mlp = _CheckpointedMLP(block.mlp, reentrant)

    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    with pytest.raises(ValueError, match=r"activation checkpointing.*_CheckpointedMLP\.forward calls torch\.utils"):
        fit_cuda(*decoder(TINY, module=Checkpointed), STEPS, [callback])
    assert callback.report.stage == Stage.DISABLED

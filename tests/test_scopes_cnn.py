"""``layer`` on convolutional networks: the blocks of torchvision's and timm's CNNs, and BatchNorm under their graphs.

The models are lookalikes of the libraries' trees (:mod:`tests.cnn_models`): same module names, same class names.
A fit through the fake capture backend trains the blocks on replayed regions; their BatchNorm running statistics
and batch counters must end where eager training leaves them (capture and its warmup leave no trace).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, Stage
from lightning_cudagraph._options.levels import build_levels
from lightning_cudagraph._options.scopes import resolve_scopes
from tests.cnn_models import LAYOUTS, BasicBlock, classification_loss, mobilenet_v3_small, named, resnet18
from tests.fake_backend import FakeBackend
from tests.helpers import assert_losses_close, fit, patched_forwards

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
STEPS = 10


def layer_targets(model: nn.Module) -> list[str]:
    return [target.name for target in resolve_scopes(model, ["layer"]).targets]


# ---------------------------------------------------------------------------------------------- what layer finds
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layer_finds_the_blocks_of_each_cnn_layout_and_not_its_stem_head_or_stage(layout):
    model, blocks = LAYOUTS[layout]()
    assert layer_targets(model) == blocks


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_auto_ladder_on_a_cnn_reaches_its_blocks(layout):
    model, blocks = LAYOUTS[layout]()
    levels = {level.name: level for level in build_levels(model, {}, whole_step_problem="needs the strategy")}
    assert [target.name for target in levels["layer"].targets] == blocks
    assert levels["layer"].unavailable is None
    assert levels["attn"].unavailable == "no attn or mamba modules"


def test_timm_convnext_climbs_from_its_mlps_to_whole_blocks():
    model, blocks = LAYOUTS["timm-convnext_atto"]()
    levels = {level.name: level for level in build_levels(model, {}, whole_step_problem="needs the strategy")}
    assert [target.name for target in levels["attn+mlp"].targets] == [f"{block}.mlp" for block in blocks]
    assert [target.name for target in levels["layer"].targets] == blocks


def test_a_resnet_with_its_own_block_class_is_found_by_structure():
    def own_block(channels: int) -> nn.Module:
        block = named("PreActBlock")()
        block.bn, block.conv = nn.BatchNorm2d(channels), nn.Conv2d(channels, channels, 3, padding=1)
        return block

    model = nn.Module()
    model.conv1 = nn.Conv2d(3, 4, 3)
    model.layer1 = nn.Sequential(own_block(4), own_block(4))
    model.layer2 = nn.Sequential(own_block(4))
    model.fc = nn.Linear(4, 10)
    assert layer_targets(model) == ["layer1.0", "layer1.1", "layer2.0"]


def test_plain_sequential_convolutions_are_not_layers():
    vgg = nn.Module()
    vgg.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.ReLU())
    vgg.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU())  # leaves, not blocks
    vgg.classifier = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 10))
    with pytest.raises(ValueError, match="scope 'layer' matches no module"):
        resolve_scopes(vgg, ["layer"])


def test_a_layer_list_of_small_sequentials_keeps_each_sequential_as_a_layer():
    model = nn.Module()
    model.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)) for _ in range(2)])
    assert layer_targets(model) == ["blocks.0", "blocks.1"]


def test_a_stage_of_blocks_of_different_classes_stays_one_layer():
    model = nn.Module()
    mixed = nn.Sequential(BasicBlock(4, 4), named("EdgeResidual", nn.Sequential)(nn.Conv2d(4, 4, 1)))
    model.blocks = nn.Sequential(mixed)
    assert layer_targets(model) == ["blocks.0"]


# ---------------------------------------------------------------------------------------------- BatchNorm in a fit
class ImageClassifier(pl.LightningModule):
    """A CNN classifier trained with SGD and momentum."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.model = net

    def training_step(self, batch, batch_idx):
        return classification_loss(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def images(batches: int = STEPS, batch: int = 4, size: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(batch, 3, size, size, generator=generator), torch.randint(10, (batch,), generator=generator))
        for _ in range(batches)
    ]
    return DataLoader(data, batch_size=None)


def classifier(build) -> ImageClassifier:
    torch.manual_seed(0)
    net, _ = build()
    return ImageClassifier(net)


def batchnorm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name.rpartition(".")[2] in ("running_mean", "running_var", "num_batches_tracked")
    }


def assert_same_batchnorm(eager: nn.Module, graphed: nn.Module, batches: int = STEPS) -> None:
    expected, actual = batchnorm_state(eager), batchnorm_state(graphed)
    assert expected.keys() == actual.keys() and expected
    counters = {name: int(t) for name, t in actual.items() if name.endswith("num_batches_tracked")}
    assert counters == {name: int(t) for name, t in expected.items() if name.endswith("num_batches_tracked")}
    assert set(counters.values()) == {batches}, "every BatchNorm counts each training batch once"
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


class BatchCounter(pl.Callback):
    """The batch counter of the first block's first BatchNorm after every training batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(int(pl_module.model.layer1[0].bn1.num_batches_tracked))


def test_resnet_blocks_train_on_layer_graphs_with_batchnorm_statistics_equal_to_eager():
    backend, counter = FakeBackend(), BatchCounter()
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = backend
    eager = fit(classifier(resnet18), images(), STEPS, **CPU)
    run = fit(classifier(resnet18), images(), STEPS, [callback, counter], **CPU)

    report = callback.report
    _, blocks = resnet18()
    assert report.scopes == {"layer": [f"model.{name}" for name in blocks]}
    assert (report.stage, report.rollbacks, report.fallbacks) == (Stage.REPLAYING, 0, 0)
    assert report.replays == (STEPS - WARMUP) * len(blocks)
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert counter.counts == list(range(1, STEPS + 1)), "capture and its run leave the counter; each replay adds one"
    assert_same_batchnorm(eager.model, run.model)
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0


def test_with_gradient_accumulation_batchnorm_counts_every_micro_batch_as_eager_does():
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = FakeBackend()
    steps, accumulate = STEPS // 2, 2
    eager = fit(classifier(resnet18), images(), steps, accumulate_grad_batches=accumulate, **CPU)
    run = fit(classifier(resnet18), images(), steps, [callback], accumulate_grad_batches=accumulate, **CPU)

    assert callback.report.stage == Stage.REPLAYING and callback.report.replays > 0
    assert_same_batchnorm(eager.model, run.model)  # STEPS micro-batches, each counted once


def test_the_callbacks_auto_scope_starts_mobilenet_at_the_whole_network_with_batchnorm_as_eager():
    # The fake timer makes graphed steps faster than eager ones (the steady-state check's eager steps included), and
    # the whole network faster than its blocks: the widest level goes first and is kept, so its blocks are never tried.
    def step_ms(fake: FakeBackend) -> float:
        if not fake.step_replayed:
            return 10.0
        return 2.0 if "model" in fake.live_region_names else 4.0

    backend = FakeBackend(step_ms=step_ms)
    callback = CUDAGraphCallback(warmup_steps=WARMUP)
    callback.capture_backend = backend
    steps = 4 * STEPS  # room for the eager reference, the level's confirmation and timing, and the steady state
    eager = fit(classifier(mobilenet_v3_small), images(), steps, **CPU)
    run = fit(classifier(mobilenet_v3_small), images(), steps, [callback], **CPU)

    report = callback.report
    assert [(row.level, row.status) for row in report.ladder] == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "skipped"),
    ]
    assert (report.level, report.stage, report.rollbacks) == ("model", Stage.REPLAYING, 0)
    assert report.scopes == {
        "layer": ["model.features.1", "model.features.2", "model.features.3"],
        "model": ["model"],
    }
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert_same_batchnorm(eager.model, run.model, steps)

"""torchvision CNNs through ``CUDAGraphCallback()`` on a GPU: layer graphs that train exactly as eager does.

Run with ``pytest -m cuda``; skipped where torchvision is not installed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import assert_losses_close, fit_cuda, max_param_diff, patched_forwards

torchvision = pytest.importorskip("torchvision")

# scope="auto" keeps a level on measured step times: run alone (`-m "cuda and timing"`), not beside other GPU tests.
pytestmark = [pytest.mark.cuda, pytest.mark.timing, pytest.mark.timeout(300)]

STEPS, BATCH, SIZE = 30, 32, 64


class Classifier(pl.LightningModule):
    """A torchvision classifier trained with cross-entropy and SGD with momentum."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _classifier(name: str) -> Classifier:
    torch.manual_seed(0)
    return Classifier(getattr(torchvision.models, name)(num_classes=10))


def _images() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH * 8, 3, SIZE, SIZE, generator=generator)
    labels = torch.randint(0, 10, (BATCH * 8,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=BATCH, drop_last=True)


def _norm_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().double().cpu() for name, buffer in model.named_buffers()}


@pytest.fixture
def deterministic_convolutions():
    """cuDNN picks deterministic kernels: by default a convolution's backward sums in no fixed order."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_layer_graphs_of_a_torchvision_cnn_train_as_eager(name, deterministic_convolutions):
    """``scope="auto"`` reaches the CNN's blocks; losses, weights and BatchNorm statistics stay eager's."""
    eager = fit_cuda(_classifier(name), _images(), STEPS)
    callback = CUDAGraphCallback()
    graphed = fit_cuda(_classifier(name), _images(), STEPS, [callback])

    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.level in ("attn+mlp", "layer", "model"), report.ladder
    assert report.fallbacks == 0
    assert_losses_close(eager.losses, graphed.losses, 1e-4)
    assert max_param_diff(eager.params, graphed.params) < 1e-4
    eager_buffers, graphed_buffers = _norm_buffers(eager.model), _norm_buffers(graphed.model)
    assert eager_buffers.keys() == graphed_buffers.keys()
    for key, value in eager_buffers.items():
        torch.testing.assert_close(graphed_buffers[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert patched_forwards(graphed.model) == []

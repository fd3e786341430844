"""The strict fake backend itself: a replay sees what a CUDA graph's replay would, and nothing a graph would not.

The package's CPU tests lean on these properties (``tests/FAKE_BACKEND.md``): if the fake forgave a staleness, a
bug that a GPU user would hit could pass the whole CPU suite.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cudagraph._backend.backend import RecordedCall
from lightning_cudagraph._backend.signature import call_signature
from tests.fake_backend import FakeBackend, FakeRegion


class Step:
    """A linear model's training step on a static batch: what a whole-step graph would hold."""

    def __init__(self, optimizer: str = "adamw") -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.x, self.y = torch.randn(8, 4), torch.randn(8, 3)
        if optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.99))
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.9)
        self.loss: torch.Tensor | None = None
        self.run()  # an eager step first: the optimizer state exists before capture, as after warmup

    def run(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = torch.nn.functional.mse_loss(torch.nn.functional.dropout(self.model(self.x), 0.1), self.y)
        self.loss.backward()
        self.optimizer.step()


def eager_twin(step: Step) -> Step:
    """A deep copy that trains eagerly: the reference a replay must match."""
    twin = Step.__new__(Step)
    twin.model, twin.x, twin.y, twin.loss = copy.deepcopy(step.model), step.x.clone(), step.y.clone(), None
    twin.optimizer = type(step.optimizer)(twin.model.parameters(), lr=0.0)
    twin.optimizer.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))
    return twin


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_whole_step_replay_reruns_the_recorded_work_on_the_captured_tensors(optimizer):
    step = Step(optimizer)
    backend = FakeBackend()
    prepared = backend.prepare_optimizer(step.optimizer)
    twin = eager_twin(step)
    before = [p.detach().clone() for p in step.model.parameters()]
    rng = torch.get_rng_state()
    graph = backend.capture_step(step.run)
    assert all(torch.equal(a, p) for a, p in zip(before, step.model.parameters(), strict=True)), (
        "a capture ran the step"
    )
    assert torch.equal(torch.get_rng_state(), rng), "a capture drew from the generator"
    captured = step.loss

    for _ in range(3):
        torch.manual_seed(7)
        graph.replay()
        torch.manual_seed(7)
        twin.run()
        assert step.loss is captured, "the step's output is the captured tensor, rewritten in place"
        assert float(captured) == pytest.approx(float(twin.loss), rel=1e-6)
        for mine, theirs in zip(step.model.parameters(), twin.model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    prepared.restore()


def test_a_replay_reads_tensors_in_place_and_keeps_the_numbers_of_the_capture():
    step = Step()
    backend = FakeBackend()
    prepared = backend.prepare_optimizer(step.optimizer)
    graph = backend.capture_step(step.run)
    graph.replay()
    group = step.optimizer.param_groups[0]

    group["betas"], group["weight_decay"] = (0.0, 0.0), 0.5  # numbers: baked in at capture, as in a CUDA graph
    frozen_twin = eager_twin(step)
    frozen_twin.optimizer.param_groups[0].update(betas=(0.9, 0.99), weight_decay=0.01)
    torch.manual_seed(3)
    graph.replay()
    torch.manual_seed(3)
    frozen_twin.run()
    for mine, theirs in zip(step.model.parameters(), frozen_twin.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)

    group["lr"].fill_(0.0)  # a tensor the graph reads: takes effect
    weights = [p.detach().clone() for p in step.model.parameters()]
    graph.replay()
    assert all(torch.equal(a, p) for a, p in zip(weights, step.model.parameters(), strict=True))

    group["lr"] = 0.5  # a number replacing the tensor: ignored, until the package's refresh copies it in
    graph.replay()
    assert all(torch.equal(a, p) for a, p in zip(weights, step.model.parameters(), strict=True))
    prepared.refresh()
    graph.replay()
    assert not all(torch.equal(a, p) for a, p in zip(weights, step.model.parameters(), strict=True))

    step.x.mul_(0.0)  # the static batch, read in place
    graph.replay()
    expected = torch.nn.functional.mse_loss(torch.zeros_like(step.y) + step.model.bias.detach(), step.y)
    assert float(step.loss) != pytest.approx(float(expected), rel=1e-3)  # dropout scales the bias-only output
    prepared.restore()
    assert isinstance(group["lr"], float)


def test_a_host_sync_inside_a_whole_step_capture_fails_it():
    step = Step()
    backend = FakeBackend()
    backend.prepare_optimizer(step.optimizer)

    def syncs():
        step.run()
        float(step.loss)

    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        backend.capture_step(syncs)


def region_of(module: nn.Module, x: torch.Tensor) -> FakeRegion:
    signature = call_signature(module, (x,), {})
    call = RecordedCall("region", module, module.forward, signature, [x.detach().clone()])
    (region,) = FakeBackend().capture_regions([call], warmup_iters=0).regions
    return region


def test_a_region_hands_parameter_gradients_in_buffers_that_its_next_backward_rewrites():
    layer = nn.Linear(3, 2)
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    region = region_of(layer, x1)
    region((x1,), {}).sum().backward()
    first = layer.weight.grad.clone()
    region((x2,), {}).sum().backward()
    second = layer.weight.grad.clone()
    assert layer.weight.grad.data_ptr() == region.grad_buffers[0].data_ptr(), "autograd adopted the buffer"
    torch.testing.assert_close(second / 2, x2.sum(0).expand(2, 3).clone())  # the first gradient was overwritten

    layer.weight.grad = None
    region((x1,), {}).sum().backward()
    region.detach_accumulated_grads()  # what the router does before each accumulating replay
    region((x2,), {}).sum().backward()
    torch.testing.assert_close(layer.weight.grad, first + second / 2)


def test_a_region_replays_in_the_training_mode_it_was_captured_in():
    block = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    x = torch.randn(64, 3)
    region = region_of(block, x)
    block.eval()
    torch.manual_seed(0)
    replayed = region((x,), {})
    torch.manual_seed(0)
    trained = block.train()(x)
    assert torch.equal(replayed, trained), "the replay ran the captured (training) dropout"
    assert not torch.equal(replayed, block.eval()(x))
    assert not block.training, "the replay left the module's own mode as it was"

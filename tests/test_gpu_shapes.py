"""Batches whose shape changes, on a GPU: per-shape warmup and capture, eviction, seal, rebind after confirmation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import RebindAt, assert_losses_close, fit_cuda, graph_callback, graph_pool_bytes, patched_forwards
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def rotating(lengths: list[int]) -> DataLoader:
    """Batches of 8 sequences whose length follows ``lengths`` (one batch each)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(SMALL["vocab_size"], (8, SMALL["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:, :n], tokens[:, 1 : n + 1]) for n in lengths], batch_size=None)


@pytest.mark.parametrize("mode", ["layer", "full_iteration"])
def test_rotating_lengths_with_the_default_warmup_are_each_captured_and_replayed(mode):
    lengths = [128, 96, 64] * 10
    eager = fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths)).losses
    options = {"scope": [mode], "on_shape_change": "recapture"}
    if mode == "full_iteration":
        run = fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths), strategy=CUDAGraphStrategy(**options))
        report = graph_callback(run.trainer).report
    else:
        callback = CUDAGraphCallback(**options)
        run = fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths), [callback])
        report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert (report.captures, report.evictions, report.rollbacks) == (3, 0, 0)
    assert report.hit_rate >= 0.8, report
    assert_losses_close(eager, run.losses, 1e-4)


def test_eviction_captures_a_shape_again_and_frees_its_memory():
    lengths = [128] * 4 + [96, 64, 128] * 6  # three shapes, two graph sets
    callback = CUDAGraphCallback(scope=["layer"], on_shape_change="recapture", max_graphs=2)
    eager = fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths)).losses
    with pytest.warns(UserWarning, match="evicted with max_graphs=2"):
        run = fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths), [callback])
    report = callback.report
    assert report.stage == Stage.REPLAYING and report.evictions >= 4 and report.captures == report.evictions + 2
    assert_losses_close(eager, run.losses, 1e-4)
    assert patched_forwards(run.model) == [] and graph_pool_bytes() == 0


def test_a_sealed_set_of_shapes_raises_on_a_new_one():
    lengths = [128] * 6 + [96]
    callback = CUDAGraphCallback(scope=["layer"], on_shape_change="recapture", seal_after_steps=5)
    with pytest.raises(RuntimeError, match=r"int64\[8, 96\].*sealed \(captured: \[int64\[8, 128\]"):
        fit_cuda(decoder(SMALL)[0], rotating(lengths), len(lengths), [callback])
    assert graph_pool_bytes() == 0


@pytest.mark.parametrize("mode", ["layer", "full_iteration"])
def test_a_parameter_rebound_after_confirmation_rolls_back_before_training_on_stale_weights(mode):
    eager = fit_cuda(*decoder(SMALL), 20, [RebindAt(10, "model.blocks.2.mlp.fc.weight")], log_every_n_steps=1).losses
    if mode == "full_iteration":
        strategy = CUDAGraphStrategy(scope=[mode])
        with pytest.warns(UserWarning, match="address_changed"):
            run = fit_cuda(
                *decoder(SMALL),
                20,
                [RebindAt(10, "model.blocks.2.mlp.fc.weight")],
                strategy=strategy,
                log_every_n_steps=1,
            )
        report = graph_callback(run.trainer).report
    else:
        callback = CUDAGraphCallback(scope=[mode])
        with pytest.warns(UserWarning, match="address_changed: model.blocks.2"):
            run = fit_cuda(
                *decoder(SMALL), 20, [callback, RebindAt(10, "model.blocks.2.mlp.fc.weight")], log_every_n_steps=1
            )
        report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert_losses_close(eager, run.losses, 1e-4)

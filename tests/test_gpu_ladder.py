"""``scope="auto"`` 's ladder on a real capture. Run with ``pytest -m cuda``.

Each level is captured, confirmed and timed with CUDA events on the H200; what the ladder decides depends on those
times, so the tests assert what holds on any GPU where graphs pay (the whole step beats scoped regions on a small
decoder by far more than the margin) and what must hold everywhere (every level tried is measured, training equal to
eager, everything released). A region whose capture fails on the device is left eager while the others keep their
graphs.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, patched_forwards
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

STEPS, WARMUP = 60, 3
PARITY_STEPS = 20
TOLERANCE = 1e-4


def measured(report) -> dict[str, float]:
    return {row.level: row.step_ms for row in report.ladder if not math.isnan(row.step_ms)}


@pytest.mark.timing
def test_auto_through_the_strategy_tries_the_whole_step_first_and_trains_as_eager():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    run = fit_cuda(*decoder(SMALL), STEPS, strategy=CUDAGraphStrategy())

    report = graph_callback(run.trainer).report
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "full_iteration", 0), report.ladder
    times = measured(report)
    assert list(times) == ["full_iteration"], report.ladder
    assert times["full_iteration"] < report.eager_step_ms
    narrower = [(row.level, row.status) for row in report.ladder[:-1]]
    assert narrower == [(level, "skipped") for level in ("attn", "attn+mlp", "layer", "model")], "none tried"
    assert report.steps_replayed > STEPS // 2
    assert_losses_close(eager.losses[:PARITY_STEPS], run.losses[:PARITY_STEPS], TOLERANCE)
    assert patched_forwards(run.model) == []


@pytest.mark.timing
def test_the_callback_alone_settles_on_a_measured_scoped_level():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    callback = CUDAGraphCallback()
    run = fit_cuda(*decoder(SMALL), STEPS, [callback])

    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.level in {"attn", "attn+mlp", "layer", "model"}
    kept = [row for row in report.ladder if row.status == "kept"]
    assert [row.level for row in kept] == [report.level]
    assert kept[0].step_ms <= min(measured(report).values()) / (1 - 0.05) + 1e-9
    assert report.ladder[-1].status == "skipped"
    assert_losses_close(eager.losses[:PARITY_STEPS], run.losses[:PARITY_STEPS], TOLERANCE)
    assert patched_forwards(run.model) == []


def _host_sync_in(module: torch.nn.Module) -> None:
    """Make ``module`` read a value on the host in every forward: fine eagerly, impossible inside a capture."""

    class HostSyncing(type(module)):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.detach().sum().item()
            return output

    module.__class__ = HostSyncing


def test_a_region_whose_capture_fails_on_the_device_stays_eager_and_the_others_replay():
    eager_model, data = decoder(SMALL)
    _host_sync_in(eager_model.model.blocks[2].mlp)
    eager = fit_cuda(eager_model, data, 20)
    model, data = decoder(SMALL)
    _host_sync_in(model.model.blocks[2].mlp)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    with pytest.warns(UserWarning, match="model.blocks.2 stays eager, the other regions keep their graphs"):
        run = fit_cuda(model, data, 20, [callback])

    report = callback.report
    assert list(report.exclusions) == ["model.blocks.2"]
    assert "capture_failed" in report.exclusions["model.blocks.2"]
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.replays >= (20 - WARMUP) * (SMALL["n_layer"] - 1)
    assert_losses_close(eager.losses, run.losses, TOLERANCE)
    assert patched_forwards(run.model) == []

"""``compile=``: compiled kernels captured in the package's graphs, on a real capture. Run with ``pytest -m cuda``.

Each test compiles with inductor (10-30 s a model on the H200); the losses are compared with eager Lightning within
what fused kernels move (they reorder float sums), the regions' parity is checked against the eager forward.
``compile=True`` leaves layer regions uncompiled (too small to gain); ``compile={"regions": True}`` compiles them.
Speed is measured by ``benchmarks/compile.py`` and ``benchmarks/scoped_compile.py``, never by a timed test.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._dynamo.callback import callback_handler

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, CUDAGraphWarning, Stage
from lightning_cudagraph._trust.tolerance import FORWARD_TOL
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, patched_forwards
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(900)]

STEPS, WARMUP = 30, 3
#: Fused kernels against eager over 30 steps of the small decoder, fp32 (they agree to ~1e-5 per step).
TOLERANCE = 2e-3


class CompileCounter:
    """Counts dynamo's compilations while installed."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> CompileCounter:
        callback_handler.register_start_callback(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        callback_handler.remove_start_callback(self._seen)

    def _seen(self, *args: object) -> None:
        self.count += 1


def test_the_whole_step_captures_compiled_kernels_trains_as_eager_and_leaves_nothing_compiled():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, compile=True)
    run = fit_cuda(*decoder(SMALL), STEPS, strategy=strategy)

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.compile_s > 0 and report.recompiles == 0 and report.compile_exclusions == {}
    assert report.steps_replayed >= STEPS - WARMUP - 3
    assert_losses_close(eager.losses, run.losses, TOLERANCE)
    assert run.model.model._compiled_call_impl is None, "the compiled call is dropped with the fit"

    with CompileCounter() as compiles:  # the same model trained again without the package: nothing compiled runs
        again = fit_cuda(run.model, decoder(SMALL)[1], 3)
    assert compiles.count == 0 and len(again.losses) == 3


def test_the_whole_step_with_compiled_kernels_in_bf16_mixed():
    eager = fit_cuda(*decoder(SMALL), STEPS, precision="bf16-mixed", gradient_clip_val=1.0)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, compile=True)
    run = fit_cuda(*decoder(SMALL), STEPS, strategy=strategy, precision="bf16-mixed", gradient_clip_val=1.0)

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.recompiles == 0
    assert_losses_close(eager.losses[:10], run.losses[:10], 5e-2)  # bf16 and clipping: the first steps agree


def test_the_whole_step_with_compiled_kernels_in_16_mixed_under_a_step_schedule():
    # 16-mixed: the grad scaler's unscaling, inf check and scale update run in the graph, with the compiled kernels;
    # the schedule halves the lr every 10 optimizer steps, on replayed steps. (Lightning refuses gradient clipping with
    # a fused optimizer under 16-mixed: the optimizer unscales its gradients itself.)
    overrides = {"fused": True, "lr_step_size": 10, "lr_gamma": 0.5, "lr": 3e-4}
    eager = fit_cuda(*decoder(SMALL, **overrides), STEPS, precision="16-mixed")
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, compile=True)
    run = fit_cuda(*decoder(SMALL, **overrides), STEPS, strategy=strategy, precision="16-mixed")

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.compile_s > 0 and report.recompiles == 0
    (group,) = run.trainer.optimizers[0].param_groups
    (eager_group,) = eager.trainer.optimizers[0].param_groups
    assert group["lr"] == pytest.approx(eager_group["lr"]) and group["lr"] < 3e-4, "the schedule ran as in eager"
    assert_losses_close(eager.losses, run.losses, 5e-2)


def test_layers_capture_their_compiled_forwards_and_pass_parity_against_eager():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, compile={"regions": True})
    run = fit_cuda(*decoder(SMALL), STEPS, [callback])

    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.captures == 1 and report.replays >= (STEPS - WARMUP - 3) * SMALL["n_layer"]
    assert 0 <= report.parity_err <= FORWARD_TOL["compiled"]
    assert report.compile_s > 0 and report.recompiles == 0 and report.compile_exclusions == {}
    assert_losses_close(eager.losses, run.losses, TOLERANCE)
    assert patched_forwards(run.model) == []


def test_compile_true_captures_layers_uncompiled_and_says_why_once():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, compile=True)
    with warnings.catch_warnings(record=True) as caught, CompileCounter() as compiles:
        warnings.simplefilter("always")
        run = fit_cuda(*decoder(SMALL), STEPS, [callback])

    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert compiles.count == 0 and math.isnan(report.compile_s), "the layer regions were compiled"
    assert 0 <= report.parity_err <= FORWARD_TOL["full"], "checked as plain graphs"
    assert list(report.compile_exclusions) == ["layer"]
    notices = [w for w in caught if issubclass(w.category, CUDAGraphWarning) and "uncompiled" in str(w.message)]
    assert len(notices) == 1 and "compile={'regions': True}" in str(notices[0].message)
    assert_losses_close(eager.losses, run.losses, TOLERANCE)


def test_a_batch_of_another_shape_recompiles_eagerly_and_is_reported():
    samples = 8 * 6 + 4  # the last batch of each epoch has 4 rows
    callback = CUDAGraphCallback(
        scope=["layer"], warmup_steps=WARMUP, compile={"regions": True}, on_shape_change="eager"
    )
    with pytest.warns(UserWarning, match="compiled again after the capture"):
        run = fit_cuda(*decoder(SMALL, train_samples=samples, drop_last=False), 20, [callback])

    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.recompiles >= 1
    assert report.fallbacks > 0, "the other shape ran eagerly"
    assert all(torch.isfinite(torch.tensor(run.losses)))


def test_a_model_the_user_compiled_is_captured_in_the_whole_step():
    eager = fit_cuda(*decoder(SMALL), STEPS)
    model, data = decoder(SMALL)
    model.model = torch.compile(model.model)
    run = fit_cuda(model, data, STEPS, strategy=CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP))

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert_losses_close(eager.losses, run.losses, TOLERANCE)

"""Gradient accumulation inside the whole step on a GPU: every micro-batch a graph, training equal to eager.

Run with ``pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_cudagraph import CUDAGraphStrategy, Stage
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, graph_pool_bytes, max_param_diff
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

ACCUMULATE, WARMUP = 4, 3
#: The package runs AdamW fused for the whole fit; the eager reference is the same arithmetic.
GRAPHED_FORM = {"fused": True}
#: lr 3e-4 and a step-wise decay, as in test_gpu_full: the model does not spike, so kernels' last-bit noise stays small.
SCHEDULE = {"lr_step_size": 10, "lr_gamma": 0.7, "lr": 3e-4, "train_samples": 8 * 40}


@pytest.mark.parametrize("accumulate", [2, ACCUMULATE])
def test_accumulation_in_the_whole_step_matches_eager(accumulate):
    steps = 25
    common = {"gradient_clip_val": 0.5, "accumulate_grad_batches": accumulate, "log_every_n_steps": 1}
    eager, eager_params, eager_fit, _ = fit_cuda(*decoder(SMALL, **SCHEDULE, **GRAPHED_FORM), steps, **common)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
    graphed, graphed_params, fit, _ = fit_cuda(*decoder(SMALL, **SCHEDULE), steps, strategy=strategy, **common)

    report = graph_callback(fit).report
    assert report.stage == Stage.REPLAYING, report.reason
    # The only eager micro-batches after capture: each later epoch's first window re-checks the step's Python.
    assert report.rollbacks == 0, report.rollback_reasons
    assert all("step_python_recheck" in r or r.startswith("accumulation") for r in report.fallback_reasons), report
    assert report.captures == (3 if accumulate > 2 else 2), "one graph per place in the window"
    assert report.replays >= (steps - WARMUP - 2) * accumulate
    assert fit.global_step == eager_fit.global_step == steps
    assert_losses_close(eager, graphed, 1e-5)
    assert max_param_diff(eager_params, graphed_params) < 1e-5
    (group,) = fit.optimizers[0].param_groups
    assert isinstance(group["lr"], float) and group["lr"] == pytest.approx(3e-4 * 0.7 ** (steps // 10))
    torch.cuda.synchronize()
    assert graph_pool_bytes() == 0, "the step graphs' pools were not freed"

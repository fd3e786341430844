"""Hugging Face models (transformers 5.x) under graphs on a GPU. Run with `pytest -m cuda`.

A dense Llama captures every scope and the whole step, with eager losses. On Qwen3-MoE the attention and the routers
capture; a region that holds the experts cannot (their default ``grouped_mm`` path copies routing results to the
host), so ``layer`` and the whole step roll back loudly and training goes on with eager losses.
"""

from __future__ import annotations

import functools

import pytest

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, patched_forwards
from tests.hf_models import LAYERS, hf_causal_lm  # imports transformers only when a model is built

pytest.importorskip("transformers")
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP = 20, 3
# Graphed regions replay the eager kernels; what is left are nondeterministic kernels (embedding backward, index_add
# in the experts) and, for the whole step, AdamW in its capturable form (measured ~1e-5).
TOLERANCE = 1e-4
ROLLED_BACK = "rolled back to eager training: capture_failed"


@functools.cache
def eager_losses(kind: str) -> tuple[float, ...]:
    """Per-step losses of eager training (once per model kind and process)."""
    return tuple(fit_cuda(*hf_causal_lm(kind), STEPS).losses)


def whole_step() -> CUDAGraphStrategy:
    return CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)


def names(pattern: str) -> list[str]:
    return [pattern.format(i) for i in range(LAYERS)]


# =================================================================== dense Llama
def assert_scoped_graphs_match_eager(kind: str, scope: list[str], found: dict[str, list[str]]) -> None:
    """The scopes find ``found``, every region replays on every step after warmup, and training equals eager."""
    callback = CUDAGraphCallback(scope=scope, warmup_steps=WARMUP)
    graphed = fit_cuda(*hf_causal_lm(kind), STEPS, [callback])
    report = callback.report
    assert report.scopes == found
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays == (STEPS - WARMUP) * sum(map(len, found.values()))
    assert report.fallbacks == 0
    assert report.parity_err < 1e-4
    assert_losses_close(list(eager_losses(kind)), graphed.losses, TOLERANCE)
    assert patched_forwards(graphed.model) == []


@pytest.mark.parametrize(
    ("scope", "found"),
    [
        pytest.param(["attn"], {"attn": names("model.model.layers.{}.self_attn")}, id="attn"),
        pytest.param(
            ["attn", "mlp"],
            {"attn": names("model.model.layers.{}.self_attn"), "mlp": names("model.model.layers.{}.mlp")},
            id="attn+mlp",
        ),
        pytest.param(["layer"], {"layer": names("model.model.layers.{}")}, id="layer"),
    ],
)
def test_llama_scopes_match_eager(scope, found):
    assert_scoped_graphs_match_eager("llama", scope, found)


def test_llama_whole_step_matches_eager():
    graphed = fit_cuda(*hf_causal_lm("llama"), STEPS, strategy=whole_step())
    report = graph_callback(graphed.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.captures == 1
    assert report.replays == STEPS - WARMUP
    assert report.fallbacks == 0
    assert_losses_close(list(eager_losses("llama")), graphed.losses, TOLERANCE)
    assert patched_forwards(graphed.model) == []


# =================================================================== Qwen3-MoE
@pytest.mark.parametrize(
    ("scope", "found"),
    [
        pytest.param(["attn"], {"attn": names("model.model.layers.{}.self_attn")}, id="attn"),
        pytest.param(
            ["attn", "moe_router"],
            {"attn": names("model.model.layers.{}.self_attn"), "moe_router": names("model.model.layers.{}.mlp.gate")},
            id="attn+moe_router",
        ),
    ],
)
def test_qwen3_moe_attention_and_routers_match_eager(scope, found):
    assert_scoped_graphs_match_eager("qwen3_moe", scope, found)


def test_qwen3_moe_whole_step_in_fp32_is_refused_at_setup_with_the_precision_and_the_fix():
    with pytest.raises(ValueError, match=r"grouped_mm.*float32.*bf16-true.*use_autocast_experts"):
        fit_cuda(*hf_causal_lm("qwen3_moe"), STEPS, strategy=whole_step())


def test_qwen3_moe_experts_in_a_layer_roll_back_loudly_and_train_eagerly():
    callbacks = [CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)]
    with pytest.warns(UserWarning, match=ROLLED_BACK):
        graphed = fit_cuda(*hf_causal_lm("qwen3_moe"), STEPS, callbacks)
    report = graph_callback(graphed.trainer).report
    assert report.stage == Stage.DISABLED
    assert report.rollbacks == 1
    (reason,) = report.rollback_reasons
    assert reason.startswith("capture_failed") and "Cannot copy between CPU and CUDA" in reason, reason
    assert report.replays == 0 and report.graphs == 0
    assert len(graphed.losses) == STEPS
    assert_losses_close(list(eager_losses("qwen3_moe")), graphed.losses, TOLERANCE)
    assert patched_forwards(graphed.model) == []


# =================================================================== scope="auto"
@pytest.mark.timing
def test_qwen3_moe_auto_skips_the_levels_holding_fp32_experts_and_keeps_graphs():
    run = fit_cuda(*hf_causal_lm("qwen3_moe"), 3 * STEPS, strategy=CUDAGraphStrategy(warmup_steps=WARMUP))
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.ladder
    statuses = {row.level: (row.status, row.reason or "") for row in report.ladder}
    for level in ("layer", "model", "full_iteration"):  # the fp32 experts are found at setup, before any capture
        assert "moe_precision" in statuses[level][1], statuses
    assert report.level in {"attn", "attn+mlp"}
    assert_losses_close(list(eager_losses("qwen3_moe")), run.losses[:STEPS], TOLERANCE)
    assert patched_forwards(run.model) == []

"""A capture that fails on a known layout's host sync names the module and the fix: Hugging Face's eager MoE experts."""

from __future__ import annotations

import pytest

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy
from tests.fake_backend import FakeBackend
from tests.helpers import LossRecorder, graph_callback, trainer

pytest.importorskip("transformers")
from tests.hf_models import LAYERS, hf_causal_lm

CPU = {"accelerator": "cpu", "devices": 1}
FIX = "set_experts_implementation('grouped_mm')"


def whole_step_on_eager_experts(warmup_steps: int, warning: str) -> str:
    """A Qwen3-MoE with eager experts through the whole step, two steps past its warmup; the report's reason."""
    model, data = hf_causal_lm("qwen3_moe")
    model.model.set_experts_implementation("eager")
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=warmup_steps)
    strategy.capture_backend = FakeBackend()
    with pytest.warns(UserWarning, match=warning):
        trainer(warmup_steps + 2, strategy=strategy, **CPU).fit(model, data)
    return graph_callback(model.trainer).report.reason


def test_the_whole_step_on_eager_moe_experts_names_them_and_the_fix():
    reason = whole_step_on_eager_experts(warmup_steps=2, warning="capture_failed")
    assert FIX in reason and "model.model.layers.0.mlp.experts" in reason, reason


def test_a_layer_holding_eager_moe_experts_is_left_eager_with_the_fix():
    model, data = hf_causal_lm("qwen3_moe")
    model.model.set_experts_implementation("eager")
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2)
    callback.capture_backend = FakeBackend()
    trainer(4, [callback], **CPU).fit(model, data)
    reasons = callback.report.exclusions
    assert reasons and all(FIX in reason for reason in reasons.values()), reasons


def test_eager_moe_experts_whose_operations_follow_the_routing_name_the_experts_and_the_fix():
    """Observed steps route other token counts to the experts: the whole step is left out for that, with the fix."""
    reason = whole_step_on_eager_experts(warmup_steps=3, warning="step_python")
    assert reason.startswith("rollback: step_python: training_step launched other operations"), reason
    assert "model.model.layers.0.mlp.experts runs Hugging Face's eager MoE experts" in reason, reason
    assert reason.endswith(f"Fix: model.{FIX} (or 'batched_mm') before the fit: both route on the device"), reason


def test_a_layer_whose_router_logits_transformers_records_by_hook_stays_eager_and_trains_as_eager():
    """transformers 5 collects ``router_logits`` with a hook on each router, inside the layer: a replay fires none."""
    pytest.importorskip("transformers.utils.output_capturing", reason="transformers records outputs by hooks from 5.0")
    losses = {}
    for graphs in (False, True):
        model, data = hf_causal_lm("qwen3_moe", output_router_logits=True)  # the router's auxiliary loss is on
        recorder = LossRecorder()
        callbacks: list = [recorder]
        if graphs:
            callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2)
            callback.capture_backend = FakeBackend()
            callbacks.append(callback)
        trainer(5, callbacks, **CPU).fit(model, data)
        losses[graphs] = recorder.losses

    reasons = callback.report.exclusions
    assert sorted(reasons) == [f"model.model.layers.{i}" for i in range(LAYERS)], reasons
    for reason in reasons.values():
        assert reason.startswith("hooks_inside: Hugging Face transformers records router_logits from mlp.gate"), reason
    assert losses[True] == losses[False], "the layers ran eagerly, with the router's auxiliary loss"

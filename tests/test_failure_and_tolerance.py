"""The one failure rule and the one tolerance table that every kind of graph asks."""

from __future__ import annotations

import pytest

from lightning_cudagraph import CUDAGraphCallback, GraphFailure
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.tolerance import forward_tolerance, full_precision, step_tolerance
from tests.fake_backend import FakeBackend
from tests.helpers import trainer
from tests.models import TINY, decoder


@pytest.mark.parametrize(
    ("on_failure", "auto_scope", "stops"), [("eager", False, False), ("raise", False, True), ("raise", True, False)]
)
def test_a_failed_part_stops_graphs_only_when_the_user_fixed_the_scope_and_asked_to_raise(
    on_failure, auto_scope, stops
):
    assert FailurePolicy("CUDAGraphCallback", on_failure, auto_scope).part_failure_stops_graphs is stops


def test_raise_raises_one_exception_type_naming_the_component_and_the_reason():
    with pytest.raises(GraphFailure, match=r"^CUDAGraphStrategy\(on_failure='raise'\): parity: off by 2x$"):
        FailurePolicy("CUDAGraphStrategy", "raise").fail("parity: off by 2x", eager_message="unused")
    with pytest.warns(UserWarning, match="went eager"):
        FailurePolicy("CUDAGraphStrategy", "eager").fail("parity: off by 2x", eager_message="went eager")


def test_a_fixed_scope_that_fails_a_capture_under_raise_stops_the_fit_with_graph_failure():
    model, data = decoder(TINY)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2, on_failure="raise")
    callback.capture_backend = FakeBackend(fail_regions={"model.blocks.0": RuntimeError("injected: a host sync")})
    with pytest.raises(GraphFailure, match="injected: a host sync"):
        trainer(6, [callback], accelerator="cpu", devices=1).fit(model, data)


@pytest.mark.parametrize("precision", ["32-true", "32", "64-true"])
def test_full_precision_is_checked_tighter_than_reduced_precision(precision):
    assert full_precision(precision)
    assert step_tolerance(precision) < step_tolerance("bf16-mixed")
    assert forward_tolerance(None, reduced=False) < forward_tolerance(None, reduced=False, compiled=True)
    assert forward_tolerance(None, reduced=False, compiled=True) < forward_tolerance(None, reduced=True)
    assert forward_tolerance(None, reduced=True) < forward_tolerance(None, reduced=True, fp8=True)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true", "transformer-engine"])
def test_reduced_precisions_are_not_full_precision(precision):
    assert not full_precision(precision)

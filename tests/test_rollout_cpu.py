"""The rollout's decisions on CPU: what each confirmation finding leads to (capture itself is tested on the GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.graphs.manager import StepState
from lightning_cudagraph.health import Stage
from lightning_cudagraph.rollout import Rollout


def confirming_rollout(**options) -> Rollout:
    rollout = Rollout(
        CUDAGraphConfig.from_options("CUDAGraphCallback", scope=["layer"], **options), "CUDAGraphCallback"
    )
    rollout._enter_confirmation(step=3)
    return rollout


def test_matching_parity_keeps_confirming_and_records_the_error():
    rollout = confirming_rollout()
    rollout._confirm_scoped_step(StepState(confirming=True, parity=[torch.tensor(3e-7), torch.tensor(1e-6)]), None)
    assert rollout.stage == Stage.CONFIRMING
    assert rollout.report.parity_err == pytest.approx(1e-6)


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        pytest.param(StepState(parity=[torch.tensor(0.5)]), "parity", id="parity"),
        pytest.param(StepState(problem="address_changed: blocks.0.w moved"), "address_changed", id="address"),
        pytest.param(
            StepState(forward_order=["a", "b"], backward_order=["a", "b"]), "backward_order", id="backward-order"
        ),
    ],
)
def test_a_failed_check_rolls_back_loudly(state, reason):
    rollout = confirming_rollout()
    with pytest.warns(UserWarning, match=f"rolled back to eager training: {reason}"):
        rollout._confirm_scoped_step(state, None)
    assert rollout.stage == Stage.DISABLED
    assert rollout.report.rollbacks == 1
    assert rollout.report.rollback_reasons[0].startswith(reason)
    assert rollout.report.reason.startswith("rollback: " + reason)


def test_on_failure_raise_turns_a_failed_check_into_an_error():
    rollout = confirming_rollout(on_failure="raise")
    with pytest.raises(RuntimeError, match=r"on_failure='raise'.*parity"):
        rollout._confirm_scoped_step(StepState(parity=[torch.tensor(1.0)]), None)
    assert rollout.stage == Stage.DISABLED


def test_parity_tolerance_follows_the_option_and_the_precision():
    assert confirming_rollout(parity_tol=0.5)._parity_tolerance(StepState(parity=[torch.tensor(0.4)])) == 0.5
    rollout = confirming_rollout()
    with pytest.warns(UserWarning, match=r"tolerance 0\.0001"):
        rollout._confirm_scoped_step(StepState(parity=[torch.tensor(2e-4)]), None)


def test_a_non_finite_loss_during_confirmation_rolls_back_when_confirmation_ends():
    rollout = confirming_rollout()
    rollout.report.replays = 12
    rollout._confirm_scoped_step(StepState(), {"loss": torch.tensor(float("nan"))})
    rollout._confirm_scoped_step(StepState(), {"loss": torch.tensor(1.0)})
    assert rollout.stage == Stage.CONFIRMING
    with pytest.warns(UserWarning, match="nonfinite_loss"):
        rollout._finish_confirmation()
    assert rollout.stage == Stage.DISABLED


def test_confirmation_without_any_replay_rolls_back():
    rollout = confirming_rollout()
    with pytest.warns(UserWarning, match="not_replayed"):
        rollout._finish_confirmation()
    assert rollout.stage == Stage.DISABLED


def test_clean_confirmation_moves_to_replaying():
    rollout = confirming_rollout()
    rollout.report.replays = 6
    rollout._confirm_scoped_step(StepState(), {"loss": torch.tensor(2.0)})
    rollout._finish_confirmation()
    assert rollout.stage == Stage.REPLAYING
    assert math.isnan(rollout.report.speedup)  # no step time measured yet

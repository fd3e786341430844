"""The optimizer switch of full_iteration, on CPU: what changes for the graph, and that everything comes back."""

from __future__ import annotations

import pytest
import torch

from lightning_cudagraph.graphs.optimizers import CapturableOptimizer


def _adamw(**kwargs) -> torch.optim.AdamW:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # creates the state, with its step count on the CPU
    return optimizer


def test_adamw_becomes_capturable_with_a_tensor_learning_rate_and_comes_back():
    optimizer = _adamw()
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    (group,) = optimizer.param_groups
    assert group["capturable"] is True
    assert isinstance(group["lr"], torch.Tensor)
    assert float(group["lr"]) == pytest.approx(1e-3)

    switched.restore()
    assert group["capturable"] is False
    assert group["lr"] == pytest.approx(1e-3)
    assert isinstance(group["lr"], float)


def test_schedulers_update_the_captured_learning_rate_in_place():
    optimizer = _adamw()
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    lr = optimizer.param_groups[0]["lr"]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # no optimizer step here: only the LR is watched
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr  # same tensor: a graph reading it sees the schedule
    assert float(lr) == pytest.approx(5e-4)
    switched.restore()


def test_a_number_assigned_by_user_code_goes_into_the_captured_tensor():
    optimizer = _adamw()
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 2e-3  # e.g. a manual warmup in LightningModule.optimizer_step
    switched.refresh()
    assert optimizer.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(2e-3)


def test_sgd_is_fused_and_restored():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    assert optimizer.param_groups[0]["fused"] is True
    assert optimizer.param_groups[0]["foreach"] is False
    switched.restore()
    assert not optimizer.param_groups[0]["fused"]
    assert optimizer.param_groups[0]["foreach"] is True


def test_checkpoints_hold_the_optimizer_as_the_user_built_it():
    optimizer = _adamw()
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    saved = optimizer.state_dict()
    switched.plain_state_dict(saved)
    (group,) = saved["param_groups"]
    assert group["capturable"] is False
    assert isinstance(group["lr"], float)
    assert optimizer.param_groups[0]["capturable"] is True  # the live optimizer keeps its capturable form
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1.0)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == pytest.approx(1e-3)

"""The optimizer switch of full_iteration, on CPU: what changes for the graph, and that everything comes back."""

from __future__ import annotations

import pytest
import torch

from lightning_cudagraph._backend.optimizers import CapturableOptimizer, unfit_optimizer


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


def test_the_learning_rate_given_back_is_the_number_the_user_wrote_not_its_float32_rounding():
    optimizer = _adamw()
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    switched.restore()
    assert optimizer.param_groups[0]["lr"] == 1e-3  # exactly: float32 holds 0.0010000000474974513
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    optimizer.param_groups[0]["lr"] = 3e-4  # a hand-written warm-up, taken into the tensor
    switched.refresh()
    switched.restore()
    assert optimizer.param_groups[0]["lr"] == 3e-4
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    optimizer.param_groups[0]["lr"].fill_(5e-4)  # a scheduler's value: no number was written, the tensor's is given
    switched.restore()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4) and optimizer.param_groups[0]["lr"] != 3e-4


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


@pytest.mark.parametrize("build", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_adam_runs_fused_inside_the_graph_and_comes_back_as_built(build):
    model = torch.nn.Linear(4, 4)
    optimizer = build(model.parameters(), lr=1e-3, foreach=True)
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    (group,) = optimizer.param_groups
    assert (group["fused"], group["foreach"], group["capturable"]) == (True, False, True)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # the fused step runs with the tensor learning rate
    assert optimizer.state[model.weight]["step"].device.type == "cpu"
    switched.restore()
    assert (group["fused"], group["foreach"], group["capturable"]) == (None, True, False)


def test_parameters_fused_kernels_cannot_take_keep_the_capturable_foreach_form():
    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))  # fused Adam takes floating point only
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    CapturableOptimizer(optimizer, torch.device("cpu"))
    (group,) = optimizer.param_groups
    assert group["capturable"] is True
    assert not group["fused"]


def test_a_fused_step_updates_as_the_foreach_step_does():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 8) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    CapturableOptimizer(optimizers[1], torch.device("cpu"))
    for _ in range(5):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(torch.arange(16.0).view(2, 8)).square().sum().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_adam_built_with_fused_false_keeps_its_capturable_foreach_form():
    optimizer = _adamw(fused=False)
    switched = CapturableOptimizer(optimizer, torch.device("cpu"))
    (group,) = optimizer.param_groups
    assert (group["fused"], group["capturable"]) == (False, True)
    switched.restore()
    assert (group["fused"], group["capturable"]) == (False, False)


@pytest.mark.parametrize(
    ("build", "scaler", "whole_step", "expected"),
    [
        (lambda p: torch.optim.AdamW(p), False, True, None),
        (lambda p: torch.optim.AdamW(p), False, False, None),
        (lambda p: torch.optim.Adagrad(p), False, True, "Adagrad has no capturable form"),
        (lambda p: torch.optim.Adagrad(p, fused=True), False, True, None),  # fused kernels read a device lr
        (lambda p: torch.optim.Adagrad(p, fused=True), False, False, "Adagrad has no capturable form"),
        (lambda p: torch.optim.AdamW(p), True, True, "GradScaler reads found_inf on the host"),
        (lambda p: torch.optim.AdamW(p, fused=True), True, True, None),
        (lambda p: torch.optim.AdamW(p, fused=True), True, False, "GradScaler reads found_inf on the host"),
        (lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True), False, True, "differentiable=True"),
    ],
)
def test_one_rule_says_which_optimizers_a_graph_can_step(build, scaler, whole_step, expected):
    """The whole step and the optimizer graph of scoped levels ask the same function, with their one difference."""
    optimizer = build(torch.nn.Linear(2, 2).parameters())
    unfit = unfit_optimizer(optimizer, automatic=True, grad_scaler=scaler, whole_step=whole_step)
    assert (unfit is None) == (expected is None), unfit
    if expected is not None:
        assert unfit.what.startswith(expected) or expected in unfit.what, unfit


def test_an_optimizer_step_hook_keeps_the_optimizer_graph_eager_and_is_the_step_pythons_for_the_whole_step():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    optimizer.register_step_post_hook(lambda *args: None)
    graph = unfit_optimizer(optimizer, automatic=True, grad_scaler=False, whole_step=False)
    assert graph is not None and "which a replay would not run" in graph.what
    assert unfit_optimizer(optimizer, automatic=True, grad_scaler=False, whole_step=True) is None

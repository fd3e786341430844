"""Hooks taken out around a capture and put back, and the eager warmup record that decides what to capture."""

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as module_globals

from lightning_cudagraph._options.batches import batch_key
from lightning_cudagraph._options.hooks import hooks_stashed, inner_hook_count
from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._trust.recording import WarmupRecorder

# ---------------------------------------------------------------------------------------------------------- hooks


class Region(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def run(region: nn.Module) -> None:
    region(torch.randn(2, 4, requires_grad=True)).sum().backward()


def _pre(fired):
    return lambda module, args: fired.append("pre")


def _pre_kwargs(fired):
    return lambda module, args, kwargs: fired.append("pre_kwargs")


def _fwd(fired):
    return lambda module, args, output: fired.append("fwd")


def _fwd_kwargs(fired):
    return lambda module, args, kwargs, output: fired.append("fwd_kwargs")


def _bwd(fired):
    return lambda module, grad_input, grad_output: fired.append("bwd")


def _bwd_pre(fired):
    return lambda module, grad_output: fired.append("bwd_pre")


HOOKS = [
    pytest.param(lambda m, f: m.register_forward_pre_hook(_pre(f)), "pre", id="forward-pre"),
    pytest.param(
        lambda m, f: m.register_forward_pre_hook(_pre_kwargs(f), with_kwargs=True),
        "pre_kwargs",
        id="forward-pre-kwargs",
    ),
    pytest.param(lambda m, f: m.register_forward_hook(_fwd(f)), "fwd", id="forward"),
    pytest.param(
        lambda m, f: m.register_forward_hook(_fwd_kwargs(f), with_kwargs=True), "fwd_kwargs", id="forward-kwargs"
    ),
    pytest.param(lambda m, f: m.register_forward_hook(_fwd(f), always_call=True), "fwd", id="forward-always-called"),
    pytest.param(lambda m, f: m.register_full_backward_hook(_bwd(f)), "bwd", id="full-backward"),
    pytest.param(lambda m, f: m.register_full_backward_pre_hook(_bwd_pre(f)), "bwd_pre", id="full-backward-pre"),
]


@pytest.mark.parametrize(("register", "label"), HOOKS)
def test_inner_module_hooks_are_stashed_and_restored(register, label):
    region, fired = Region(), []
    handle = register(region.inner, fired)
    run(region)
    assert fired == [label]

    fired.clear()
    with hooks_stashed([region]):
        run(region)
        assert inner_hook_count(region) == 0
    assert fired == []

    run(region)
    assert fired == [label]

    fired.clear()
    handle.remove()
    run(region)
    assert fired == []
    assert inner_hook_count(region) == 0


GLOBAL_HOOKS = [
    pytest.param(lambda f: module_globals.register_module_forward_pre_hook(_pre(f)), "pre", id="global-forward-pre"),
    pytest.param(lambda f: module_globals.register_module_forward_hook(_fwd(f)), "fwd", id="global-forward"),
    pytest.param(
        lambda f: module_globals.register_module_forward_hook(_fwd_kwargs(f), with_kwargs=True),
        "fwd_kwargs",
        id="global-forward-kwargs",
    ),
    pytest.param(lambda f: module_globals.register_module_full_backward_hook(_bwd(f)), "bwd", id="global-backward"),
    pytest.param(
        lambda f: module_globals.register_module_full_backward_pre_hook(_bwd_pre(f)),
        "bwd_pre",
        id="global-backward-pre",
    ),
]


@pytest.mark.parametrize(("register", "label"), GLOBAL_HOOKS)
def test_global_module_hooks_are_stashed_and_restored(register, label):
    region, fired = nn.Linear(4, 4), []
    handle = register(fired)
    try:
        with hooks_stashed([region]):
            run(region)
        assert fired == []
        run(region)
        assert label in fired
    finally:
        handle.remove()
    fired.clear()
    run(region)
    assert fired == []


def test_root_hooks_kept_when_roots_are_excluded():
    region, fired = Region(), []
    region.register_forward_pre_hook(lambda module, args: fired.append("root"))
    region.inner.register_forward_pre_hook(lambda module, args: fired.append("inner"))
    with hooks_stashed([region], include_roots=False):
        run(region)
    assert fired == ["root"]
    fired.clear()
    with hooks_stashed([region]):
        run(region)
    assert fired == []
    run(region)
    assert fired == ["root", "inner"]


def test_hooks_restored_after_an_exception_in_capture():
    region, fired = Region(), []
    region.inner.register_forward_hook(lambda module, args, output: fired.append("fwd"))
    with pytest.raises(RuntimeError, match="capture failed"), hooks_stashed([region]):
        raise RuntimeError("capture failed")
    run(region)
    assert fired == ["fwd"]


def test_overlapping_regions_keep_every_hook():
    outer, fired = Region(), []
    outer.inner.register_forward_pre_hook(lambda module, args: fired.append("inner"))
    with hooks_stashed([outer, outer.inner]):
        run(outer)
    run(outer)
    assert fired == ["inner"]


def test_inner_hook_count_counts_hooks_strictly_inside():
    region = Region()
    assert inner_hook_count(region) == 0
    region.register_forward_pre_hook(lambda module, args: None)  # the region's own hooks keep firing: not counted
    assert inner_hook_count(region) == 0
    region.inner.register_forward_pre_hook(lambda module, args: None)
    region.out.register_forward_hook(lambda module, args, output: None)
    region.out.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    assert inner_hook_count(region) == 3


@pytest.mark.parametrize(
    "register",
    [
        pytest.param(lambda m: m.register_forward_pre_hook(lambda mod, a, k: None, with_kwargs=True), id="pre-kwargs"),
        pytest.param(lambda m: m.register_forward_hook(lambda mod, a, k, o: None, with_kwargs=True), id="fwd-kwargs"),
        pytest.param(lambda m: m.register_forward_hook(lambda mod, a, o: None, always_call=True), id="always-call"),
    ],
)
def test_inner_hook_count_counts_a_hook_registered_with_options_once(register):
    region = Region()
    register(region.inner)
    assert inner_hook_count(region) == 1


# ------------------------------------------------------------------------------------------------------ recording


class TwoStage(nn.Module):
    """``second`` is defined first, but ``first`` runs first: the plan follows execution order."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def recorded(model: nn.Module, names: list[str]) -> WarmupRecorder:
    """A recorder fed by forward pre-hooks on the named submodules, the way the rollout records warmup calls."""
    targets = [Target(name, model.get_submodule(name), "custom") for name in names]
    recorder = WarmupRecorder(targets)
    for index, target in enumerate(targets):
        target.module.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: recorder.record(index, args, kwargs), with_kwargs=True
        )
    return recorder


#: The batch key of the [8, 4] batches most tests feed.
BATCH_8 = batch_key(torch.zeros(8, 4))


def eager_step(recorder: WarmupRecorder, model: nn.Module, batch: torch.Tensor, keep_samples: bool = True) -> None:
    recorder.begin_step(batch=batch_key(batch), keep_samples=keep_samples)
    model(batch).sum().backward()
    recorder.end_step()


def test_stable_steps_give_a_plan_in_execution_order():
    model = TwoStage()
    recorder = recorded(model, ["second", "first"])
    for _ in range(3):
        eager_step(recorder, model, torch.randn(8, 4))
    plan = recorder.plan(set(), batch=BATCH_8)
    assert plan.unstable is None
    assert plan.skipped == {}
    assert [call.name for call in plan.calls] == ["first", "second"]
    assert plan.calls[0].module is model.first
    assert [list(call.samples[0].shape) for call in plan.calls] == [[8, 4], [8, 4]]


def test_sample_inputs_are_detached_clones_that_keep_requires_grad():
    model = TwoStage()
    recorder = recorded(model, ["first", "second"])
    seen = {}
    model.second.register_forward_pre_hook(lambda module, args: seen.setdefault("second", args[0]))
    batch = torch.randn(8, 4)
    eager_step(recorder, model, batch)
    first, second = recorder.plan(set(), batch=BATCH_8).calls
    (x,), (h,) = first.samples, second.samples

    assert torch.equal(x, batch)
    assert x.data_ptr() != batch.data_ptr()
    assert not x.requires_grad

    assert torch.equal(h, seen["second"].detach())
    assert h.data_ptr() != seen["second"].data_ptr()
    assert h.requires_grad
    assert h.grad_fn is None
    assert h.is_leaf


def test_an_input_that_moves_within_one_batch_shape_makes_it_unstable_naming_module_and_shapes():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(4, 4))
    recorder = recorded(model, ["body"])
    for rows in (8, 8, 5):  # the module's input moves while the batch key stays that of an [8, 4] batch
        recorder.begin_step(batch=BATCH_8, keep_samples=True)
        model(torch.randn(rows, 4)).sum().backward()
        recorder.end_step()
    plan = recorder.plan(set(), batch=BATCH_8)
    assert plan.calls == []
    assert plan.unstable is not None
    assert plan.unstable.startswith("body:")
    assert "[8, 4]" in plan.unstable
    assert "[5, 4]" in plan.unstable


class Repeats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.once = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.once(self.shared(self.shared(x)))


def test_targets_called_twice_or_not_at_all_are_skipped():
    model = Repeats()
    recorder = recorded(model, ["shared", "once", "never"])
    for _ in range(2):
        eager_step(recorder, model, torch.randn(8, 4))
    plan = recorder.plan(set(), batch=BATCH_8)
    assert plan.unstable is None
    assert [call.name for call in plan.calls] == ["once"]
    assert set(plan.skipped) == {"shared", "never"}
    assert "2 times" in plan.skipped["shared"]
    assert "not called" in plan.skipped["never"]


def test_excluded_targets_are_left_out_of_the_plan():
    model = TwoStage()
    recorder = recorded(model, ["first", "second"])
    eager_step(recorder, model, torch.randn(8, 4))
    assert [call.name for call in recorder.plan({0}, batch=BATCH_8).calls] == ["second"]


def test_plan_for_one_batch_key_ignores_steps_of_other_shapes():
    model = TwoStage()
    recorder = recorded(model, ["first", "second"])
    for rows in (8, 5, 8, 5):
        eager_step(recorder, model, torch.randn(rows, 4))

    assert recorder.recorded_steps(BATCH_8) == 2
    for rows in (8, 5):
        plan = recorder.plan(set(), batch=batch_key(torch.randn(rows, 4)))
        assert plan.unstable is None
        assert [list(call.samples[0].shape) for call in plan.calls] == [[rows, 4], [rows, 4]]
    assert recorder.plan(set(), batch=batch_key(torch.randn(3, 4))).unstable == "no eager step was recorded"


def test_plan_needs_kept_samples_and_recorded_steps():
    model = TwoStage()
    recorder = recorded(model, ["first"])
    assert recorder.plan(set(), batch=BATCH_8).unstable == "no eager step was recorded"
    eager_step(recorder, model, torch.randn(8, 4), keep_samples=False)
    assert "no sample inputs" in recorder.plan(set(), batch=BATCH_8).unstable
    eager_step(recorder, model, torch.randn(8, 4), keep_samples=True)
    assert recorder.plan(set(), batch=BATCH_8).unstable is None


def test_calls_outside_a_step_are_not_recorded():
    model = TwoStage()
    recorder = recorded(model, ["first"])
    model(torch.randn(8, 4))
    assert recorder.steps == []


def test_hook_removed_during_capture_stays_removed():
    region, fired = Region(), []
    handle = region.inner.register_forward_hook(lambda module, args, output: fired.append("fwd"))
    with hooks_stashed([region]):
        handle.remove()
    run(region)
    assert fired == []
    assert inner_hook_count(region) == 0


def test_hook_registered_during_capture_is_kept_after_the_old_ones():
    region, fired = Region(), []
    region.inner.register_forward_pre_hook(lambda module, args: fired.append("old"))
    with hooks_stashed([region]):
        region.inner.register_forward_pre_hook(lambda module, args: fired.append("new"))
    run(region)
    assert fired == ["old", "new"]

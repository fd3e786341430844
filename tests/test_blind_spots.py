"""Blind spots of the suite that an audit of planted bugs found (issue 51): each test fails on one such bug.

Every test trains the tiny decoder for real through the strict fake capture backend and checks what a user would:
that a setting of a second parameter group is held to the graph, that a graph off eager by just more than the
documented tolerance is refused and one just inside it is kept, that each of the shadow step's comparisons catches
a graph on its own, and so on. Each planted bug is an entry of the mutation check (``scripts/mutations.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchmetrics import Metric

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from lightning_cudagraph._backend.backend import StepGraph
from lightning_cudagraph._rollout.ladder import (
    CHECK_STEPS,
    MARGIN,
    MAX_MEASURE_STEPS,
    MEASURE_STEPS,
    REFERENCE_STEPS,
    reference_steps,
)
from tests.fake_backend import FakeBackend
from tests.helpers import LEVEL_MS, fit, graph_callback, max_param_diff, timed_by_level
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
STEPS = 10
#: Fused (graphed) against foreach (eager) AdamW on the CPU: the same update up to float rounding.
ROUNDING = 1e-5
DOCS = Path(__file__).resolve().parent.parent / "docs"


def documented(page: str, pattern: str) -> float:
    """The figure that ``pattern`` (one group) finds in ``docs/<page>``: what the user is promised."""
    found = re.search(pattern, (DOCS / page).read_text())
    assert found is not None, f"docs/{page} no longer says {pattern!r}"
    return float(found.group(1))


def whole_step(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    """``cudagraph_full`` whose captures go to a fake backend."""
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


def scoped(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    """``cudagraph_layer`` (regions and the optimizer graph) whose captures go to a fake backend."""
    strategy = CUDAGraphStrategy(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


# =================================================================== 1. every parameter group is held to the graph
class TwoGroups(DecoderModule):
    """AdamW with the head in a parameter group of its own, as users give embeddings or heads their own settings."""

    def configure_optimizers(self):
        head = list(self.model.head.parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in head)]
        return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 2e-3}], lr=1e-3, weight_decay=0.0)


class SetSecondGroupAt(pl.Callback):
    """Sets ``param_groups[1][key]`` by hand at the start of step ``step`` (after the capture)."""

    def __init__(self, step: int, key: str, value: float) -> None:
        self.step, self.key, self.value = step, key, value

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.optimizers[0].param_groups[1][self.key] = self.value


def test_a_setting_of_the_second_parameter_group_moved_after_capture_rolls_back_and_trains_as_eager():
    change = lambda: SetSecondGroupAt(WARMUP + 3, "weight_decay", 0.5)  # noqa: E731
    eager = fit(*decoder(TINY, module=TwoGroups), STEPS, [change()], **CPU)
    with pytest.warns(UserWarning, match=r"param_groups\[1\]\['weight_decay'\] moved from 0.0 to 0.5"):
        run = fit(*decoder(TINY, module=TwoGroups), STEPS, [change()], strategy=whole_step(), **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1), report.reason
    assert max_param_diff(eager.params, run.params) < ROUNDING, "a replay ran with the old weight decay"


def test_a_learning_rate_of_the_second_parameter_group_set_by_hand_takes_effect_on_replayed_steps():
    change = lambda: SetSecondGroupAt(WARMUP + 3, "lr", 0.0)  # noqa: E731  (the head frozen from then on)
    eager = fit(*decoder(TINY, module=TwoGroups), STEPS, [change()], **CPU)
    run = fit(*decoder(TINY, module=TwoGroups), STEPS, [change()], strategy=whole_step(), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
    assert report.steps_replayed >= STEPS - WARMUP - 3
    assert max_param_diff(eager.params, run.params) < ROUNDING, "replays kept the head's old learning rate"


# =================================================================== 2-3. the checks against eager, at their edges
class Nudged(DecoderModule):
    """Its loss is ``main * (1 + loss_nudge)`` with the gradient of ``main`` alone, plus ``grad_nudge`` added to the
    head's gradient (the loss value unchanged): two device buffers that only a graph's replay sees nonzero."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("loss_nudge", torch.zeros(()), persistent=False)
        self.register_buffer("grad_nudge", torch.zeros(()), persistent=False)
        self.register_buffer("val_nudge", torch.zeros(()), persistent=False)

    def training_step(self, batch, batch_idx):
        main = self.loss(batch)
        head = self.model.head.weight.sum()
        loss = main + main.detach() * self.loss_nudge + self.grad_nudge * (head - head.detach())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch) * (1 + self.val_nudge))


class OffEager(FakeBackend):
    """Graphs whose replays are off eager by a chosen amount, in one of three ways.

    ``update``: the replay's parameter update is scaled by ``1 + by`` (relative error ``by`` exactly);
    ``loss``: the step's loss is ``1 + by`` times eager's, its update unchanged (a :class:`Nudged` module);
    ``grad``: ``by`` is added to the head's gradient, the loss unchanged (a :class:`Nudged` module);
    ``val``: the logged ``val_loss`` is ``1 + by`` times eager's (a :class:`Nudged` module's evaluation graphs).
    ``armed`` says whether the next replays are off (a callback may arm some steps only).
    """

    def __init__(self, model: torch.nn.Module, how: str, by: float) -> None:
        super().__init__()
        self.model, self.how, self.by, self.armed = model, how, by, True

    def capture_step(self, body: Callable[[], None]) -> StepGraph:
        return _OffGraph(super().capture_step(body), self)


class _OffGraph:
    def __init__(self, graph: StepGraph, backend: OffEager) -> None:
        self.graph, self.backend = graph, backend

    def replay(self) -> None:
        backend, model = self.backend, self.backend.model
        if not backend.armed:
            self.graph.replay()
            return
        params = [p for p in model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        nudge = getattr(model, f"{backend.how}_nudge", None)
        if nudge is not None:
            nudge.fill_(backend.by)
        try:
            self.graph.replay()
        finally:
            if nudge is not None:
                nudge.zero_()
        if backend.how == "update":
            with torch.no_grad():
                for p, old in zip(params, before, strict=True):
                    p.copy_(old + (p - old) * (1 + backend.by))

    def reset(self) -> None:
        self.graph.reset()


SHADOW_TOL = documented("numerics.md", r"The tolerance is ([0-9.e-]+) relative in float32")
OPTIMIZER_TOL = documented("rollout.md", r"optimizer state must agree within ([0-9.e-]+) of the update's size")


@pytest.mark.parametrize(
    ("driver", "how", "tolerance"),
    [
        pytest.param(whole_step, "update", SHADOW_TOL, id="whole-step-update"),
        pytest.param(whole_step, "loss", SHADOW_TOL, id="whole-step-loss"),
        pytest.param(scoped, "update", OPTIMIZER_TOL, id="optimizer-graph"),
    ],
)
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_graph_just_outside_the_documented_tolerance_rolls_back_and_one_just_inside_is_kept(
    driver, how, tolerance, factor
):
    model, data = decoder(TINY, module=Nudged)
    backend = OffEager(model, how, by=factor * tolerance)
    run = fit(model, data, STEPS, strategy=driver(backend, audit_every_n_steps=None), **CPU)
    report = graph_callback(run.trainer).report
    if factor < 1:
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
        measured = report.optimizer_parity_err if driver is scoped else report.parity_err
        assert measured == pytest.approx(factor * tolerance, rel=0.05), "the check did not see the graph's error"
    else:
        assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1), "a graph off eager by 2x the tolerance kept"
        assert re.match(r"(optimizer_)?parity: ", report.rollback_reasons[0]), report.rollback_reasons


EVAL_TOL = documented("evaluation.md", r"or ([0-9.e-]+) in float32")


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_an_evaluation_graph_just_outside_the_documented_float32_tolerance_is_dropped_and_one_inside_is_kept(factor):
    model, data = decoder(TINY, module=Nudged, batch_size=4, train_samples=64, val_samples=16)
    backend = OffEager(model, "val", by=factor * EVAL_TOL)
    validation = {"limit_val_batches": 4, "val_check_interval": 4, "check_val_every_n_epoch": None}
    run = fit(model, data, 12, strategy=whole_step(backend), **validation, **CPU)
    evaluation = graph_callback(run.trainer).report.evaluation
    if factor < 1:
        assert evaluation.captures > 0 and evaluation.replays > 0, evaluation.reason
    else:
        assert evaluation.captures == 0, "an evaluation graph off eager by 2x the tolerance was kept"
        assert (evaluation.reason or "").startswith("eval_parity"), evaluation.reason


class ArmFirstMicroBatches(pl.Callback):
    """Arms an :class:`OffEager` backend on the micro-batches that only accumulate (``accumulate_grad_batches=2``)."""

    def __init__(self, backend: OffEager) -> None:
        self.backend = backend

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.backend.armed = batch_idx % 2 == 0


@pytest.mark.parametrize(
    ("how", "accumulate", "callback"),
    [
        pytest.param("loss", 1, None, id="loss-alone"),
        pytest.param("grad", 2, ArmFirstMicroBatches, id="micro-batch-gradient-alone"),
    ],
)
def test_the_shadow_step_fails_a_graph_that_is_off_eager_in_one_thing_alone(how, accumulate, callback):
    size = {**TINY, "train_samples": 4 * 2 * STEPS}
    eager = fit(*decoder(size, module=Nudged), STEPS, accumulate_grad_batches=accumulate, **CPU)
    model, data = decoder(size, module=Nudged)
    backend = OffEager(model, how, by=0.1 if how == "loss" else 1.0)
    callbacks = [callback(backend)] if callback else []
    with pytest.warns(UserWarning, match="rolled back to eager training: parity: the whole-step graph is off"):
        run = fit(
            model, data, STEPS, callbacks, strategy=whole_step(backend), accumulate_grad_batches=accumulate, **CPU
        )
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1), report.reason
    assert run.losses == pytest.approx(eager.losses, abs=ROUNDING), "a step trained on (or logged) the wrong graph"
    assert max_param_diff(eager.params, run.params) < 1e-4


# =================================================================== 4. outputs a user keeps past the next replay
class ExtraOutputs(DecoderModule):
    """Returns the loss with a detached copy beside it, as users return values for their callbacks."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return {"loss": loss, "kept": loss.detach()}


class KeepOutputs(pl.Callback):
    """Keeps every step's output tensors in a list, unread until the fit ends (as an epoch-end summary would)."""

    def __init__(self) -> None:
        self.outputs: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


def test_outputs_kept_from_replayed_steps_hold_each_steps_own_values_after_later_replays():
    kept_eager, kept = KeepOutputs(), KeepOutputs()
    fit(*decoder(TINY, module=ExtraOutputs), STEPS, [kept_eager], **CPU)
    run = fit(*decoder(TINY, module=ExtraOutputs), STEPS, [kept], strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.steps_replayed >= STEPS - WARMUP - 1
    for key in ("loss", "kept"):
        want = [float(output[key]) for output in kept_eager.outputs]
        got = [float(output[key]) for output in kept.outputs]
        assert len(set(got)) == len(got), f"outputs[{key!r}] of several steps share one tensor: {got}"
        assert got == pytest.approx(want, abs=ROUNDING), key


# =================================================================== 5. a metric updated in a step whose capture worked
class GraphSafeSum(Metric):
    """A sum with no host sync in its update (``SumMetric`` checks for NaN on the host unless the torchmetrics release
    has ``nan_strategy="disable"``, which the floor, 1.4, lacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor) -> None:
        self.total += value.sum()

    def compute(self) -> torch.Tensor:
        return self.total


class GraphSafeMetricInStep(DecoderModule):
    """Updates a torchmetrics metric in ``training_step`` with no host sync (so its capture succeeds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = GraphSafeSum()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.update(loss.detach())
        return loss


def test_a_metric_updated_in_a_captured_step_is_refused_and_counts_every_step_as_eager():
    eager = fit(*decoder(TINY, module=GraphSafeMetricInStep), STEPS, **CPU)
    with pytest.warns(UserWarning, match=r"rolled back to eager training: metric_in_graph.*\['seen'\]"):
        run = fit(*decoder(TINY, module=GraphSafeMetricInStep), STEPS, strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.rollbacks == 1
    assert run.model.seen.update_count == eager.model.seen.update_count == STEPS
    assert float(run.model.seen.compute()) == pytest.approx(float(eager.model.seen.compute()), abs=1e-4)


# =================================================================== 6-7. the step times the report and the ladder use
class Clock:
    """A fake step time per step: ``first`` for the fit's first step, then ``graphed`` for a step that replayed a
    graph and ``eager`` for one that did not; ``eager_after_capture`` (if given) for eager steps once any capture ran.
    With ``hiccup``, one replayed step in four (the fourth of the fit, the eighth, ...) takes that long instead.
    """

    def __init__(
        self,
        first: float,
        eager: float,
        graphed: float,
        eager_after_capture: float | None = None,
        hiccup: float | None = None,
    ) -> None:
        self.first, self.eager, self.graphed, self.later = first, eager, graphed, eager_after_capture
        self.hiccup, self.steps = hiccup, 0

    def __call__(self, backend: FakeBackend) -> float:
        self.steps += 1
        if self.steps == 1:
            return self.first
        if backend.step_replayed:
            return self.hiccup if self.hiccup is not None and self.steps % 4 == 0 else self.graphed
        captured = backend.regions or backend.step_graphs
        return self.later if self.later is not None and captured else self.eager


def test_the_report_and_the_logs_give_the_replayed_step_time_and_the_eager_one_without_the_first_step(tmp_path):
    clock = Clock(first=100.0, eager=10.0, graphed=4.0, hiccup=40.0)  # a slow replayed step in every log interval
    steps = 16
    run = fit(
        *decoder(TINY),
        steps,
        strategy=whole_step(FakeBackend(step_ms=clock), audit_every_n_steps=None),
        logger=CSVLogger(tmp_path),
        log_every_n_steps=4,
        **CPU,
    )
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.eager_step_ms == clock.eager, "the eager baseline leaves the first step (kernels, caches) out"
    assert report.step_ms == clock.graphed, "the step time is the replayed steps' median"
    logged = run.trainer.logged_metrics
    assert float(logged["cudagraph/step_ms"]) == clock.graphed
    assert float(logged["cudagraph/eager_step_ms"]) == clock.eager
    assert float(logged["cudagraph/speedup"]) == pytest.approx(clock.eager / clock.graphed)


def auto(backend: FakeBackend, **options) -> CUDAGraphStrategy:
    """``strategy="cudagraph"`` (``scope="auto"``) whose captures go to a fake backend."""
    strategy = CUDAGraphStrategy(warmup_steps=WARMUP, **options)
    strategy.capture_backend = backend
    return strategy


def test_a_slow_first_step_does_not_make_a_level_slower_than_eager_look_faster_in_a_short_fit():
    # Warmup, the first level's capture and confirmation, its first step on graphs (untimed), its timed steps, one
    # more: too short for the eager reference steps, so the warmup steps give the baseline, the first left out (the
    # whole step, the first level tried, runs none anyway).
    steps = WARMUP + 2 + 1 + MEASURE_STEPS + 1
    assert reference_steps(steps - WARMUP, accumulate=1, confirm_steps=2) == 0
    clock = Clock(first=100.0, eager=10.0, graphed=10.0 * (1 + MARGIN))  # every level a little slower than eager
    run = fit(*decoder(TINY), steps, strategy=auto(FakeBackend(step_ms=clock)), **CPU)
    report = graph_callback(run.trainer).report
    assert report.eager_step_ms == clock.eager
    first = report.ladder[-1]  # the whole step: the walk tries the widest level first
    assert first.level == "full_iteration", report.ladder
    assert first.step_ms == clock.graphed and first.status == "slower", report.ladder


def test_a_settled_level_is_checked_against_eager_steps_timed_beside_it_not_the_eager_time_before_capture():
    # Eager training runs at 10 ms before the first capture and at 2.5 ms after it (a host that warmed up): the
    # settled level, at 4 ms, wins against the first figure and loses against eager training beside it. Through the
    # callback the walk starts at a scoped level (the model's), whose replays eager steps run between.
    clock = Clock(first=10.0, eager=10.0, graphed=4.0, eager_after_capture=2.5)
    steps = WARMUP + REFERENCE_STEPS + 5 * (2 + MAX_MEASURE_STEPS) + 2 * CHECK_STEPS
    callback = CUDAGraphCallback(warmup_steps=WARMUP)
    callback.capture_backend = FakeBackend(step_ms=clock)
    run = fit(*decoder(TINY), steps, [callback], **CPU)
    report = graph_callback(run.trainer).report
    assert report.eager_step_ms == clock.eager
    assert any("steady state" in (row.reason or "") for row in report.ladder), report.ladder
    assert report.stage == Stage.DISABLED and "not_faster" in (report.reason or ""), report.reason


# =================================================================== 8. a settled whole step whose capture skipped
class _Hidden:
    """What a skip no watch can see reads: the fake backend, capturing or not."""

    backend: FakeBackend | None = None


class SkipWhenCapturingSmallBatches(DecoderModule):
    """Skips a batch of 3 sequences when its step is being captured (data that decides it, unseen by any watch)."""

    def training_step(self, batch, batch_idx):
        backend = _Hidden.backend
        if backend is not None and backend.capturing and batch[0].shape[0] == 3:
            return None
        return super().training_step(batch, batch_idx)


def batches_of_sizes(sizes: list[int]) -> DataLoader:
    """Batches of ``sizes[i]`` sequences each, in that order (the same tokens in every run)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(TINY["vocab_size"], (max(sizes), TINY["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)


def test_a_settled_whole_step_whose_new_shape_is_captured_on_a_skipped_batch_goes_down_a_level_not_off():
    settle = 60  # enough for scope="auto" to climb to the whole step and settle there
    sizes = [4] * settle + [3, 4] * 6
    backend = FakeBackend(step_ms=timed_by_level(LEVEL_MS))
    _Hidden.backend = backend
    levels = []

    class Level(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            levels.append(graph_callback(trainer).report.level)

    eager = fit(decoder(TINY, module=SkipWhenCapturingSmallBatches)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    try:
        model = decoder(TINY, module=SkipWhenCapturingSmallBatches)[0]
        strategy = auto(backend, on_shape_change="recapture")
        run = fit(model, batches_of_sizes(sizes), len(sizes), [Level()], strategy=strategy, **CPU)
    finally:
        _Hidden.backend = None
    report = graph_callback(run.trainer).report
    assert levels[settle] == "full_iteration", f"the fit had not settled on the whole step: {report.ladder}"
    assert any("skipped_step" in (row.reason or "") for row in report.ladder), report.ladder
    assert report.stage == Stage.REPLAYING and report.level not in (None, "full_iteration"), report.reason
    assert max_param_diff(eager.params, run.params) < 1e-4, "a step trained off eager"


# =================================================================== 9. an optimizer fused in one parameter group only
def partly_fused(optimizer: str):
    """A module whose ``optimizer`` (a ``torch.optim`` class name) is built with ``fused=True`` for the head only."""

    class PartlyFused(DecoderModule):
        def configure_optimizers(self):
            head = list(self.model.head.parameters())
            rest = [p for p in self.parameters() if all(p is not q for q in head)]
            return getattr(torch.optim, optimizer)([{"params": rest}, {"params": head, "fused": True}], lr=1e-3)

    return PartlyFused


def test_an_optimizer_fused_in_one_group_trains_as_eager_and_is_given_back_group_by_group():
    module = partly_fused("AdamW")
    eager = fit(*decoder(TINY, module=module), STEPS, **CPU)
    built = [
        {k: g.get(k) for k in ("fused", "capturable", "foreach")} for g in eager.trainer.optimizers[0].param_groups
    ]
    run = fit(*decoder(TINY, module=module), STEPS, strategy=whole_step(), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.steps_replayed >= STEPS - WARMUP - 1, report.reason
    assert max_param_diff(eager.params, run.params) < 1e-4
    groups = run.trainer.optimizers[0].param_groups
    assert [{k: g.get(k) for k in ("fused", "capturable", "foreach")} for g in groups] == built
    assert all(isinstance(group["lr"], float) for group in groups)


def test_an_optimizer_the_package_cannot_capture_is_refused_when_only_some_of_its_groups_are_fused():
    with pytest.raises(ValueError, match=r"Adagrad.*any optimizer built with fused=True"):
        fit(*decoder(TINY, module=partly_fused("Adagrad")), STEPS, strategy=whole_step(), **CPU)


# =================================================================== 10. a backward pre-hook inside a captured layer
class BackwardPreHookAt(pl.Callback):
    """At step ``step``, halves the gradient flowing into the second block's MLP (a backward pre-hook on it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.model.blocks[1].mlp.register_full_backward_pre_hook(lambda module, grad: (grad[0] * 0.5,))


def layers(backend: FakeBackend | None = None, **options):
    """``CUDAGraphCallback(scope=["layer"])`` whose captures go to a fake backend."""
    callback = CUDAGraphCallback(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    callback.capture_backend = backend or FakeBackend()
    return callback


@pytest.mark.parametrize("variant", ["whole_step", "layer"])
def test_a_backward_pre_hook_added_inside_a_captured_layer_after_capture_rolls_back_and_trains_as_eager(variant):
    hook = lambda: BackwardPreHookAt(WARMUP + 3)  # noqa: E731
    eager = fit(*decoder(TINY), STEPS, [hook()], **CPU)
    graphs = {"strategy": whole_step()} if variant == "whole_step" else {"callbacks": [hook(), layers()]}
    callbacks = graphs.pop("callbacks", [hook()])
    with pytest.warns(UserWarning, match=r"module_changed: model\.blocks\.1\.mlp got a hook"):
        run = fit(*decoder(TINY), STEPS, callbacks, **graphs, **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1), report.reason
    assert run.losses == pytest.approx(eager.losses, abs=ROUNDING)
    assert max_param_diff(eager.params, run.params) < 1e-4, "a replay ran without the hook"


@pytest.mark.parametrize("level", ["layer", "auto"])
def test_a_layer_with_a_backward_pre_hook_inside_stays_eager_and_the_fit_trains_as_eager(level):
    hook = lambda: BackwardPreHookAt(1)  # noqa: E731  (a warmup step: the hook is there before any capture)
    eager = fit(*decoder(TINY), STEPS, [hook()], **CPU)
    if level == "layer":
        run = fit(*decoder(TINY), STEPS, [hook(), layers()], **CPU)
    else:  # through the callback: the scoped levels are walked (a strategy tries the whole step first)
        callback = CUDAGraphCallback(warmup_steps=WARMUP)
        callback.capture_backend = FakeBackend(step_ms=timed_by_level(LEVEL_MS))
        run = fit(*decoder(TINY), STEPS, [hook(), callback], **CPU)
    report = graph_callback(run.trainer).report
    assert run.losses == pytest.approx(eager.losses, abs=ROUNDING)
    assert max_param_diff(eager.params, run.params) < 1e-4, "a replayed backward ran without the hook"
    said = [why for name, why in report.exclusions.items() if "backward hook" in why]
    assert said or report.stage == Stage.DISABLED, report.exclusions

"""Scenarios a maintainer could break without the rest of the CPU suite noticing, on the strict fake backend.

Each test guards one behaviour a GPU user relies on: graphs that return NaN or values off by a small factor are
not trusted, logged losses and learning rates stay live under the whole step, checkpoints hold plain optimizers,
layers past the tenth are captured, a region in eval mode does not replay its training graph, gradient
accumulation keeps every micro-batch, backwards out of order roll back, a seal holds under every shape policy.
``scripts/mutations.py`` breaks each of them on purpose and checks that a test here fails.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from lightning_cudagraph._options.hooks import hooks_stashed
from tests.fake_backend import FakeBackend
from tests.helpers import assert_losses_close, fit, graph_callback, max_param_diff, patched_forwards, trainer
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
STEPS = 8
WARMUP = 2


def whole_step(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    """``cudagraph_full`` whose captures go to a (strict) fake backend."""
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


def graphed(backend: FakeBackend | None = None, **options) -> CUDAGraphCallback:
    """Scoped graphs of the layers, captured by a (strict) fake backend."""
    callback = CUDAGraphCallback(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    callback.capture_backend = backend or FakeBackend()
    return callback


def batches_of_sizes(sizes: list[int]) -> DataLoader:
    """Token batches whose batch dimension follows ``sizes`` (one batch each)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(TINY["vocab_size"], (max(sizes), TINY["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)


# =================================================================== the whole step
class LoggedLoss(pl.Callback):
    """What ``self.log("train_loss", ...)`` holds at the end of every batch (what monitors read)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def test_every_replayed_whole_step_logs_its_own_loss():
    eager_logged, graphed_logged = LoggedLoss(), LoggedLoss()
    eager = fit(*decoder(TINY), STEPS, [eager_logged], **CPU)
    run = fit(*decoder(TINY), STEPS, [graphed_logged], strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.replays == STEPS - WARMUP
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert_losses_close(eager_logged.values, graphed_logged.values, 1e-6)
    replayed = graphed_logged.values[WARMUP:]
    assert len(set(replayed)) == len(replayed), f"a logged loss stayed frozen across replays: {replayed}"


def test_the_whole_step_with_dropout_trains_as_eager():
    eager = fit(*decoder(TINY, dropout=0.2), STEPS, **CPU)
    run = fit(*decoder(TINY, dropout=0.2), STEPS, strategy=whole_step(), **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert_losses_close(eager.losses, run.losses, 1e-6)


class SetLearningRate(pl.Callback):
    """At the start of ``step``, assigns a number to every group's ``lr``, as a manual warmup does."""

    def __init__(self, step: int, lr: float) -> None:
        self.step, self.lr = step, lr

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.lr


def test_a_learning_rate_assigned_as_a_number_takes_effect_on_replayed_steps():
    eager = fit(*decoder(TINY), STEPS, [SetLearningRate(WARMUP + 2, 3e-2)], **CPU)
    run = fit(*decoder(TINY), STEPS, [SetLearningRate(WARMUP + 2, 3e-2)], strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.replays == STEPS - WARMUP
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert max_param_diff(eager.params, run.params) < 2e-3  # Adam magnifies fused-vs-foreach rounding, not 3e-2 vs 1e-3


@pytest.mark.parametrize("schedule", [0, 2], ids=["constant", "step-lr"])
def test_checkpoints_of_the_whole_step_hold_float_learning_rates_and_the_users_flags(tmp_path, schedule):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=STEPS - 1)
    model, data = decoder(TINY, lr_step_size=schedule)
    run = trainer(STEPS, [checkpoint], strategy=whole_step(), enable_checkpointing=True, **CPU)
    run.fit(model, data)
    assert graph_callback(run).report.replays > 0
    saved = torch.load(checkpoint.last_model_path, weights_only=False)
    (group,) = saved["optimizer_states"][0]["param_groups"]
    assert isinstance(group["lr"], float), f"a checkpoint carries lr={group['lr']!r}"
    assert (group["capturable"], group["fused"]) == (False, None), "the optimizer is saved as the user built it"
    expected = 1e-3 * 0.5 ** (saved["global_step"] // schedule) if schedule else 1e-3
    assert group["lr"] == pytest.approx(expected, rel=1e-6)
    plain = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    plain.load_state_dict({"state": {}, "param_groups": [{**group, "params": [0, 1]}]})


def test_on_shape_change_error_under_the_whole_step_raises_with_both_shapes():
    sizes = [4] * (WARMUP + 2) + [3]
    with pytest.raises(RuntimeError, match=r"on_shape_change='error'.*int64\[3, 16\].*int64\[4, 16\]"):
        fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), strategy=whole_step(on_shape_change="error"), **CPU)


@pytest.mark.parametrize("setup", ["layer", "full_iteration"])
def test_a_seal_holds_with_on_shape_change_eager(setup):
    sizes = [4] * (WARMUP + 3) + [3]
    options = {"on_shape_change": "eager", "seal_after_steps": WARMUP + 2}
    graphs = {"strategy": whole_step(**options)} if setup == "full_iteration" else {"callbacks": [graphed(**options)]}
    with pytest.raises(RuntimeError, match=r"int64\[3, 16\].*sealed"):
        fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **graphs, **CPU)


class PoisonWeightAt(pl.Callback):
    """At the start of ``step``, writes NaN into a weight in place (the graphs read it: their losses turn NaN)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.head.weight[0, 0] = float("nan")


def test_a_nan_loss_of_a_replayed_whole_step_rolls_back_at_the_next_health_check():
    # The health check is under test: without audits (which would catch the NaN first, as a parity failure).
    with pytest.warns(UserWarning, match="rolled back to eager training: nonfinite_loss"):
        run = fit(
            *decoder(TINY),
            STEPS,
            [PoisonWeightAt(WARMUP + 2)],
            strategy=whole_step(audit_every_n_steps=None),
            log_every_n_steps=3,
            **CPU,
        )
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert report.nonfinite == [(WARMUP + 2, 2)], "the health check counts both NaN steps and names the first"


# =================================================================== scoped regions: parity and confirmation
@pytest.mark.parametrize("factor", [float("nan"), 1.001], ids=["nan", "off-by-0.1%"])
def test_a_graph_returning_nan_or_slightly_wrong_values_is_left_eager(factor):
    backend = FakeBackend(distort={"model.blocks.0": factor})
    callback = graphed(backend)
    eager = fit(*decoder(TINY), STEPS, **CPU)
    with pytest.warns(UserWarning, match="model.blocks.0 stays eager.*parity"):
        run = fit(*decoder(TINY), STEPS, [callback], **CPU)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert list(report.exclusions) == ["model.blocks.0"]
    assert backend.live_region_names == [] and patched_forwards(run.model) == []
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_a_graph_within_the_tolerance_is_kept_and_its_error_reported():
    callback = graphed(FakeBackend(distort={"model.blocks.0": 1 + 1e-6}))
    fit(*decoder(TINY), STEPS, [callback], **CPU)
    report = callback.report
    assert (report.stage, report.exclusions) == (Stage.REPLAYING, {})
    assert report.parity_err == pytest.approx(1e-6, rel=0.2)


class BreakGraphsAt(pl.Callback):
    """At the end of ``step``, every captured region starts returning NaN (a graph that goes bad in replay)."""

    def __init__(self, backend: FakeBackend, step: int) -> None:
        self.backend, self.step = backend, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            for region in self.backend.regions:
                region._distort = float("nan")


def test_scoped_graphs_that_give_nan_losses_during_confirmation_roll_back():
    backend = FakeBackend()
    callback = graphed(backend, confirm_steps=3)
    with pytest.warns(UserWarning, match="rolled back to eager training: nonfinite_loss"):
        run = fit(*decoder(TINY), STEPS, [callback, BreakGraphsAt(backend, WARMUP + 1)], **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert report.rollback_reasons[0].startswith("nonfinite_loss"), report.rollback_reasons
    assert patched_forwards(run.model) == []


def test_scoped_graphs_with_dropout_pass_parity_and_train_as_eager():
    eager = fit(*decoder(TINY, dropout=0.2), STEPS, **CPU)
    callback = graphed()
    run = fit(*decoder(TINY, dropout=0.2), STEPS, [callback], **CPU)
    report = callback.report
    assert (report.stage, report.exclusions, report.rollbacks) == (Stage.REPLAYING, {}, 0), report.reason
    assert_losses_close(eager.losses, run.losses, 1e-6)


# =================================================================== scoped regions: what replays
class LiveRegions(pl.Callback):
    """The regions alive at the end of every batch (placed after the graph callback)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend, self.names = backend, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.names.append(sorted(self.backend.live_region_names))


def test_a_model_of_more_than_ten_layers_has_every_layer_captured():
    layers = 12
    backend = FakeBackend()
    callback, live = graphed(backend), LiveRegions(backend)
    run = fit(*decoder({**TINY, "n_layer": layers}), STEPS, [callback, live], **CPU)
    names = [f"model.blocks.{i}" for i in range(layers)]
    report = callback.report
    assert report.scopes == {"layer": names}
    assert report.stage == Stage.REPLAYING, report.reason
    assert live.names[-1] == sorted(names), "layers 10 and 11 were left uncaptured"
    assert report.replays == (STEPS - WARMUP) * layers
    assert len(run.losses) == STEPS


class EvalFrom(pl.Callback):
    """From ``step`` on, the first block runs in eval mode during training (its dropout off)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            pl_module.model.blocks[0].eval()


def test_a_region_switched_to_eval_mode_runs_eagerly_in_eval_mode():
    eager = fit(*decoder(TINY, dropout=0.3), STEPS, [EvalFrom(WARMUP + 3)], **CPU)
    callback = graphed()
    run = fit(*decoder(TINY, dropout=0.3), STEPS, [callback, EvalFrom(WARMUP + 3)], **CPU)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    falls = {reason: n for reason, n in report.fallback_reasons.items() if "training mode True -> False" in reason}
    assert sum(falls.values()) == STEPS - WARMUP - 3, report.fallback_reasons
    assert_losses_close(eager.losses, run.losses, 1e-6)


def test_gradient_accumulation_keeps_the_first_micro_batch_gradient():
    eager = fit(*decoder(TINY), STEPS, accumulate_grad_batches=2, **CPU)
    callback = graphed()
    run = fit(*decoder(TINY), STEPS, [callback], accumulate_grad_batches=2, **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.REPLAYING, 0), report.reason
    assert report.steps_replayed > STEPS, "micro-batches replayed"
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-6


class TwoLosses(DecoderModule):
    """Manual optimization: two heads on two blocks fed the same input, backward on the first block's loss first.

    The blocks run forward in model order, backward in the same order: a shared graph pool cannot hold that.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        model = self.model
        h = model.tok_emb(x) + model.pos_emb(model.positions[: x.shape[1]])
        first, second = model.blocks[0](h), model.blocks[1](h)
        losses = [
            torch.nn.functional.cross_entropy(model.head(model.ln_f(out)).flatten(0, 1), y.flatten())
            for out in (first, second)
        ]
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(losses[0], retain_graph=True)
        self.manual_backward(losses[1])
        optimizer.step()
        loss = (losses[0] + losses[1]).detach()
        self.log("train_loss", loss)
        return loss


def test_backwards_out_of_reverse_forward_order_roll_back():
    callback = graphed(confirm_steps=2)
    with pytest.warns(UserWarning, match="rolled back to eager training: backward_order"):
        run = fit(*decoder(TINY, module=TwoLosses), STEPS, [callback], **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert "['model.blocks.0', 'model.blocks.1']" in report.rollback_reasons[0], report.rollback_reasons
    assert patched_forwards(run.model) == []


# =================================================================== hooks of regions that overlap
def test_hooks_stashed_for_overlapping_regions_come_back_removable():
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    fired: list[str] = []
    handle = outer[1][0].register_forward_hook(lambda module, args, output: fired.append("inner"))
    with hooks_stashed([outer, outer[1], outer[1][0]]):
        outer(torch.ones(1, 2))
    outer(torch.ones(1, 2))
    handle.remove()
    outer(torch.ones(1, 2))
    assert fired == ["inner"], "a hook stashed by overlapping regions fired while stashed or outlived its handle"


def test_nested_custom_scopes_capture_the_outer_region_and_keep_inner_hooks_for_eager_steps():
    backend = FakeBackend()
    callback = graphed(
        backend, scope=["outer", "inner"], modules={"outer": "model.blocks.0", "inner": "model.blocks.0.mlp"}
    )
    model, data = decoder(TINY)
    fired: list[bool] = []
    handle = model.model.blocks[0].mlp.register_forward_hook(lambda module, args, output: fired.append(True))
    with pytest.warns(UserWarning, match="fire during eager steps only"):
        trainer(STEPS, [callback], **CPU).fit(model, data)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert [region.name for region in backend.regions] == ["model.blocks.0"]
    eager_forwards = WARMUP + callback.report.audits  # the warmup steps, then each check's eager forward
    assert len(fired) == eager_forwards, "the inner hook fires in the eager steps and the checks' eager forwards"
    handle.remove()
    model.model.blocks[0](torch.zeros(1, TINY["seq_len"], TINY["width"]))
    assert len(fired) == eager_forwards, "the inner hook outlived its handle"


def test_an_lr_schedule_acts_on_replayed_whole_steps():
    eager = fit(*decoder(TINY, lr=1e-2, lr_step_size=2), STEPS, **CPU)
    run = fit(*decoder(TINY, lr=1e-2, lr_step_size=2), STEPS, strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.replays == STEPS - WARMUP
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert max_param_diff(eager.params, run.params) < 1e-3


def test_a_nan_during_whole_step_confirmation_rolls_back_at_its_end():
    strategy = whole_step(confirm_steps=3, audit_every_n_steps=None)  # confirmation's check, not an audit's
    with pytest.warns(UserWarning, match="rolled back to eager training: nonfinite_loss"):
        run = fit(*decoder(TINY), STEPS, [PoisonWeightAt(WARMUP + 2)], strategy=strategy, **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert "during confirmation" in report.rollback_reasons[0], report.rollback_reasons


# =================================================================== FP8 weights with a fallback in the window
@pytest.fixture
def te_stand_in(monkeypatch):
    """Transformer Engine's entry points, recorded: returns the list of skip flags the driver set."""
    import importlib.util

    from lightning_cudagraph._backend import te

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else find_spec(name, *a)
    )
    monkeypatch.setattr(te, "fp8_recipe_of", lambda plugin: "delayed-scaling")
    flags: list[bool] = []
    monkeypatch.setattr(te, "_set_te_skip_flag", flags.append)
    return flags


class EvalForOneMicroBatch(pl.Callback):
    """The first block runs in eval mode on the first micro-batch of optimizer step ``step`` (a fallback there)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.model.blocks[0].train(not (trainer.global_step == self.step and batch_idx % 2 == 0))


def test_a_fallback_inside_an_fp8_accumulation_window_quantizes_again(te_stand_in):
    callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = FakeBackend()
    fit(*decoder(TINY), 6, [callback, EvalForOneMicroBatch(4)], accumulate_grad_batches=2, **CPU)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.fallbacks == 1
    # Windows of steps 2..5; in step 4's the first micro-batch fell back, so the second quantizes the weights again.
    assert te_stand_in == [False, True, False, True, False, False, False, True], te_stand_in


@pytest.mark.timeout(120)  # a region that is never excluded is captured again and again: a hang
def test_when_every_region_fails_its_capture_the_fit_rolls_back_once_and_names_them():
    backend = FakeBackend(fail_regions={"model.blocks.": RuntimeError("injected: a host sync")})
    callback = graphed(backend)
    with pytest.warns(UserWarning, match="rolled back to eager training: capture_failed"):
        run = fit(*decoder(TINY), STEPS, [callback], **CPU)
    report = callback.report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert "no region could be captured" in report.rollback_reasons[0], report.rollback_reasons
    assert sorted(report.exclusions) == [f"model.blocks.{i}" for i in range(TINY["n_layer"])]
    assert len(backend.warmup_iters_per_pass) == TINY["n_layer"], "one pass per region, each without the ones before"
    assert backend.regions == [] and patched_forwards(run.model) == []


def test_a_whole_step_shadow_step_that_gives_nan_fails_and_keeps_training_eager():
    from lightning_cudagraph._trust.shadow import Verdict

    assert not Verdict(error=float("nan"), tolerance=1e-3).passed, "a NaN difference from eager passed"
    with pytest.warns(UserWarning, match="rolled back to eager training: parity"):
        run = fit(*decoder(TINY), STEPS, [PoisonWeightAt(WARMUP)], strategy=whole_step(), **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1), report.rollback_reasons
    assert " by nan " in report.rollback_reasons[0], report.rollback_reasons

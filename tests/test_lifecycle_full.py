"""The whole-step (``full_iteration``) lifecycle on a CPU, driven for real through the fake capture backend."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightning_cudagraph import CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import RaiseAtStep, RebindAt, assert_losses_close, fit, graph_callback, patched_forwards, trainer
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
STEPS = 8
WARMUP = 2


def whole_step(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    """``cudagraph_full`` whose captures go to a fake backend."""
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


def assert_released(backend: FakeBackend) -> None:
    assert backend.live_graphs == 0, "a step graph was not reset"
    assert backend.optimizers and all(optimizer.restored for optimizer in backend.optimizers)
    assert not backend.entered and backend.releases >= 1


def logged(path) -> dict[int, float]:
    with open(path) as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")}


def test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true(tmp_path):
    backend = FakeBackend()
    eager = fit(*decoder(TINY), STEPS, logger=CSVLogger(tmp_path, name="eager"), log_every_n_steps=1, **CPU)
    strategy = whole_step(backend)
    run = fit(
        *decoder(TINY), STEPS, strategy=strategy, logger=CSVLogger(tmp_path, name="graphed"), log_every_n_steps=1, **CPU
    )
    report = graph_callback(run.trainer).report
    assert (report.stage, report.captures, report.rollbacks, report.fallbacks) == (Stage.REPLAYING, 1, 0, 0)
    assert report.replays == STEPS - WARMUP
    assert backend.step_graphs and backend.step_graphs[0].replays == STEPS - WARMUP
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert logged(eager.trainer.logger.log_dir + "/metrics.csv") == pytest.approx(
        logged(run.trainer.logger.log_dir + "/metrics.csv"), abs=1e-6
    ), "train_loss logged from replayed steps differs from eager"
    assert_released(backend)


class ManyLogs(DecoderModule):
    """Logs on step and on epoch, a mean with the batch size taken from the batch, a sum with its own, a number."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("constant", 1.5)  # a number between tensors: the tensors around it still go direct
        self.log("loss_epoch", loss, on_step=False, on_epoch=True)
        self.log("double_sum", loss * 2, on_step=True, on_epoch=True, reduce_fx="sum", batch_size=3)
        self.log("graph_kept", loss, enable_graph=True)  # Lightning does not detach it: always through self.log
        return loss


class Silent(DecoderModule):
    """A ``training_step`` that logs nothing."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch)


class OwnLog(DecoderModule):
    """A LightningModule whose ``log`` does something of its own on every call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.own_calls = 0

    def log(self, *args, **kwargs):
        self.own_calls += 1
        super().log(*args, **kwargs)


def user_rows(path) -> list[dict[str, float]]:
    """The rows of a CSVLogger's metrics with what the user logged (the package's ``cudagraph/`` keys left out)."""
    with open(path) as handle:
        rows = [
            {k: float(v) for k, v in row.items() if v and not k.startswith("cudagraph/")}
            for row in csv.DictReader(handle)
        ]
    return [row for row in rows if set(row) - {"step", "epoch"}]


def test_replayed_steps_log_every_kind_of_call_as_eager_training_does_across_epochs(tmp_path, monkeypatch):
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    through_log: dict[str, int] = {}
    original = _ResultCollection.log

    def counted(self, fx, name, *args, **kwargs):
        if not name.startswith("cudagraph/"):  # the package's own metrics (graphed runs only)
            through_log[name] = through_log.get(name, 0) + 1
        return original(self, fx, name, *args, **kwargs)

    monkeypatch.setattr(_ResultCollection, "log", counted)
    steps, per_epoch = 12, 6
    size = {**TINY, "batch_size": 4, "train_samples": per_epoch * 4}
    eager = fit(*decoder(size, ManyLogs), steps, logger=CSVLogger(tmp_path, name="eager"), log_every_n_steps=1, **CPU)
    eager_calls, through_log = through_log, {}
    run = fit(
        *decoder(size, ManyLogs),
        steps,
        strategy=whole_step(audit_every_n_steps=None),  # an audit's eager step logs through self.log too
        logger=CSVLogger(tmp_path, name="graphed"),
        log_every_n_steps=1,
        **CPU,
    )
    # The first step of the second epoch runs eagerly: it re-checks the step's Python.
    assert graph_callback(run.trainer).report.replays == steps - WARMUP - 1
    assert run.trainer.current_epoch == eager.trainer.current_epoch == 2
    for metrics in ("logged_metrics", "callback_metrics", "progress_bar_metrics"):
        want = getattr(eager.trainer, metrics)
        got = {k: v for k, v in getattr(run.trainer, metrics).items() if not k.startswith("cudagraph/")}
        assert sorted(got) == sorted(want), metrics
        for key in want:
            assert float(got[key]) == pytest.approx(float(want[key]), abs=1e-5), f"{metrics}[{key!r}]"
    eager_rows = user_rows(eager.trainer.logger.log_dir + "/metrics.csv")
    graphed_rows = user_rows(run.trainer.logger.log_dir + "/metrics.csv")
    assert [sorted(row) for row in graphed_rows] == [sorted(row) for row in eager_rows]
    for want, got in zip(eager_rows, graphed_rows, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    # Tensors go through self.log in the eager warmup, in the capture step (a shadow step: the graph is checked
    # against the eager step, which is kept), on the first replay and on each epoch's first step; a number goes
    # through it on every step.
    assert eager_calls == dict.fromkeys(["train_loss", "loss_epoch", "double_sum", "constant", "graph_kept"], steps)
    assert through_log == {
        **dict.fromkeys(["train_loss", "loss_epoch", "double_sum"], WARMUP + 3),
        **dict.fromkeys(["constant", "graph_kept"], steps),
    }


def test_a_training_step_that_logs_nothing_replays_and_logs_nothing(tmp_path):
    run = fit(*decoder(TINY, Silent), STEPS, strategy=whole_step(), default_root_dir=tmp_path, **CPU)
    assert graph_callback(run.trainer).report.replays == STEPS - WARMUP
    assert not [key for key in run.trainer.logged_metrics if not key.startswith("cudagraph/")]


def test_a_module_that_overrides_log_has_it_called_for_every_replayed_step(tmp_path):
    run = fit(*decoder(TINY, OwnLog), STEPS, strategy=whole_step(), default_root_dir=tmp_path, **CPU)
    assert graph_callback(run.trainer).report.replays == STEPS - WARMUP
    assert run.model.own_calls == STEPS


def batches_of_sizes(sizes: list[int]) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(TINY["vocab_size"], (max(sizes), TINY["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)


@pytest.mark.parametrize(("policy", "captures", "fallbacks"), [("eager", 1, 2), ("recapture", 2, 1)])
def test_a_batch_of_another_shape_runs_eagerly_or_is_captured_on_its_second_sighting(policy, captures, fallbacks):
    sizes = [4] * (WARMUP + 2) + [3, 4, 3, 4]
    run = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), strategy=whole_step(on_shape_change=policy), **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.captures, report.fallbacks) == (Stage.REPLAYING, captures, fallbacks)
    eager = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    assert_losses_close(eager.losses, run.losses, 1e-6)


class _MetricInStep(DecoderModule):
    """Updates a torchmetrics metric inside ``training_step``: a replay would not count it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loss_mean = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.loss_mean.update(loss.detach())
        return loss


class _RebindDuringConfirmation(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == WARMUP + 1:
            weight = pl_module.model.head.weight
            weight.data = weight.data.clone()


class _Unfreeze(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        pl_module.model.ln_f.weight.requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == WARMUP + 3:
            pl_module.model.ln_f.weight.requires_grad_(True)


class _NaNAfterCapture(DecoderModule):
    """Writes NaN into a weight in place after capture: the graph reads it, as a diverging run would."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == WARMUP + 3:
            with torch.no_grad():
                self.model.head.weight[0, 0] = float("nan")


@pytest.mark.parametrize(
    ("module", "backend", "extra", "reason"),
    [
        pytest.param(_MetricInStep, FakeBackend(), [], "metric_in_graph", id="metric-in-step"),
        pytest.param(DecoderModule, FakeBackend(fail_capture=RuntimeError("no")), [], "capture_failed", id="capture"),
        pytest.param(DecoderModule, FakeBackend(), [_RebindDuringConfirmation()], "address_changed", id="rebound"),
        pytest.param(DecoderModule, FakeBackend(), [_Unfreeze()], "trainable_changed", id="unfrozen"),
        pytest.param(_NaNAfterCapture, FakeBackend(), [], "nonfinite_loss", id="nan-after-capture"),
        pytest.param(DecoderModule, FakeBackend(mib_per_graph=64.0), [], "memory_budget", id="over-budget"),
    ],
)
def test_a_failed_check_rolls_back_loudly(module, backend, extra, reason):
    strategy = whole_step(backend, max_pool_mib=32)
    with pytest.warns(UserWarning, match=f"rolled back to eager training: {reason}"):
        run = fit(*decoder(TINY, module=module), STEPS, extra, strategy=strategy, log_every_n_steps=2, **CPU)
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert report.rollback_reasons[0].startswith(reason), report.rollback_reasons
    assert run.trainer.global_step == STEPS, "training went on eagerly"
    assert_released(backend)


def test_module_hooks_are_refused_before_training():
    model, data = decoder(TINY)
    model.model.blocks[0].register_forward_hook(lambda module, args, output: None)
    with pytest.raises(ValueError, match=r"model\.blocks\.0 carry hooks.*hook\.remove\(\)") as error:
        trainer(STEPS, strategy=whole_step(), **CPU).fit(model, data)
    assert "Allowed: full_iteration on modules without forward or backward hooks" in str(error.value)


def test_an_exception_mid_fit_releases_the_graph_and_gives_the_optimizer_back():
    backend = FakeBackend()
    model, data = decoder(TINY)
    with pytest.raises(RuntimeError, match="user error"):
        trainer(STEPS, [RaiseAtStep(WARMUP + 2)], strategy=whole_step(backend), **CPU).fit(model, data)
    assert backend.step_graphs, "the step had been captured"
    assert patched_forwards(model) == []
    assert_released(backend)


def test_rotating_shapes_get_their_own_warmup_and_graphs_and_the_cache_evicts_the_least_recently_used():
    backend = FakeBackend()
    sizes = [4, 3] * 4 + [2, 4, 3, 2]  # shapes 4 and 3 from the start; 2 joins once the cache (2) is full
    strategy = whole_step(backend, on_shape_change="recapture", max_graphs=2)
    run = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), strategy=strategy, **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert (report.captures, report.evictions) == (3, 1)
    assert report.steps_replayed == 7 and report.steps_eager == 1  # shape 2 runs one eager step of its own
    eager = fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), **CPU)
    assert_losses_close(eager.losses, run.losses, 1e-6)
    assert_released(backend)


def test_a_sealed_whole_step_raises_on_a_new_shape():
    sizes = [4] * (WARMUP + 3) + [3]
    strategy = whole_step(on_shape_change="recapture", seal_after_steps=WARMUP + 2)
    with pytest.raises(RuntimeError, match=r"int64\[3, 16\].*sealed"):
        fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), strategy=strategy, **CPU)


def test_a_parameter_rebound_after_confirmation_rolls_back_before_the_next_replay():
    backend = FakeBackend()
    with pytest.warns(UserWarning, match="rolled back to eager training: address_changed"):
        run = fit(
            *decoder(TINY),
            12,
            [RebindAt(WARMUP + 4, "model.head.weight")],
            strategy=whole_step(backend),
            log_every_n_steps=2,
            **CPU,
        )
    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks) == (Stage.DISABLED, 1)
    assert report.steps_replayed >= 3
    assert_released(backend)

"""Evaluation graphs on a CPU, driven for real through the fake capture backend.

Validation, test and predict steps on forward-only graphs: the whole evaluation step through the strategy, the
trained regions through the callback alone; warmup, per-shape cache, parity before trust, release on every path.
"""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from torchmetrics import MeanMetric

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy
from lightning_cudagraph._trust.failure import GraphFailure
from tests.fake_backend import FakeBackend
from tests.helpers import RaiseAtStep, graph_callback, patched_forwards, trainer
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: 5 batches of 4 (the last ragged: 2 sequences) when ``val_samples=18``.
VAL = {"batch_size": 4, "train_samples": 64, "val_samples": 16}


def whole_step(backend: FakeBackend, **options) -> CUDAGraphStrategy:
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend
    return strategy


def scoped(backend: FakeBackend, **options) -> CUDAGraphCallback:
    callback = CUDAGraphCallback(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    callback.capture_backend = backend
    return callback


def interleaved(tmp_path, name: str, **options):
    """A fit of 12 steps with validation every 4 training batches (3 validations of 4 batches)."""
    return trainer(
        12,
        logger=CSVLogger(tmp_path, name=name),
        limit_val_batches=4,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        log_every_n_steps=1,
        **{**CPU, **options},
    )


def val_losses(run) -> list[float]:
    with open(run.logger.log_dir + "/metrics.csv") as handle:
        return [float(row["val_loss"]) for row in csv.DictReader(handle) if row.get("val_loss")]


def eager_fit(tmp_path, **data):
    run = interleaved(tmp_path, "eager")
    run.fit(*decoder(TINY, **{**VAL, **data}))
    return run


class Watch(Callback):
    """What the fake backend holds at each validation's end (both sets of graphs live in between)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend, self.at_validation_end = backend, []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.at_validation_end.append(sum(g.live for g in self.backend.step_graphs))


def test_interleaved_fit_keeps_training_and_evaluation_graphs_and_logs_eager_val_loss(tmp_path):
    backend = FakeBackend()
    eager = eager_fit(tmp_path)
    watch = Watch(backend)
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend), callbacks=[watch], num_sanity_val_steps=2)
    model, data = decoder(TINY, **VAL)
    run.fit(model, data)
    report = graph_callback(run).report
    assert report.captures == 1 and report.rollbacks == 0, "the training graph was disturbed by evaluation"
    evaluation = report.evaluation
    assert (evaluation.mode, evaluation.captures, evaluation.reason) == ("whole_step", 1, None)
    assert evaluation.memory_mib >= 1.0 and evaluation.capture_ms > 0, "what the capture added to the pool, its time"
    # The first validation: its first batch (warmup) and second (capture) eagerly, then replays; later ones replay.
    assert evaluation.replays == 2 + 4 + 4
    assert watch.at_validation_end == [2, 2, 2], "training and evaluation graphs both live between validations"
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-6)
    assert backend.live_graphs == 0 and not backend.entered and evaluation.releases == 1
    assert patched_forwards(model) == []


def test_sanity_check_runs_eagerly(tmp_path):
    backend = FakeBackend()
    seen = []

    class AfterSanity(Callback):
        def on_sanity_check_end(self, trainer, pl_module):
            seen.append(graph_callback(trainer).report.evaluation.captures)

    run = interleaved(tmp_path, "g", strategy=whole_step(backend), callbacks=[AfterSanity()], num_sanity_val_steps=3)
    run.fit(*decoder(TINY, **VAL))
    assert seen == [0]


def test_a_ragged_last_batch_gets_its_own_graph_once_seen_twice(tmp_path):
    backend = FakeBackend()
    data = {"val_samples": 14}  # batches of 4, 4, 4, 2
    eager = eager_fit(tmp_path, **data)
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend))
    run.fit(*decoder(TINY, **{**VAL, **data}))
    evaluation = graph_callback(run).report.evaluation
    assert evaluation.captures == 2, "one graph per batch shape"
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-6)


def test_validate_test_and_predict_outside_fit_match_eager_and_release_at_the_loop_end():
    model, data = decoder(TINY, **VAL)
    data.setup("validate")
    loader = data.val_dataloader()
    eager = trainer(1, limit_val_batches=1.0, **CPU)
    expected_val = eager.validate(model, loader, verbose=False)
    expected_test = eager.test(model, loader, verbose=False)
    expected_pred = eager.predict(model, loader)

    backend = FakeBackend()
    graphed = trainer(1, strategy=whole_step(backend), limit_val_batches=1.0, **CPU)
    assert graphed.validate(model, loader, verbose=False)[0] == pytest.approx(expected_val[0], abs=1e-6)
    evaluation = graph_callback(graphed).report.evaluation
    assert (evaluation.mode, evaluation.captures, evaluation.replays) == ("whole_step", 1, 2)
    assert backend.live_graphs == 0 and not backend.entered, "a loop outside a fit releases its graphs at its end"
    assert graphed.test(model, loader, verbose=False)[0] == pytest.approx(expected_test[0], abs=1e-6)
    predictions = graphed.predict(model, loader)
    assert len(predictions) == len(expected_pred)
    for got, want in zip(predictions, expected_pred, strict=True):
        torch.testing.assert_close(got, want)
    pointers = {p.data_ptr() for p in predictions}
    assert len(pointers) == len(predictions), "each prediction is its own tensor, not the graph's static output"
    assert evaluation.captures == 3 and backend.live_graphs == 0
    assert patched_forwards(model) == []


class MetricInStep(DecoderModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.val_mean = MeanMetric()

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.val_mean.update(loss)
        self.log("val_loss", loss)
        self.log("val_mean", self.val_mean)


def test_a_metric_updated_inside_the_step_keeps_the_loop_eager_with_the_reason(tmp_path):
    backend = FakeBackend()
    eager = interleaved(tmp_path, "eager")
    eager.fit(*decoder(TINY, module=MetricInStep, **VAL))
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend))
    model, data = decoder(TINY, module=MetricInStep, **VAL)
    run.fit(model, data)
    evaluation = graph_callback(run).report.evaluation
    assert evaluation.captures == 0 and evaluation.reason.startswith("metric_in_graph")
    assert "val_mean" in evaluation.reason
    assert float(run.callback_metrics["val_mean"]) == pytest.approx(float(eager.callback_metrics["val_mean"]))
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-6)


class MetricFromOutputs(DecoderModule):
    """The documented pattern: the step returns its loss, a hook updates the metric from the outputs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.val_mean = MeanMetric()

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_mean.update(outputs)

    def on_validation_epoch_end(self):
        self.log("val_mean", self.val_mean.compute())
        self.val_mean.reset()


def test_a_metric_updated_from_the_step_outputs_ends_equal_to_eager(tmp_path):
    eager = interleaved(tmp_path, "eager")
    eager.fit(*decoder(TINY, module=MetricFromOutputs, **VAL))
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend))
    run.fit(*decoder(TINY, module=MetricFromOutputs, **VAL))
    assert graph_callback(run).report.evaluation.replays > 0
    assert float(run.callback_metrics["val_mean"]) == pytest.approx(float(eager.callback_metrics["val_mean"]), abs=1e-6)


class PythonStateInStep(DecoderModule):
    """A step whose result depends on a Python counter: a graph bakes the capture's value in (a wrong graph)."""

    calls = 0

    def validation_step(self, batch, batch_idx):
        self.calls += 1
        self.log("val_loss", self.loss(batch) * self.calls)


def test_a_graph_that_differs_from_eager_is_dropped_loudly_and_the_shape_stays_eager(tmp_path):
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend))
    with pytest.warns(UserWarning, match="eval_parity"):
        run.fit(*decoder(TINY, module=PythonStateInStep, **VAL))
    report = graph_callback(run).report
    assert report.evaluation.captures == 0 and report.evaluation.replays == 0
    assert report.evaluation.reason.startswith("eval_parity")
    assert report.evaluation.fallbacks > 0, "later batches of that shape ran eagerly, counted"
    assert report.captures == 1 and report.rollbacks == 0, "training graphs are not affected"
    assert backend.live_graphs == 0


def test_on_failure_raise_raises_on_a_wrong_evaluation_graph_and_releases(tmp_path):
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend, on_failure="raise"))
    model, data = decoder(TINY, module=PythonStateInStep, **VAL)
    with pytest.raises(GraphFailure, match="eval_parity"):
        run.fit(model, data)
    assert backend.live_graphs == 0 and not backend.entered
    assert patched_forwards(model) == []


def test_an_exception_after_evaluation_graphs_exist_releases_both_sets(tmp_path):
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend), callbacks=[RaiseAtStep(9)])
    model, data = decoder(TINY, **VAL)
    with pytest.raises(RuntimeError, match="user error at step 9"):
        run.fit(model, data)
    report = graph_callback(run).report
    assert report.evaluation.captures == 1
    assert backend.live_graphs == 0 and not backend.entered and report.evaluation.releases >= 1


class RaiseInValidation(Callback):
    def __init__(self, at: int) -> None:
        self.at, self.batches = at, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.batches += 1
            if self.batches == self.at:
                raise RuntimeError("user error in validation")


def test_an_exception_inside_an_evaluation_loop_releases_and_restores(tmp_path):
    backend = FakeBackend()
    callback = scoped(backend)
    run = interleaved(tmp_path, "scoped", callbacks=[callback, RaiseInValidation(7)])
    model, data = decoder(TINY, **VAL)
    with pytest.raises(RuntimeError, match="user error in validation"):
        run.fit(model, data)
    assert callback.report.evaluation.captures > 0
    assert backend.live_graphs == 0 and not backend.entered
    assert patched_forwards(model) == [], "the evaluation wrap and the training forwards are both given back"


def test_scoped_regions_get_forward_only_graphs_in_validation_through_the_callback(tmp_path):
    eager = eager_fit(tmp_path)
    backend = FakeBackend()
    callback = scoped(backend)
    during = []

    class Patched(Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            during.append(len(patched_forwards(pl_module)))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            modules = dict(pl_module.named_modules())
            wrapped = [n for n in patched_forwards(pl_module) if type(modules[n].forward).__name__ == "RegionForward"]
            assert wrapped == [], "evaluation wraps are gone once training resumes"

    run = interleaved(tmp_path, "scoped", callbacks=[callback, Patched()])
    model, data = decoder(TINY, **VAL)
    run.fit(model, data)
    evaluation = callback.report.evaluation
    assert evaluation.mode == "regions" and evaluation.reason is None
    assert evaluation.captures == TINY["n_layer"], "one forward-only graph per trained layer"
    assert evaluation.replays > 0 and callback.report.rollbacks == 0
    assert set(during) == {TINY["n_layer"]}
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-5)
    assert backend.live_graphs == 0 and patched_forwards(model) == []


def test_a_wrong_region_graph_stays_eager_in_evaluation(tmp_path):
    backend = FakeBackend()
    callback = scoped(backend)
    eager = eager_fit(tmp_path)
    original = backend.capture_step

    def wrong_step(body):  # evaluation region graphs whose replay returns twice the output
        graph = original(body)
        replay = graph.replay

        def doubled():
            replay()
            for op in graph._ops[-1:]:
                for out in op.outputs:
                    if out is not None:
                        out.mul_(2)

        graph.replay = doubled
        return graph

    backend.capture_step = wrong_step
    run = interleaved(tmp_path, "scoped", callbacks=[callback])
    with pytest.warns(UserWarning, match="eval_parity"):
        run.fit(*decoder(TINY, **VAL))
    assert callback.report.evaluation.captures == 0
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-5)


def test_validate_through_the_callback_alone_outside_fit_is_eager_with_the_reason():
    model, data = decoder(TINY, **VAL)
    data.setup("validate")
    backend = FakeBackend()
    callback = scoped(backend)
    run = trainer(1, callbacks=[callback], limit_val_batches=1.0, **CPU)
    run.validate(model, data.val_dataloader(), verbose=False)
    evaluation = callback.report.evaluation
    assert evaluation.mode == "eager" and "outside a fit" in evaluation.reason
    assert backend.step_graphs == [] and patched_forwards(model) == []


def test_eval_graphs_false_keeps_evaluation_eager(tmp_path):
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend, eval_graphs=False))
    run.fit(*decoder(TINY, **VAL))
    report = graph_callback(run).report
    assert report.evaluation.captures == 0 and report.evaluation.reason == "eval_graphs=False"
    assert report.captures == 1


def test_eval_graphs_must_be_a_bool():
    with pytest.raises(ValueError, match="eval_graphs"):
        CUDAGraphCallback(eval_graphs="yes")


def test_parameters_rebound_between_validations_are_captured_again(tmp_path):
    class Rebind(Callback):
        def on_validation_start(self, trainer, pl_module):
            if trainer.global_step == 8:
                weight = pl_module.model.head.weight
                weight.data = weight.data.clone()

    eager = eager_fit(tmp_path)
    backend = FakeBackend()
    run = interleaved(tmp_path, "graphed", strategy=whole_step(backend), callbacks=[Rebind()])
    run.fit(*decoder(TINY, **VAL))
    evaluation = graph_callback(run).report.evaluation
    assert evaluation.captures == 2, "the graph reading the old weight was dropped and captured again"
    assert val_losses(run) == pytest.approx(val_losses(eager), abs=1e-6)


@pytest.mark.parametrize("through", ["strategy", "callback"])
def test_under_scope_auto_evaluation_follows_the_whole_step_at_once_and_waits_for_a_scoped_level_to_settle(through):
    # The walk tries the widest level first: the whole step through the strategy, the model's regions through the
    # callback. A scoped level's evaluation graphs wait until the walk keeps it.
    from tests.test_ladder import STEPS, auto_callback, auto_strategy, timed

    backend = timed()
    reasons: list[tuple[str | None, str | None]] = []

    class Reasons(Callback):
        def on_validation_end(self, trainer, pl_module):
            evaluation = graph_callback(trainer).report.evaluation
            reasons.append((evaluation.mode, evaluation.reason))

    graphs = {"strategy": auto_strategy(backend)} if through == "strategy" else {"callbacks": [auto_callback(backend)]}
    run = trainer(
        STEPS,
        callbacks=[Reasons(), *graphs.get("callbacks", [])],
        strategy=graphs.get("strategy", "auto"),
        limit_val_batches=3,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        **CPU,
    )
    run.fit(*decoder(TINY, **VAL))
    report = graph_callback(run).report
    if through == "strategy":
        assert report.level == "full_iteration"
        assert set(reasons) == {("whole_step", None)} and report.evaluation.captures == 1, reasons
        return
    assert report.level == "model"
    assert reasons[0] == (
        "eager",
        "scope='auto' has not settled on a level yet (evaluation graphs follow the level training keeps)",
    )
    assert reasons[-1] == ("regions", None), reasons

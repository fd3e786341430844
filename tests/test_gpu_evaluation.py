"""Evaluation graphs on a GPU: validation, test and predict on forward-only CUDA graphs. Run with `pytest -m cuda`."""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.helpers import graph_callback, graph_pool_bytes, patched_forwards, trainer
from tests.models import SMALL, decoder

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

CUDA = {"accelerator": "cuda", "devices": 1}
DATA = {"batch_size": 8, "train_samples": 8 * 64, "val_samples": 8 * 6}


def val_losses(run) -> list[float]:
    with open(run.logger.log_dir + "/metrics.csv") as handle:
        return [float(row["val_loss"]) for row in csv.DictReader(handle) if row.get("val_loss")]


class Held(Callback):
    """At each validation's end: the training graphs, the evaluation graphs and the bytes in graph pools."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            report = graph_callback(trainer).report
            torch.cuda.synchronize()
            self.rows.append((report.graphs, report.evaluation.graphs, graph_pool_bytes()))


def interleaved(tmp_path, name, **options):
    return trainer(
        20,
        logger=CSVLogger(tmp_path, name=name),
        limit_val_batches=6,
        val_check_interval=5,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=2,
        log_every_n_steps=1,
        **{**CUDA, **options},
    )


def test_interleaved_fit_keeps_both_sets_of_graphs_and_releases_both(tmp_path):
    eager = interleaved(tmp_path, "eager")
    eager.fit(*decoder(SMALL, fused=True, lr=3e-4, **DATA))  # the package runs AdamW fused: equal arithmetic
    held = Held()
    run = interleaved(tmp_path, "graphed", strategy=CUDAGraphStrategy(scope=["full_iteration"]), callbacks=[held])
    model, data = decoder(SMALL, lr=3e-4, **DATA)
    run.fit(model, data)
    report = graph_callback(run).report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
    evaluation = report.evaluation
    assert evaluation.mode == "whole_step" and evaluation.captures == 1, evaluation.reason
    assert evaluation.replays == 4 + 6 + 6 + 6
    assert [(train, ev) for train, ev, _ in held.rows] == [(1, 1)] * 4, "both sets live between validations"
    assert all(pool > 0 for _, _, pool in held.rows)
    assert val_losses(run) == pytest.approx(val_losses(eager), rel=1e-4)
    torch.cuda.synchronize()
    assert graph_pool_bytes() == 0, "the training and evaluation graphs' pool is freed at fit end"
    assert patched_forwards(model) == []
    print(f"\neval graphs: {evaluation.memory_mib:.1f} MiB, parity {evaluation.parity_err:.2g}, val {val_losses(run)}")


def test_validate_test_predict_outside_fit_equal_eager_and_release():
    model, data = decoder(SMALL, **DATA)
    data.setup("validate")
    loader = data.val_dataloader()
    model.cuda()
    eager = trainer(1, limit_val_batches=1.0, **CUDA)
    expected = (eager.validate(model, loader, verbose=False), eager.test(model, loader, verbose=False))
    expected_pred = eager.predict(model, loader)
    graphed = trainer(1, strategy=CUDAGraphStrategy(scope=["full_iteration"]), limit_val_batches=1.0, **CUDA)
    got = (graphed.validate(model, loader, verbose=False), graphed.test(model, loader, verbose=False))
    predictions = graphed.predict(model, loader)
    evaluation = graph_callback(graphed).report.evaluation
    assert evaluation.captures == 3 and evaluation.replays == 3 * 4, evaluation.reason
    assert got[0][0]["val_loss"] == pytest.approx(expected[0][0]["val_loss"], rel=1e-6)
    assert got[1][0]["test_loss"] == pytest.approx(expected[1][0]["test_loss"], rel=1e-6)
    for mine, theirs in zip(predictions, expected_pred, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert len({p.data_ptr() for p in predictions}) == len(predictions)
    torch.cuda.synchronize()
    assert graph_pool_bytes() == 0 and patched_forwards(model) == []


def test_scoped_regions_graph_validation_through_the_callback(tmp_path):
    eager = interleaved(tmp_path, "eager")
    eager.fit(*decoder(SMALL, lr=3e-4, **DATA))
    held = Held()
    callback = CUDAGraphCallback(scope=["layer"])
    run = interleaved(tmp_path, "graphed", callbacks=[callback, held])
    model, data = decoder(SMALL, lr=3e-4, **DATA)
    run.fit(model, data)
    report = callback.report
    assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
    evaluation = report.evaluation
    assert evaluation.mode == "regions" and evaluation.captures == SMALL["n_layer"], evaluation.reason
    assert evaluation.replays > 0
    assert all(ev == SMALL["n_layer"] for _, ev, _ in held.rows)
    assert val_losses(run) == pytest.approx(val_losses(eager), rel=1e-3)
    torch.cuda.synchronize()
    assert graph_pool_bytes() == 0 and patched_forwards(model) == []

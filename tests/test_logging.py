"""The graph metrics reach real Lightning loggers (CSV, TensorBoard, MLflow) on short CPU fits.

Each fit is 6 optimizer steps with ``log_every_n_steps=2``, so every logger should see three rows of
``cudagraph/*`` metrics, at the same steps as Lightning's own ``train_loss``, with ``cudagraph/stage == -1``
(no CUDA on this machine).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_cudagraph import CUDAGraphCallback, Stage
from tests.helpers import cpu_trainer
from tests.models import TINY, TINY_DATA, decoder

MAX_STEPS, LOG_EVERY = 6, 2

#: Metrics that are measured on every machine, so they must be logged on a CPU too.
CPU_KEYS = (
    "cudagraph/stage",
    "cudagraph/graphs",
    "cudagraph/replays",
    "cudagraph/fallbacks",
    "cudagraph/rollbacks",
    "cudagraph/pool_mib",
    "cudagraph/step_ms",
)

#: The metrics read back from a logger: key -> [(step, value)].
History = dict[str, list[tuple[int, float]]]


def fit_with(tmp_path: Path, logger: Logger | list[Logger] | bool, **kwargs: Any) -> tuple[pl.Trainer, Any]:
    model, data = decoder(TINY, **TINY_DATA)
    callback = CUDAGraphCallback()
    trainer = cpu_trainer(
        tmp_path, MAX_STEPS, [callback], **{"log_every_n_steps": LOG_EVERY, "logger": logger, **kwargs}
    )
    trainer.fit(model, datamodule=data)
    return trainer, callback


# =================================================================== loggers and how to read them back
def csv_logger(tmp_path: Path) -> CSVLogger:
    return CSVLogger(tmp_path, name="csv")


def read_csv(logger: CSVLogger) -> History:
    history: History = {}
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key not in ("step", "epoch") and value != "":
                    history.setdefault(key, []).append((int(row["step"]), float(value)))
    return history


def tensorboard_logger(tmp_path: Path) -> TensorBoardLogger:
    return TensorBoardLogger(tmp_path, name="tb")


def read_tensorboard(logger: TensorBoardLogger) -> History:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(logger.log_dir)
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def mlflow_logger(tmp_path: Path) -> MLFlowLogger:
    # mlflow-skinny 3.x refuses file stores unless MLFLOW_ALLOW_FILE_STORE=true (the opt-out its error names), and
    # its sqlite store needs SQLAlchemy, which mlflow-skinny does not install; so the test opts in to the file store.
    return MLFlowLogger(experiment_name="cudagraph", tracking_uri=f"file:{tmp_path}/mlruns")


def read_mlflow(logger: MLFlowLogger) -> History:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(logger._tracking_uri)
    keys = client.get_run(logger.run_id).data.metrics
    return {
        key: sorted((metric.step, metric.value) for metric in client.get_metric_history(logger.run_id, key))
        for key in keys
    }


LOGGERS: dict[str, tuple[Callable[[Path], Logger], Callable[[Any], History]]] = {
    "csv": (csv_logger, read_csv),
    "tensorboard": (tensorboard_logger, read_tensorboard),
    "mlflow": (mlflow_logger, read_mlflow),
}


@pytest.mark.parametrize("kind", list(LOGGERS))
def test_graph_metrics_reach_logger(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    make_logger, read_back = LOGGERS[kind]
    logger = make_logger(tmp_path)
    _, callback = fit_with(tmp_path, logger)
    assert callback.report.reason == "no_cuda"

    history = read_back(logger)
    missing = [key for key in CPU_KEYS if key not in history]
    assert not missing, f"{kind}: missing {missing}; logged {sorted(history)}"

    loss_steps = [step for step, _ in history["train_loss"]]
    assert len(loss_steps) == MAX_STEPS // LOG_EVERY
    for key in CPU_KEYS:
        steps = [step for step, _ in history[key]]
        assert steps == loss_steps, f"{key} logged at steps {steps}, Lightning's train_loss at {loss_steps}"
        assert all(isinstance(value, float) and math.isfinite(value) for _, value in history[key])

    assert {value for _, value in history["cudagraph/stage"]} == {float(Stage.DISABLED)}
    for key in ("cudagraph/graphs", "cudagraph/replays", "cudagraph/fallbacks", "cudagraph/rollbacks"):
        assert {value for _, value in history[key]} == {0.0}, key
    assert all(value > 0 for _, value in history["cudagraph/step_ms"])
    for key in history:  # a metric that is not measured on a CPU is left out, never logged as nan
        assert all(not math.isnan(value) for _, value in history[key]), key


def test_every_logger_of_the_trainer_gets_the_metrics(tmp_path):
    csv_log, tb_log = csv_logger(tmp_path), tensorboard_logger(tmp_path)
    fit_with(tmp_path, [csv_log, tb_log])
    assert read_csv(csv_log)["cudagraph/stage"] == read_tensorboard(tb_log)["cudagraph/stage"]


class RecordingLogger(Logger):
    """A logger that keeps every call, with no rank-zero filter of its own (unlike Lightning's loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


@pytest.mark.parametrize(("rank", "expect_graph_rows"), [(0, True), (1, False)], ids=["rank0", "rank1"])
def test_graph_metrics_are_logged_on_rank_zero_only(tmp_path, monkeypatch, rank, expect_graph_rows):
    # A single-device Trainer leaves `rank_zero_only.rank` alone, so setting it makes this process act as that rank.
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    logger = RecordingLogger()
    fit_with(tmp_path, logger)

    graph_rows = [row for _, row in logger.rows if any(key.startswith("cudagraph/") for key in row)]
    lightning_rows = [row for _, row in logger.rows if "train_loss" in row]
    assert lightning_rows, "Lightning itself logs on every rank to a logger without a rank filter"
    assert bool(graph_rows) is expect_graph_rows
    if expect_graph_rows:
        assert all(row["cudagraph/stage"] == float(Stage.DISABLED) for row in graph_rows)
        assert all(type(value) is float for row in graph_rows for value in row.values()), "plain floats only"


def test_stage_is_shown_in_the_progress_bar(tmp_path):
    trainer, _ = fit_with(tmp_path, False, enable_progress_bar=True)
    assert trainer.progress_bar_metrics["cudagraph/stage"] == float(Stage.DISABLED)

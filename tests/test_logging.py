"""The graph metrics go through Lightning's own logging, to real loggers (CSV, TensorBoard, MLflow), on CPU fits.

Graphs are on through the fake capture backend (:mod:`tests.fake_backend`), which runs the whole rollout on a CPU.
Each fit is 6 optimizer steps with ``log_every_n_steps=2``: Lightning writes three rows of the user's metrics, and the
``cudagraph/*`` metrics must be in those rows, in ``trainer.logged_metrics`` and in ``trainer.callback_metrics``.
When graphs are off from the start (no CUDA, ``impl="none"``) nothing of the package is logged or shown.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger

from lightning_cudagraph import CUDAGraphCallback, Stage
from lightning_cudagraph._graphs.scoped import ScopedDriver
from lightning_cudagraph._rollout.fit_log import READ_EVERY_WITHOUT_LOGGING
from lightning_cudagraph._rollout.reporting import ProgressBarItems
from lightning_cudagraph._rollout.step_times import FitSteps
from tests.fake_backend import FakeBackend
from tests.helpers import OLD_LIGHTNING, cpu_trainer
from tests.models import TINY, TINY_DATA, decoder

MAX_STEPS, LOG_EVERY, WARMUP = 6, 2, 2

#: Metrics logged at every interval once graphs are on (counters and the stage).
EVERY_ROW = (
    "cudagraph/stage",
    "cudagraph/graphs",
    "cudagraph/replays",
    "cudagraph/fallbacks",
    "cudagraph/rollbacks",
    "cudagraph/pool_mib",
    "cudagraph/captures",
    "cudagraph/evictions",
)
#: Metrics logged from the interval in which they are first measured (after warmup, capture, confirmation).
MEASURED = (
    "cudagraph/step_ms",
    "cudagraph/eager_step_ms",
    "cudagraph/speedup",
    "cudagraph/parity_err",
    "cudagraph/capture_ms",
)
KEYS = EVERY_ROW + MEASURED

#: The metrics read back from a logger: key -> [(step, value)].
History = dict[str, list[tuple[int, float]]]


def graphed(**options: Any) -> CUDAGraphCallback:
    """A callback whose captures go to the fake backend: graphs on, on a CPU."""
    callback = CUDAGraphCallback(**{"scope": ["layer"], "warmup_steps": WARMUP, **options})
    callback.capture_backend = FakeBackend()
    return callback


def fit_with(
    tmp_path: Path,
    logger: Logger | list[Logger] | bool,
    callback: CUDAGraphCallback | None = None,
    callbacks: list[pl.Callback] | None = None,
    **kwargs: Any,
) -> tuple[pl.Trainer, CUDAGraphCallback]:
    model, data = decoder(TINY, **TINY_DATA)
    callback = callback or graphed()
    options = {"log_every_n_steps": LOG_EVERY, "logger": logger, "max_steps": MAX_STEPS, **kwargs}
    trainer = cpu_trainer(tmp_path, options.pop("max_steps"), [callback, *(callbacks or [])], **options)
    trainer.fit(model, datamodule=data)
    return trainer, callback


def graph_keys(keys: Any) -> list[str]:
    return sorted(key for key in keys if key.startswith("cudagraph/"))


# =================================================================== loggers and how to read them back
def csv_logger(tmp_path: Path) -> CSVLogger:
    return CSVLogger(tmp_path, name="csv")


def csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def read_csv(logger: CSVLogger) -> History:
    history: History = {}
    for row in csv_rows(logger):
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


# =================================================================== graphs on: Lightning's rows and metrics
@pytest.mark.parametrize("kind", list(LOGGERS))
def test_graph_metrics_reach_the_logger_at_lightnings_steps(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    make_logger, read_back = LOGGERS[kind]
    logger = make_logger(tmp_path)
    _, callback = fit_with(tmp_path, logger)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason

    history = read_back(logger)
    missing = [key for key in KEYS if key not in history]
    assert not missing, f"{kind}: missing {missing}; logged {sorted(history)}"
    loss_steps = [step for step, _ in history["train_loss"]]
    assert len(loss_steps) == MAX_STEPS // LOG_EVERY
    for key in KEYS:
        steps = [step for step, _ in history[key]]
        want = loss_steps if key in EVERY_ROW else loss_steps[-len(steps) :]
        assert steps == want, f"{key} logged at steps {steps}, Lightning's train_loss at {loss_steps}"
    for key, values in history.items():  # a metric not measured yet is left out, never logged as nan
        assert all(math.isfinite(value) for _, value in values), key

    stages = [value for _, value in history["cudagraph/stage"]]
    assert stages[-1] == float(Stage.REPLAYING) and stages == sorted(stages)
    replays = [value for _, value in history["cudagraph/replays"]]
    assert replays[-1] == callback.report.replays > 0 and replays == sorted(replays)


def test_graph_metrics_share_the_rows_of_the_users_metrics(tmp_path):
    logger = csv_logger(tmp_path)
    fit_with(tmp_path, logger)
    graph_rows = [row for row in csv_rows(logger) if row["cudagraph/stage"]]
    assert len(graph_rows) == MAX_STEPS // LOG_EVERY
    assert all(row["train_loss"] for row in graph_rows), "a row of cudagraph/* metrics without the user's train_loss"


def test_graph_metrics_are_in_logged_and_callback_metrics(tmp_path):
    trainer, callback = fit_with(tmp_path, csv_logger(tmp_path))
    report = callback.report.metrics()
    for metrics in (trainer.logged_metrics, trainer.callback_metrics):
        assert set(KEYS) <= set(graph_keys(metrics)) <= set(report)
        assert float(metrics["cudagraph/stage"]) == float(Stage.REPLAYING)
        assert float(metrics["cudagraph/replays"]) == report["cudagraph/replays"]
        assert all(metrics[key].device.type == "cpu" for key in graph_keys(metrics)), "no copy to the device"
    assert "cudagraph/stage" not in trainer.progress_bar_metrics, "the bar shows the stage by name, not a number"


class MonitorReplays(pl.Callback):
    """A user's callback that reads a graph metric from ``callback_metrics``, as EarlyStopping would."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "cudagraph/replays" in trainer.callback_metrics:
            self.seen.append(float(trainer.callback_metrics["cudagraph/replays"]))


def test_a_callback_can_monitor_a_graph_metric(tmp_path):
    monitor = MonitorReplays()
    fit_with(tmp_path, False, callbacks=[monitor])  # no logger: callback_metrics still get them
    assert monitor.seen and monitor.seen[-1] > 0


def test_values_reach_a_logger_as_plain_floats(tmp_path):
    logger = RecordingLogger()
    fit_with(tmp_path, logger)
    graph_rows = [row for _, row in logger.rows if graph_keys(row)]
    assert len(graph_rows) == MAX_STEPS // LOG_EVERY
    assert all(type(row[key]) is float for row in graph_rows for key in graph_keys(row))


def test_a_last_interval_lightning_does_not_write_is_logged_at_the_end(tmp_path):
    # 7 steps, logging every 2: Lightning writes steps 1, 3 and 5; the package adds its final figures at step 6.
    logger = csv_logger(tmp_path)
    _, callback = fit_with(tmp_path, logger, max_steps=7)
    history = read_csv(logger)
    assert [step for step, _ in history["train_loss"]] == [1, 3, 5]
    assert [step for step, _ in history["cudagraph/replays"]] == [1, 3, 5, 6]
    assert history["cudagraph/replays"][-1][1] == callback.report.replays


def test_every_logger_of_the_trainer_gets_the_metrics(tmp_path):
    csv_log, tb_log = csv_logger(tmp_path), tensorboard_logger(tmp_path)
    fit_with(tmp_path, [csv_log, tb_log])
    assert read_csv(csv_log)["cudagraph/stage"] == read_tensorboard(tb_log)["cudagraph/stage"]


def test_a_rollback_is_logged(tmp_path):
    # Graphs were on, then a wrong replay rolled them back: stage -1 and the rollback are logged from then on.
    callback = graphed()
    callback.capture_backend = FakeBackend(distort={f"model.blocks.{i}": 22.0 for i in range(TINY["n_layer"])})
    logger = csv_logger(tmp_path)
    with pytest.warns(UserWarning, match="rolled back to eager training: parity"):
        _, callback = fit_with(tmp_path, logger, callback=callback)
    assert callback.report.rollbacks == 1
    history = read_csv(logger)
    assert history["cudagraph/stage"][-1][1] == float(Stage.DISABLED)
    assert history["cudagraph/rollbacks"][-1][1] == 1.0


def test_log_every_n_steps_zero_logs_no_graph_metric(tmp_path):
    logger = csv_logger(tmp_path)
    trainer, callback = fit_with(tmp_path, logger, log_every_n_steps=0)
    assert callback.report.stage == Stage.REPLAYING
    assert not graph_keys(trainer.logged_metrics)
    written = read_csv(logger) if (Path(logger.log_dir) / "metrics.csv").exists() else {}
    assert not graph_keys(written)


def test_with_logging_off_the_device_is_read_once_per_interval_not_every_step(tmp_path, monkeypatch):
    # log_every_n_steps=0 turns logging off. The health check and the step times still read the device (a host sync
    # each), on the interval Lightning logs at by default: never on every replayed step.
    checks, reads = [], []
    check, read = ScopedDriver.health_check, FitSteps.read_interval
    monkeypatch.setattr(ScopedDriver, "health_check", lambda self, step: (checks.append(step), check(self, step)))
    monkeypatch.setattr(FitSteps, "read_interval", lambda self, eager: (reads.append(eager), read(self, eager)))
    steps = 2 * READ_EVERY_WITHOUT_LOGGING + 3
    _, callback = fit_with(tmp_path, False, log_every_n_steps=0, max_steps=steps)
    assert callback.report.stage == Stage.REPLAYING and callback.report.replays > steps
    assert checks == [READ_EVERY_WITHOUT_LOGGING, 2 * READ_EVERY_WITHOUT_LOGGING]
    assert len(reads) == len(checks) + 1  # and the last, partial interval at the fit's end


# =================================================================== graphs off from the start: nothing of the package
OFF = {
    "no_cuda": lambda: CUDAGraphCallback(scope=["layer"]),  # no capture backend on a CPU
    "impl_none": lambda: CUDAGraphCallback(impl="none"),
}


@pytest.mark.parametrize("reason", list(OFF))
@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_graphs_off_from_the_start_log_no_graph_column(tmp_path, reason, kind):
    make_logger, read_back = LOGGERS[kind]
    logger = make_logger(tmp_path)
    trainer, callback = fit_with(tmp_path, logger, callback=OFF[reason]())
    assert (callback.report.stage, callback.report.reason) == (Stage.DISABLED, reason)

    history = read_back(logger)
    assert len(history["train_loss"]) == MAX_STEPS // LOG_EVERY, "the user's metrics are logged as without graphs"
    assert not graph_keys(history), f"columns of nothing: {graph_keys(history)}"
    assert not graph_keys(trainer.logged_metrics)
    assert not graph_keys(trainer.callback_metrics)
    if kind == "csv":
        assert not graph_keys(csv_rows(logger)[0])


# =================================================================== the progress bar
class BarReader(pl.Callback):
    """What the progress bar would show after each training batch (placed after the graph callback)."""

    def __init__(self) -> None:
        self.shown: list[str | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shown.append(trainer.progress_bar_callback.get_metrics(trainer, pl_module).get("graphs"))


def test_the_bar_shows_the_stage_by_name(tmp_path):
    reader = BarReader()
    trainer, _ = fit_with(
        tmp_path, False, callbacks=[TQDMProgressBar(), reader], enable_progress_bar=True, log_every_n_steps=1
    )
    # Warmup steps 1 and 2, the capture at step 3 (confirmation), then replays; the speedup once measured.
    assert reader.shown[0] == "warmup"
    assert any(shown.startswith("confirming") for shown in reader.shown)
    assert reader.shown[-1].startswith("replaying")
    bar = trainer.progress_bar_callback
    assert "graphs=replaying" in bar.train_progress_bar.postfix, "what the user sees in the TQDM bar"
    assert "get_metrics" not in vars(bar), "the bar has its own get_metrics back after the fit"
    assert not graph_keys(trainer.progress_bar_metrics)


def test_the_bar_shows_the_speedup_once_measured(tmp_path):
    reader = BarReader()
    callback = graphed()
    callback.capture_backend = FakeBackend(step_ms=lambda backend: 1.0 if backend.live_graphs else 2.0)
    fit_with(tmp_path, False, callback=callback, callbacks=[reader], enable_progress_bar=True, log_every_n_steps=1)
    assert reader.shown[-1] == "replaying 2.00x"


@pytest.mark.parametrize("reason", list(OFF))
def test_the_bar_shows_nothing_when_graphs_are_off(tmp_path, reason):
    reader = BarReader()
    trainer, _ = fit_with(tmp_path, False, callback=OFF[reason](), callbacks=[reader], enable_progress_bar=True)
    assert reader.shown == [None] * MAX_STEPS
    assert not graph_keys(trainer.progress_bar_metrics)


@pytest.mark.skipif(
    OLD_LIGHTNING, reason="rich raises IndexError (pop from empty list) under lightning 2.4 (seen at the floors)"
)
def test_the_rich_bar_shows_the_stage_by_name(tmp_path):
    pytest.importorskip("rich")
    reader = BarReader()
    fit_with(tmp_path, False, callbacks=[RichProgressBar(), reader], enable_progress_bar=True, log_every_n_steps=1)
    assert reader.shown[-1].startswith("replaying")


def test_bar_items_wrap_the_bars_own_get_metrics_and_give_it_back():
    bar = TQDMProgressBar()
    own = lambda trainer, module: {"mine": 1}  # noqa: E731  (a user's instance-level override)
    bar.get_metrics = own
    first, second = ProgressBarItems(lambda: {"graphs": "warmup"}), ProgressBarItems(lambda: {"graphs": "replaying"})
    first.show_on(bar)
    second.show_on(bar)  # a later fit, after one that ended on an exception: no double wrap
    assert bar.get_metrics(None, None) == {"mine": 1, "graphs": "replaying"}
    second.remove()
    first.remove()
    assert bar.get_metrics is own


# =================================================================== helpers
class RecordingLogger(Logger):
    """A logger that keeps every call."""

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


def test_logging_adds_no_tensor_on_the_device():
    # The values become CPU tensors whatever the module's device: logging them copies nothing to a GPU.
    from lightning_cudagraph._rollout.reporting import log_through_lightning

    logged: dict[str, Any] = {}

    class Module(pl.LightningModule):
        def log_dict(self, dictionary, **kwargs):
            logged.update(dictionary=dictionary, **kwargs)

    module = Module()
    module._trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    log_through_lightning(module, {"cudagraph/stage": 2.0})
    assert {key: value.device.type for key, value in logged["dictionary"].items()} == {"cudagraph/stage": "cpu"}
    assert logged["dictionary"]["cudagraph/stage"].dtype == torch.float64
    assert (logged["on_step"], logged["on_epoch"], logged["logger"]) == (True, False, False)

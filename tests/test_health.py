"""The report a user reads and the loggers receive, and host-timed steps without CUDA."""

import io
import math

import pytest
import torch

from lightning_cudagraph import CUDAGraphReport, Stage
from lightning_cudagraph._backend.timing import StepTimer, median
from lightning_cudagraph.health import LEVEL_NUMBERS, LevelRecord

DESIGN_METRICS = {
    "cudagraph/stage",
    "cudagraph/graphs",
    "cudagraph/replays",
    "cudagraph/fallbacks",
    "cudagraph/capture_ms",
    "cudagraph/pool_mib",
    "cudagraph/step_ms",
    "cudagraph/eager_step_ms",
    "cudagraph/speedup",
    "cudagraph/parity_err",
    "cudagraph/rollbacks",
}
#: Added for batches whose shape changes (the design's keys stay as they are).
SHAPE_METRICS = {"cudagraph/captures", "cudagraph/evictions", "cudagraph/hit_rate", "cudagraph/capture_ms_total"}


def replaying_report() -> CUDAGraphReport:
    return CUDAGraphReport(
        stage=Stage.REPLAYING,
        graphs=4,
        replays=120,
        fallbacks=1,
        rollbacks=0,
        captures=1,
        capture_ms=35.0,
        pool_mib=64.0,
        step_ms=10.0,
        eager_step_ms=15.0,
        parity_err=1e-6,
        steps_replayed=30,
        steps_eager=2,
    )


def test_stage_values_match_the_logged_contract():
    assert [int(stage) for stage in (Stage.DISABLED, Stage.WARMUP, Stage.CONFIRMING, Stage.REPLAYING)] == [-1, 0, 1, 2]


def test_metrics_of_a_replaying_report_are_exactly_the_design_keys_as_floats():
    metrics = replaying_report().metrics()
    assert set(metrics) == DESIGN_METRICS | SHAPE_METRICS
    assert all(type(value) is float for value in metrics.values())
    assert metrics["cudagraph/stage"] == 2.0
    assert metrics["cudagraph/replays"] == 120.0
    assert metrics["cudagraph/speedup"] == pytest.approx(1.5)


def test_the_level_is_logged_under_auto_only_as_its_fixed_rung_number():
    report = replaying_report()
    assert "cudagraph/level" not in report.metrics()  # a fixed scope has no ladder
    report.ladder = [LevelRecord("attn", status="slower", step_ms=9.0), LevelRecord("layer", status="kept")]
    report.level = "layer"
    assert report.metrics()["cudagraph/level"] == float(LEVEL_NUMBERS["layer"])
    report.level = None  # rolled back: no level runs on graphs
    assert report.metrics()["cudagraph/level"] == 0.0


def test_metrics_before_anything_is_measured_leave_out_nan_values():
    metrics = CUDAGraphReport().metrics()
    assert set(metrics) <= DESIGN_METRICS | SHAPE_METRICS
    assert set(metrics) == {
        "cudagraph/stage",
        "cudagraph/graphs",
        "cudagraph/replays",
        "cudagraph/fallbacks",
        "cudagraph/rollbacks",
        "cudagraph/pool_mib",
        "cudagraph/captures",
        "cudagraph/evictions",
    }
    assert metrics["cudagraph/stage"] == 0.0
    assert not any(math.isnan(value) for value in metrics.values())


@pytest.mark.parametrize(
    ("stage", "step_ms", "eager_step_ms", "expected"),
    [
        pytest.param(Stage.WARMUP, 10.0, 15.0, math.nan, id="warmup"),
        pytest.param(Stage.DISABLED, 10.0, 15.0, math.nan, id="disabled"),
        pytest.param(Stage.CONFIRMING, math.nan, 15.0, math.nan, id="confirming-unmeasured"),
        pytest.param(Stage.CONFIRMING, 10.0, 15.0, 1.5, id="confirming"),
        pytest.param(Stage.REPLAYING, 20.0, 15.0, 0.75, id="replaying-slower"),
    ],
)
def test_speedup_is_eager_over_graphed_step_time_once_confirming(stage, step_ms, eager_step_ms, expected):
    report = CUDAGraphReport(stage=stage, step_ms=step_ms, eager_step_ms=eager_step_ms)
    if math.isnan(expected):
        assert math.isnan(report.speedup)
        assert "cudagraph/speedup" not in report.metrics()
    else:
        assert report.speedup == pytest.approx(expected)
        assert report.metrics()["cudagraph/speedup"] == pytest.approx(expected)


def test_count_fallback_keeps_reasons():
    report = CUDAGraphReport()
    report.count_fallback("shape_change")
    report.count_fallback("shape_change", 2)
    report.count_fallback("kwargs")
    assert report.fallbacks == 4
    assert report.fallback_reasons == {"shape_change": 3, "kwargs": 1}


def test_state_dict_round_trips_through_a_checkpoint():
    report = replaying_report()
    report.count_fallback("shape_change", 2)
    report.rollbacks = 1
    report.rollback_reasons.append("parity: 0.5 > 1e-4")
    state = report.state_dict()

    buffer = io.BytesIO()
    torch.save({"callbacks": {"CUDAGraphCallback": state}}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["callbacks"]["CUDAGraphCallback"]

    restored = CUDAGraphReport()
    restored.load_state_dict(loaded)
    assert restored.state_dict() == state
    assert restored.fallbacks == 3
    assert restored.fallback_reasons["shape_change"] == 2
    assert restored.rollback_reasons == ["parity: 0.5 > 1e-4"]
    assert restored.replays == 120
    assert restored.captures == 1


def test_load_state_dict_of_an_empty_state_resets_counters():
    report = replaying_report()
    report.load_state_dict({})
    assert (report.replays, report.fallbacks, report.rollbacks, report.captures) == (0, 0, 0, 0)


def test_step_timer_on_host_returns_one_duration_per_step_and_empties_on_read():
    timer = StepTimer(use_cuda=False)
    assert timer.read() == []
    for _ in range(3):
        timer.start()
        timer.stop()
    times = timer.read()
    assert len(times) == 3
    assert all(isinstance(t, float) and t >= 0 for t in times)
    assert timer.read() == []


def test_step_timer_ignores_a_stop_without_start_and_keeps_the_last_start():
    timer = StepTimer(use_cuda=False)
    timer.stop()
    timer.start()
    timer.start()
    timer.stop()
    timer.stop()
    assert len(timer.read()) == 1


def test_step_timer_keeps_at_most_its_capacity():
    timer = StepTimer(use_cuda=False, capacity=4)
    for _ in range(10):
        timer.start()
        timer.stop()
    assert len(timer.read()) == 4


def test_median_of_nothing_is_nan():
    assert math.isnan(median([]))
    assert median([3.0, 1.0, 2.0]) == 2.0

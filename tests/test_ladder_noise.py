"""``scope="auto"`` on a noisy host: decisions that survive slow steps, an eager reference from steady steps, and a
settled level checked once more against eager training.

The fake backend's timer reports each step's time from the level it ran at (:func:`~tests.helpers.level_of`), with
noise the test adds: an outlier, a slow first window, slow eager warmup steps, a level that slows down later.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_cudagraph import CUDAGraphCallback, Stage
from lightning_cudagraph._rollout.ladder import CHECK_STEPS, MAX_MEASURE_STEPS, MEASURE_STEPS, REFERENCE_STEPS
from tests.fake_backend import FakeBackend
from tests.helpers import LEVEL_MS, fit, level_of
from tests.models import TINY, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: Warmup, the reference, three levels timed as long as a far or close call takes, the check, and some to spare.
STEPS = WARMUP + REFERENCE_STEPS + 3 * (2 + MEASURE_STEPS + MAX_MEASURE_STEPS) + CHECK_STEPS + 6


class NoisyClock:
    """A fake step time per step: the level's time, or what ``noise(level, steps on it so far)`` says instead."""

    def __init__(self, table: dict[str, float], noise: Callable[[str, int], float | None]) -> None:
        self.table, self.noise = {**LEVEL_MS, **table}, noise
        self.seen: dict[str, int] = {}
        self.callback: CUDAGraphCallback | None = None

    def __call__(self, backend: FakeBackend) -> float:
        level = level_of(backend)
        if level == "eager" and self.callback is not None and self._warming_up():
            level = "warmup"
        count = self.seen.get(level, 0)
        self.seen[level] = count + 1
        noisy = self.noise(level, count)
        return self.table.get(level, self.table["eager"]) if noisy is None else noisy

    def _warming_up(self) -> bool:
        """An eager step that records the targets' calls (warmup), not one of the reference steps."""
        assert self.callback is not None
        return self.callback.report.stage == Stage.WARMUP and not self.callback.rollout.driver.in_reference_step


def auto_fit(clock: NoisyClock):
    backend = FakeBackend(step_ms=clock)
    callback = CUDAGraphCallback(warmup_steps=WARMUP)
    callback.capture_backend = backend
    clock.callback = callback
    run = fit(*decoder(TINY), STEPS, callbacks=[callback], **CPU)
    return callback.report, run


def rows(report) -> dict[str, str]:
    return {row.level: row.status for row in report.ladder}


def test_one_slow_step_in_a_levels_window_does_not_decide_against_it():
    clock = NoisyClock({}, noise=lambda level, count: 40.0 if level == "model" and count == 3 else None)
    report, _ = auto_fit(clock)
    assert report.level == "model", report.ladder
    assert rows(report)["model"] == "kept"
    assert report.stage == Stage.REPLAYING


def test_a_level_whose_first_window_was_slow_is_timed_again_and_kept_on_its_steady_time():
    # ConvNeXt-atto on the H200: one fit timed ``layer`` at 35 ms over its first steps, another at 11 ms.
    clock = NoisyClock({}, noise=lambda level, count: 35.0 if level == "model" and count < 2 + MEASURE_STEPS else None)
    report, _ = auto_fit(clock)
    assert report.level == "model", report.ladder
    model = next(row for row in report.ladder if row.level == "model")
    assert model.step_ms == LEVEL_MS["model"], "the faster of the two windows counts"


def test_slow_warmup_steps_do_not_make_a_level_slower_than_eager_look_faster():
    # Warmup steps record every call and run slow; steady eager training runs at 10 ms; every level is slower.
    table = {"warmup": 25.0, "eager": 10.0, "attn": 12.0, "attn+mlp": 11.0, "layer": 10.5, "model": 10.2}
    report, run = auto_fit(NoisyClock(table, noise=lambda level, count: None))
    assert report.eager_step_ms == 10.0, "the reference comes from the steady eager steps, not the warmup ones"
    assert report.stage == Stage.DISABLED and report.level is None
    assert "not_faster" in (report.reason or "")
    assert run.trainer.global_step == STEPS, "training goes on eagerly"


def test_a_settled_level_that_loses_to_eager_in_the_steady_state_goes_back_to_eager_training():
    # ``model`` wins its window, then runs slower than eager: the steady-state check catches it.
    slow_later = MEASURE_STEPS + 4

    def noise(level: str, count: int) -> float | None:
        return 14.0 if level == "model" and count >= slow_later else None

    report, run = auto_fit(NoisyClock({}, noise))
    assert rows(report)["model"] == "slower"
    assert "steady state" in next(row.reason for row in report.ladder if row.level == "model")
    assert report.stage == Stage.DISABLED and "not_faster" in (report.reason or "")
    assert run.trainer.global_step == STEPS


def test_a_steady_ladder_settles_on_the_fastest_level_and_stays_there():
    report, _ = auto_fit(NoisyClock({}, noise=lambda level, count: None))
    assert report.level == "model" and report.stage == Stage.REPLAYING
    assert report.eager_step_ms == LEVEL_MS["eager"]

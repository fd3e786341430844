"""The replay watchdog: it fires on a replay that never finishes, and only then.

Two processes (``tests/test_fsdp2.py``) show it ending both ranks of a fit when one stops replaying; here a
two-process fit shows a ``replay_timeout_s`` below one replayed step raised to the floor instead of ending the fit.
The other rules are checked in one process, with markers the test controls: the bound and its floor, the warning,
the message, the timing of pending replays, the grace period, the exit, and the training thread's error when the
aborted collective returns.
"""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lightning_cudagraph import DDPCUDAGraphStrategy, GraphFailure, ModelParallelCUDAGraphStrategy, Stage
from lightning_cudagraph._backend import watchdog as watchdog_module
from lightning_cudagraph._backend.watchdog import (
    EXIT_CODE,
    MIN_BOUND_S,
    MIN_FLOOR_S,
    STEPS_IN_BOUND,
    STEPS_IN_FLOOR,
    ReplayWatchdog,
    replay_bound_s,
    replay_floor_s,
)
from lightning_cudagraph._graphs.step_replay import StepReplays
from lightning_cudagraph.health import CUDAGraphReport
from tests.dist_worker import CASES, SLOW_REPLAY_S, TINY_BOUND_S
from tests.test_rank_agreement import TIMEOUT_S, launch_once

BOUND_S = 0.3
#: The floor's minimum in the one-process tests, below their bounds (the floor tests set their own).
TEST_MIN_FLOOR_S = 0.05


@pytest.fixture(autouse=True)
def _short_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds of a fraction of a second, so that each test fires within it (the real floor is at least 1 s)."""
    monkeypatch.setattr(watchdog_module, "MIN_FLOOR_S", TEST_MIN_FLOOR_S)


class Marker:
    """A marker the test finishes by hand (a CUDA event on a device that is stuck until ``done``)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Ended:
    """Stands in for ``os._exit``: records the status and when it came."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def watchdog(
    markers: list[Marker],
    ended: Ended,
    grace_s: float = 0.2,
    timeout_s: float | None = BOUND_S,
    times: CUDAGraphReport | None = None,
) -> ReplayWatchdog:
    times = CUDAGraphReport() if times is None else times  # nothing measured: nan step times
    return ReplayWatchdog(timeout_s, times, rank=3, marker=markers.pop, grace_s=grace_s, end=ended)


def test_a_replay_that_never_finishes_names_the_rank_and_step_and_ends_the_process() -> None:
    ended = Ended()
    dog = watchdog([Marker(done=False)], ended)
    dog.started(step=41)
    dog.finished()

    assert ended.called.wait(timeout=10), "the process was not ended"
    assert ended.codes == [EXIT_CODE]
    assert dog.fired is not None
    assert "rank 3" in dog.fired and "replayed step 41" in dog.fired and "(bound 300 ms)" in dog.fired
    dog.close()


def test_replays_that_finish_never_fire_however_long_the_fit() -> None:
    ended = Ended()
    markers = [Marker(done=True) for _ in range(5)]
    dog = watchdog(markers, ended)
    for step in range(5):
        dog.started(step)
        dog.finished()
        time.sleep(BOUND_S / 2)
    time.sleep(3 * BOUND_S)  # long past the bound since the first replay: each one finished

    assert dog.fired is None and not ended.called.is_set()
    dog.close()


def test_a_replay_still_launching_past_the_bound_fires_too() -> None:
    # On the CPU (gloo) a rank blocks inside the replay call itself: no marker was recorded yet.
    ended = Ended()
    dog = watchdog([], ended)
    dog.started(step=7)

    assert ended.called.wait(timeout=10)
    assert dog.fired is not None and "replayed step 7" in dog.fired
    dog.close()


def test_training_that_raises_within_the_grace_period_keeps_the_process_and_gets_the_reason() -> None:
    ended = Ended()
    dog = watchdog([], ended, grace_s=5.0)
    replays = StepReplays(SimpleNamespace(report=CUDAGraphReport()), None, None, None)  # type: ignore[arg-type]
    replays.watchdog = dog

    class AbortedCollective:
        def replay(self) -> None:  # blocks until the watchdog fires, then fails as an aborted NCCL collective does
            deadline = time.monotonic() + 10
            while dog.fired is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("NCCL communicator was aborted")

    with pytest.raises(GraphFailure, match="replay watchdog: rank 3") as failure:
        replays._watched_replay(AbortedCollective(), step=12)
    assert isinstance(failure.value.__cause__, RuntimeError)
    dog.close()  # what releasing the graphs does on the way out of the fit
    time.sleep(0.3)
    assert not ended.called.is_set(), "training raised on its own: the process is not ended"


@pytest.mark.parametrize("strategy", [DDPCUDAGraphStrategy, ModelParallelCUDAGraphStrategy])
@pytest.mark.parametrize("value", [0, -5.0, "600", True])
def test_a_replay_timeout_that_is_not_a_positive_number_of_seconds_is_refused(strategy: type, value: object) -> None:
    with pytest.raises(ValueError, match=r"replay_timeout_s=.*Allowed: a number of seconds above 0, or None"):
        strategy(replay_timeout_s=value)


def test_the_default_bound_is_generous_and_replay_timeout_s_overrides_it() -> None:
    assert replay_bound_s(5.0) == MIN_BOUND_S, "a fast step is still given minutes"
    assert replay_bound_s(4000.0) == STEPS_IN_BOUND * 4.0, "a slow step is given its hundred steps"
    assert replay_bound_s(float("nan")) == MIN_BOUND_S, "before any eager step was timed"
    assert replay_bound_s(5.0, timeout_s=7.5) == 7.5


def test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watchdog_module, "MIN_FLOOR_S", MIN_FLOOR_S)
    times = CUDAGraphReport(eager_step_ms=200.0)
    dog = watchdog([Marker(done=True) for _ in range(3)], Ended(), timeout_s=0.01, times=times)

    raised = r"rank 3: replay_timeout_s=10 ms is below the floor of 10 measured steps.* raised to 2 s"
    with pytest.warns(UserWarning, match=raised):
        dog.started(step=5)
    assert dog.bound_s == STEPS_IN_FLOOR * 0.2, "ten eager steps of 200 ms"
    time.sleep(0.3)  # this replay call's host time: a step of at least 300 ms
    dog.finished()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one warning came already: the floor follows the steps silently
        dog.started(step=6)
        assert dog.bound_s >= STEPS_IN_FLOOR * 0.3, "ten replay calls of 300 ms"
        dog.finished()
        times.step_ms = 500.0  # the replayed steps of a log interval
        dog.started(step=7)
        assert dog.bound_s == STEPS_IN_FLOOR * 0.5, "ten replayed steps of 500 ms"
        dog.finished()
    assert dog.fired is None
    dog.close()


def test_the_floor_is_ten_measured_steps_and_at_least_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog_module, "MIN_FLOOR_S", MIN_FLOOR_S)
    assert MIN_FLOOR_S == 1.0 and STEPS_IN_FLOOR == 10
    assert replay_floor_s(5.0) == MIN_FLOOR_S, "a fast step is still given a second"
    assert replay_floor_s(400.0) == 4.0
    assert replay_floor_s(math.nan) == MIN_FLOOR_S, "before any step was measured"


def test_a_replay_timeout_above_the_floor_is_kept_without_a_warning() -> None:
    dog = watchdog([Marker(done=True)], Ended(), timeout_s=2.0, times=CUDAGraphReport(eager_step_ms=20.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dog.started(step=1)
    assert dog.bound_s == 2.0
    dog.finished()
    dog.close()


@pytest.mark.parametrize(
    ("timeout_s", "eager_step_ms", "min_bound_s", "bound", "which"),
    [
        (BOUND_S, math.nan, MIN_BOUND_S, "300 ms", "replay_timeout_s=300 ms"),
        (None, math.nan, BOUND_S, "300 ms", "the default (100 eager steps, at least 300 ms)"),
        (
            0.01,
            30.0,
            MIN_BOUND_S,
            "300 ms",
            "the floor of 10 measured steps, at least 50 ms (the longest step measured took 30 ms),"
            " above replay_timeout_s=10 ms",
        ),
    ],
    ids=["replay_timeout_s", "default", "floor"],
)
def test_the_message_names_the_bound_that_fired_and_gives_sub_second_values_in_ms(
    monkeypatch: pytest.MonkeyPatch,
    timeout_s: float | None,
    eager_step_ms: float,
    min_bound_s: float,
    bound: str,
    which: str,
) -> None:
    monkeypatch.setattr(watchdog_module, "MIN_BOUND_S", min_bound_s)
    ended = Ended()
    times = CUDAGraphReport(eager_step_ms=eager_step_ms)
    dog = watchdog([Marker(done=False)], ended, timeout_s=timeout_s, times=times)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the floor's warning (its own test)
        dog.started(step=9)
    dog.finished()

    assert ended.called.wait(timeout=10)
    assert dog.fired is not None
    assert f"for replayed step 9 to finish (bound {bound}). The bound is {which};" in dog.fired
    assert " 0 s" not in dog.fired, "a bound below a second is printed in ms"
    if math.isfinite(eager_step_ms):  # a rank is blamed only past ten measured steps
        assert dog.bound_s >= STEPS_IN_FLOOR * eager_step_ms / 1000
    dog.close()


def test_two_pending_replays_are_each_timed_from_their_turn_on_the_device() -> None:
    # Replay 2 waits on the device behind replay 1: each takes 0.7 of the bound, so neither is late, though replay 2
    # finishes 1.4 bounds after its launch.
    bound_s = 2.0
    ended = Ended()
    first, second = Marker(), Marker()
    dog = watchdog([second, first], ended, timeout_s=bound_s)
    dog.started(step=1)
    dog.finished()
    dog.started(step=2)
    dog.finished()
    time.sleep(0.7 * bound_s)
    first.done = True
    time.sleep(0.7 * bound_s)

    assert dog.fired is None, f"replay 2 was timed from its launch: {dog.fired}"
    second.done = True
    time.sleep(0.3)
    assert dog.fired is None and not ended.called.is_set()
    dog.close()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs the gloo backend")
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_replay_timeout_below_one_replayed_step_leaves_a_healthy_two_rank_fit_alone(tmp_path: Path) -> None:
    # Both ranks replay in SLOW_REPLAY_S, twenty times replay_timeout_s: a bound meant in minutes, given in seconds.
    assert SLOW_REPLAY_S > 10 * TINY_BOUND_S
    returncode, log = launch_once("ddp_tiny_bound", tmp_path)

    assert returncode == 0, log[-6000:]
    assert " waited " not in log, "the watchdog fired on a healthy fit"
    for rank in (0, 1):
        assert f"replay watchdog: rank {rank}: replay_timeout_s=10 ms is below the floor of 10 measured steps" in log
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["finished"] and report["global_step"] == CASES["ddp_tiny_bound"].max_steps
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0), report["reason"]
        assert report["steps_replayed"] >= 3

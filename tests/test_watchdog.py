"""The replay watchdog in one process: it fires on a replay that never finishes, and only then.

Two processes (``tests/test_fsdp2.py``) show it ending both ranks of a fit when one stops replaying; here its own
rules are checked with markers the test controls: the bound, the message, the grace period, the exit, and the
training thread's error when the aborted collective returns.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from lightning_cudagraph import DDPCUDAGraphStrategy, GraphFailure, ModelParallelCUDAGraphStrategy
from lightning_cudagraph._backend.watchdog import EXIT_CODE, MIN_BOUND_S, STEPS_IN_BOUND, ReplayWatchdog, replay_bound_s
from lightning_cudagraph._graphs.step_replay import StepReplays
from lightning_cudagraph.health import CUDAGraphReport

BOUND_S = 0.3


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


def watchdog(markers: list[Marker], ended: Ended, grace_s: float = 0.2) -> ReplayWatchdog:
    return ReplayWatchdog(lambda: BOUND_S, rank=3, marker=markers.pop, grace_s=grace_s, end=ended)


def test_a_replay_that_never_finishes_names_the_rank_and_step_and_ends_the_process() -> None:
    ended = Ended()
    dog = watchdog([Marker(done=False)], ended)
    dog.started(step=41)
    dog.finished()

    assert ended.called.wait(timeout=10), "the process was not ended"
    assert ended.codes == [EXIT_CODE]
    assert dog.fired is not None
    assert "rank 3" in dog.fired and "replayed step 41" in dog.fired and f"bound {BOUND_S:.0f} s" in dog.fired
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

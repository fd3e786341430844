"""FSDP2 (``fully_shard`` under Lightning's ``ModelParallelStrategy``) and the replay watchdog, on two gloo processes.

The whole step of :class:`~lightning_cudagraph.ModelParallelCUDAGraphStrategy` holds FSDP2's all-gathers and
reduce-scatters; through the fake backend it is captured and replayed on both ranks, and trains as eager FSDP2 does.
A capture that fails on one rank is dropped on both. A rank that stops replaying leaves the other waiting inside the
graph's collectives: the replay watchdog names the rank and the step on each and ends both processes, long before
the collectives' own timeout (60 s in the worker).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_cudagraph import Stage
from lightning_cudagraph._backend.watchdog import EXIT_CODE
from tests.dist_worker import CASES, COLLECTIVE_TIMEOUT, WARMUP, WATCHDOG_S
from tests.helpers import needs_fsdp2
from tests.test_rank_agreement import TIMEOUT_S, Ranks, launch_once

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch"),
    pytest.mark.skipif(dist.is_available() and not dist.is_gloo_available(), reason="needs the gloo backend"),
    pytest.mark.timeout(2 * TIMEOUT_S + 60),
]


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@needs_fsdp2
def test_the_fsdp2_whole_step_replays_on_both_ranks_and_trains_as_eager_fsdp2(ranks: Callable[[str], Ranks]) -> None:
    rank0, rank1 = ranks("fsdp2_full")
    steps = CASES["fsdp2_full"].max_steps

    for report in (rank0, rank1):
        assert report["finished"] and report["global_step"] == steps
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0), report["reason"]
        assert report["captures"] == 1
        assert report["steps_replayed"] == steps - WARMUP - 1, "every step after the warmup and the capture step"
        assert report["live_graphs"] == 0, "released at the end of the fit"
        worst = max(abs(a - b) for a, b in zip(report["losses"], report["eager_losses"], strict=True))
        assert worst < 1e-5, f"rank {report['rank']}: losses off eager FSDP2 by {worst:.3g}"
        assert _close(report["params"]["abs_sum"], report["eager_params"]["abs_sum"], 1e-6)
        assert report["optimizer_state"].keys() == report["eager_optimizer_state"].keys() != set()
        for key, value in report["optimizer_state"].items():
            assert _close(value, report["eager_optimizer_state"][key], 1e-6), key
    assert rank0["params"] == rank1["params"], "the gathered parameters are the same on both ranks"


@needs_fsdp2
def test_an_fsdp2_whole_step_capture_that_fails_on_one_rank_rolls_back_both(ranks: Callable[[str], Ranks]) -> None:
    rank0, rank1 = ranks("fsdp2_full_fails")

    for report in (rank0, rank1):
        assert report["finished"] and report["global_step"] == CASES["fsdp2_full_fails"].max_steps
        assert (report["stage"], report["rollbacks"], report["steps_replayed"]) == (Stage.DISABLED, 1, 0)
        assert report["live_graphs"] == 0
    assert "injected: whole-step capture failed on rank 1" in rank1["reason"]
    assert "the capture failed on another rank" in rank0["reason"]
    assert rank0["params"] == rank1["params"]


@pytest.mark.parametrize("case", [pytest.param("fsdp2_stall", marks=needs_fsdp2), "ddp_stall"])
def test_the_replay_watchdog_ends_both_ranks_when_one_stops_replaying(tmp_path: Path, case: str) -> None:
    started = time.monotonic()
    returncode, log = launch_once(case, tmp_path)
    took = time.monotonic() - started

    assert returncode not in (0, None), "the launch failed, and did not hang"
    assert "rank 1: replay 3 stalls" in log
    for rank in (0, 1):
        assert f"replay watchdog: rank {rank} waited" in log, f"rank {rank} named itself"
    step = _replayed_step(log)
    assert f"for replayed step {step} to finish (bound {WATCHDOG_S:.0f} s)" in log
    assert log.count(f"exitcode  : {EXIT_CODE}") == 2, "both processes ended by their watchdog"
    assert took < COLLECTIVE_TIMEOUT.total_seconds(), "the watchdog ended the fit, not gloo's own timeout"


def _replayed_step(log: str) -> Any:
    marker = "for replayed step "
    return log.split(marker, 1)[1].split(" ", 1)[0]


@needs_fsdp2
def test_an_exception_on_one_rank_releases_the_graphs_of_both_without_a_hang(tmp_path: Path) -> None:
    # Rank 1 raises in a user's callback while the whole step replays; rank 0 is then inside a replay's collectives.
    started = time.monotonic()
    returncode, log = launch_once("fsdp2_raises", tmp_path)

    assert returncode is not None, "the launch ended by itself"
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds()
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert (rank1["error"], rank1["live_graphs"]) == ("injected: user error on rank 1", 0)
    # Rank 0 learns it from its collective, which fails once rank 1 is gone (gloo: "Connection closed by peer"),
    # or, should rank 1 take longer to leave than the bound, from its watchdog, which ends the process.
    report = tmp_path / "rank0.json"
    if report.exists():
        rank0 = json.loads(report.read_text())
        assert rank0["live_graphs"] == 0 and rank0["error"], rank0
    else:
        assert "replay watchdog: rank 0 waited" in log and f"exitcode  : {EXIT_CODE}" in log

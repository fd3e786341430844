"""Under DDP every decision of the rollout is taken once for all ranks: two gloo processes on the CPU, a failure
injected on rank 1 only.

Each case launches ``tests/dist_worker.py`` under ``torch.distributed.run`` (two processes, about 20 s on a 2-core
machine, most of it two interpreters importing torch and Lightning), then compares the ranks' reports: the same
stage, the same regions left eager, the same level of ``scope="auto"``, and parameters that are bit for bit the
same on both ranks. A rank that decided alone would hang in DDP's next all-reduce or train on other numerics; a
hang fails the test at :data:`TIMEOUT_S` (collectives themselves give up after the worker's 60 s first).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_cudagraph import Stage

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch"),
    pytest.mark.skipif(dist.is_available() and not dist.is_gloo_available(), reason="needs the gloo backend"),
]

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = REPO_ROOT / "tests" / "dist_worker.py"
#: A launch that takes longer has hung: it is killed and the test fails with the launch log (it never blocks CI). The
#: ranks print their stacks and exit before this (``HANG_S`` in the worker); pytest's own timeout comes after it.
TIMEOUT_S = 200
#: What a rank prints when it ran past the worker's ``HANG_S`` (Python's ``faulthandler``), before its stacks.
HANG_MARK = "Timeout ("
# Two launches of a case fit in one test's time (see ``launch``).
pytestmark.append(pytest.mark.timeout(2 * TIMEOUT_S + 60))
#: Steps of the scoped cases and of the whole-step case (see ``tests/dist_worker.py``).
SCOPED_STEPS, FULL_STEPS = 8, 16
#: What a launch inherits from a pytest that itself runs under a launcher would make the worker join that job.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def torchrun_environment() -> dict[str, str]:
    """This process's environment for a ``torchrun`` of a worker: no launcher variables, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


Ranks = tuple[dict[str, Any], dict[str, Any]]


def launch(case: str, out: Path) -> Ranks:
    """Run ``case`` on two processes; the reports of rank 0 and rank 1. A failed rank fails the test.

    A launch that hangs is launched once more, with the first one's stacks as a warning: a rendezvous or a gloo
    teardown on a loaded machine can stall once (it did once in CI, outside any of the package's collectives). A
    case that hangs twice fails the test.
    """
    for attempt in (1, 2):
        folder = out / f"attempt{attempt}"
        folder.mkdir()
        returncode, log = launch_once(case, folder)
        if returncode is not None and HANG_MARK not in log:
            break
        if attempt == 2:
            pytest.fail(f"case {case!r} hung twice; the second time:\n{_tail(log)}")
        warnings.warn(f"case {case!r} hung once and is launched again; where it hung:\n{_tail(log)}", stacklevel=1)
    if returncode != 0:
        pytest.fail(f"case {case!r} failed (exit status {returncode})\n{_tail(log)}")
    rank0, rank1 = (json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    return rank0, rank1


def launch_once(case: str, out: Path) -> tuple[int | None, str]:
    """The launcher's exit status (``None`` when it ran past :data:`TIMEOUT_S` and was ended) and its log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKER), "--case", case, "--out", str(out)]
    log_path = out / "launch.log"  # a file, not a pipe: a worker left behind cannot keep the test reading
    returncode: int | None
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=torchrun_environment(), stdout=log, stderr=log)
        try:
            returncode = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            end_launch(process)
            returncode = None
    return returncode, log_path.read_text(errors="replace")


def end_launch(process: subprocess.Popen) -> None:
    """End a hung launch: the launcher ends its workers on SIGTERM; whatever is left is killed by its id.

    The workers run in sessions of their own (torchelastic starts them so), so they are found as the launcher's
    children before it is signalled, not through its process group.
    """
    workers = _children(process.pid)
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pid in workers:
        with contextlib.suppress(OSError):
            if str(WORKER) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):  # still one of ours
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """Ids of the processes whose parent is ``pid`` (Linux ``/proc``; none found elsewhere)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append(int(stat.parent.name))
    return children


def _tail(log: str, lines: int = 80) -> str:
    return "\n".join(log.splitlines()[-lines:])


def assert_trained_alike(rank0: dict[str, Any], rank1: dict[str, Any], steps: int) -> None:
    """Both ranks finished every step, with finite losses, and hold the very same parameters."""
    for report in (rank0, rank1):
        assert report["finished"] and report["world_size"] == 2
        assert report["global_step"] == steps and len(report["losses"]) == steps
        assert all(math.isfinite(loss) for loss in report["losses"])
        assert report["live_graphs"] == 0, "every graph is released at the end of the fit"
    assert rank0["params"] == rank1["params"], "DDP ranks ended with different parameters"


def assert_losses_as_eager(report: dict[str, Any], steps: int | None = None, tolerance: float = 1e-5) -> None:
    """The rank's losses are those of an eager DDP fit of the same model and data (the first ``steps`` of them)."""
    graphed, eager = report["losses"][:steps], report["eager_losses"][:steps]
    assert len(graphed) == len(eager)
    worst = max(abs(a - b) for a, b in zip(graphed, eager, strict=True))
    assert worst < tolerance, f"rank {report['rank']}: losses differ from eager by {worst:.3g}"


# ---------------------------------------------------------------------------------------------- fixed scopes
def test_a_capture_that_fails_on_one_rank_rolls_back_every_rank(ranks: Callable[[str], Ranks]) -> None:
    rank0, rank1 = ranks("capture_fails")

    assert_trained_alike(rank0, rank1, SCOPED_STEPS)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (Stage.DISABLED, 1)
        assert report["reason"].startswith("rollback: capture_failed: RuntimeError: ")
        assert report["steps_replayed"] == 0
        assert_losses_as_eager(report)
    assert "injected: capture failed on rank 1" in rank1["reason"]
    assert "the capture failed on another rank" in rank0["reason"], "rank 0 says why it rolled back"


def test_a_region_that_fails_capture_on_one_rank_stays_eager_on_every_rank(ranks: Callable[[str], Ranks]) -> None:
    rank0, rank1 = ranks("region_fails")

    assert_trained_alike(rank0, rank1, SCOPED_STEPS)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0)
        assert list(report["exclusions"]) == ["model.blocks.0"]
        assert report["region_replays"].get("model.blocks.0", 0) == 0, "the region is dropped where it was captured"
        assert report["region_replays"]["model.blocks.1"] > 0, "the other region keeps its graph"
        assert_losses_as_eager(report)
    assert rank0["steps_replayed"] == rank1["steps_replayed"] > 0
    assert "injected: a host sync on rank 1" in rank1["exclusions"]["model.blocks.0"]
    assert "another rank" in rank0["exclusions"]["model.blocks.0"]


def test_a_region_that_fails_parity_on_one_rank_stays_eager_on_every_rank(ranks: Callable[[str], Ranks]) -> None:
    rank0, rank1 = ranks("parity_fails")

    assert_trained_alike(rank0, rank1, SCOPED_STEPS)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0)
        assert list(report["exclusions"]) == ["model.blocks.1"]
        assert report["region_replays"]["model.blocks.0"] > 0, "the other region keeps its graph"
        assert_losses_as_eager(report)
    assert rank0["region_replays"] == rank1["region_replays"], "the ranks replay the same regions"
    assert rank0["steps_replayed"] == rank1["steps_replayed"] > 0
    assert "differs from eager by 21" in rank1["exclusions"]["model.blocks.1"]


def test_a_region_left_eager_for_another_ranks_parity_failure_says_so(ranks: Callable[[str], Ranks]) -> None:
    rank0, _ = ranks("parity_fails")

    assert "on another rank" in rank0["exclusions"]["model.blocks.1"], rank0["exclusions"]


def test_a_parameter_rebound_on_one_rank_rolls_back_every_rank_at_the_next_health_check(
    ranks: Callable[[str], Ranks],
) -> None:
    rank0, rank1 = ranks("rebind_on_rank_1")

    assert_trained_alike(rank0, rank1, 12)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (-1, 1), report
    assert "address_changed" in rank1["rollback_reasons"][0]
    assert "another rank" in rank0["rollback_reasons"][0]
    assert rank1["steps_eager"] > rank0["steps_eager"], "rank 1 ran its steps eagerly until every rank agreed"
    for report in (rank0, rank1):
        assert_losses_as_eager(report)


# ---------------------------------------------------------------------------------------------- scope="auto"
def test_scope_auto_settles_every_rank_on_the_same_level_timed_by_the_slowest_rank(
    ranks: Callable[[str], Ranks],
) -> None:
    # The walk tries the whole step first (after NCCL's eager steps): rank 0 times it at 2 ms, rank 1 at 9 ms, still
    # faster than eager training (10 ms) by the margin. Both ranks keep it, at the slowest rank's time.
    rank0, rank1 = ranks("auto_ladder")

    steps = rank0["global_step"]
    assert_trained_alike(rank0, rank1, steps)
    expected = [
        ("attn", "skipped", None),
        ("attn+mlp", "skipped", None),
        ("layer", "skipped", None),
        ("model", "skipped", None),
        ("full_iteration", "kept", 9.0),
    ]
    for report in (rank0, rank1):
        assert [(row["level"], row["status"], row["step_ms"]) for row in report["ladder"]] == expected
        assert (report["stage"], report["level"], report["rollbacks"]) == (Stage.REPLAYING, "full_iteration", 0)
        assert_losses_as_eager(report)
    assert rank0["region_replays"] == rank1["region_replays"], "the ranks captured and replayed the same regions"
    assert rank0["step_graph_replays"] == rank1["step_graph_replays"]
    assert rank0["eager_step_ms"] == rank1["eager_step_ms"]


# ---------------------------------------------------------------------------------------------- the whole step
def test_a_whole_step_capture_that_fails_on_one_rank_rolls_back_every_rank_without_a_hang(
    ranks: Callable[[str], Ranks],
) -> None:
    # DDP's all-reduce is inside the step. Rank 1's capture fails once the step's collectives were issued (see
    # LateStepFailure in the worker: FakeBackend's fail_step, raised before them, pairs gloo's collectives wrongly).
    rank0, rank1 = ranks("full_step_fails")

    assert_trained_alike(rank0, rank1, FULL_STEPS)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (Stage.DISABLED, 1)
        assert report["reason"].startswith("rollback: capture_failed: RuntimeError: ")
        assert (report["steps_replayed"], report["step_graph_replays"]) == (0, [0])
        # The 11 eager warmup steps are eager training's. The fake's capture then ran step 11 once, and the eager
        # run after the agreed rollback runs it again (a CUDA capture runs nothing), so later losses differ.
        assert_losses_as_eager(report, steps=11)
    assert "injected: whole-step capture failed on rank 1" in rank1["reason"]
    assert "the capture failed on another rank" in rank0["reason"]


def test_the_whole_step_with_accumulation_replays_every_micro_batch_on_every_rank(
    ranks: Callable[[str], Ranks],
) -> None:
    rank0, rank1 = ranks("full_step_accumulates")

    for report in (rank0, rank1):
        assert report["finished"] and report["global_step"] == FULL_STEPS
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0), report["reason"]
        assert report["captures"] == 2, "a graph for each place in the window of two"
        assert report["steps_replayed"] >= (FULL_STEPS - 12) * 2, "the micro-batches after 11 warmup steps replay"
        assert report["live_graphs"] == 0
        assert_losses_as_eager(report)
        assert report["params"]["abs_sum"] == pytest.approx(report["eager_params"]["abs_sum"], rel=1e-6)
    assert rank0["params"] == rank1["params"], "DDP ranks ended with different parameters"

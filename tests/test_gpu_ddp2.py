"""DDP on two GPUs (NCCL): graphed DDP trains as eager DDP, and a fault on one rank ends the same way on both.

Needs two CUDA GPUs (the ``nvidia-h200-x2`` machine); with fewer the module is skipped, so CI and a one-GPU
``pytest -m cuda`` pass over it. Run it with ``python -m pytest -m cuda tests/test_gpu_ddp2.py -v``.

Each case launches ``tests/ddp_gpu_worker.py`` under ``torch.distributed.run`` (two processes, one GPU each,
Lightning's ``TorchElasticEnvironment``), once per module, then compares the two ranks' reports. A launch that does
not end within :data:`TIMEOUT_S` has hung: it is killed (the launcher's process group, then any worker left) and the
test fails with the log, each rank's last step and the stacks it dumped; collectives themselves give up after the
worker's 60 s. The cases:

- ``eager``, ``layer``, ``full``: plain DDP; scoped layers and the whole step (``ddp_cudagraph_full``) against an
  eager DDP fit of the same model and data in the same process group, over 20 steps.
- ``auto``: ``ddp_cudagraph`` (``scope="auto"``): both ranks settle on the same level.
- ``nonfinite_rank1``, ``rebind_rank1``: a rollback forced on rank 1 only, while graphs replay.
- ``raise_rank1``: rank 1 raises mid-fit.
- ``ragged_rank1``, ``ragged_recapture_rank1``: a short last batch on rank 1 only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_cudagraph import Stage
from tests import ddp_gpu_worker as worker
from tests.helpers import assert_losses_close, trainer
from tests.models import TINY, decoder
from tests.test_rank_agreement import _children, _tail, torchrun_environment

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = REPO_ROOT / "tests" / "ddp_gpu_worker.py"
#: A launch that takes longer has hung: it is killed and the test fails. A case takes about 30-60 s (two processes
#: importing torch and Lightning, NCCL's set-up, a reference fit and the graphed fit).
TIMEOUT_S = 300
#: How long the launcher gets to end its workers after SIGTERM before everything left is killed.
GRACE_S = 30
#: Tolerances of the parity fits, as on one GPU (tests/test_gpu_scoped.py, tests/test_gpu_full.py). Two ranks sum
#: their gradients in either order to the same bits, so DDP adds no difference of its own.
TOLERANCE = 1e-5
#: Printed by PyTorch's NCCL watchdog when a collective times out.
WATCHDOG = "Watchdog caught collective operation timeout"

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(TIMEOUT_S + GRACE_S + 60)]

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (nvidia-h200-x2)", allow_module_level=True)

Report = dict[str, Any]
Ranks = tuple[Report, Report]


# =================================================================== launching a case
@dataclass
class Launch:
    """One launch of a case: how it ended, and what each rank wrote."""

    case: str
    out: Path
    returncode: int | None  # None: it hung and was killed
    seconds: float
    reports: dict[int, Report] = field(default_factory=dict)

    @property
    def hung(self) -> bool:
        return self.returncode is None

    def text(self, name: str) -> str:
        path = self.out / name
        return path.read_text(errors="replace") if path.exists() else ""

    def describe(self) -> str:
        """The log's tail, and per rank its last step and any stacks it dumped: for failure messages."""
        ended = "hung, killed" if self.hung else f"exit status {self.returncode}"
        parts = [f"case {self.case!r}: {ended} after {self.seconds:.0f} s", _tail(self.out / "launch.log")]
        for rank in (0, 1):
            progress = self.text(f"rank{rank}.progress.json")
            parts.append(f"--- rank {rank}: report {'written' if rank in self.reports else 'MISSING'}")
            parts.append(f"progress: {progress or 'none'}")
            stacks = self.text(f"rank{rank}.stacks.txt").strip()
            if stacks:
                parts.append(f"stacks:\n{stacks[-6000:]}")
        return "\n".join(parts)


def launch(case: str, out: Path) -> Launch:
    """Run ``case`` on two GPUs; never raises (a hang is killed and reported as ``returncode=None``)."""
    env = torchrun_environment()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKER), "--case", case, "--out", str(out)]
    started = time.monotonic()
    log_path = out / "launch.log"  # a file, not a pipe: a worker left behind cannot keep the test reading
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode: int | None = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            end_launch(process)
            returncode = None
    reports = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    return Launch(case, out, returncode, time.monotonic() - started, reports)


def end_launch(process: subprocess.Popen) -> None:
    """End a hung launch: SIGTERM to the launcher's process group (its own session), SIGKILL after a grace period,
    then SIGKILL to any worker left (torchelastic starts workers in sessions of their own), each by its id.
    """
    workers = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid in workers:
        with contextlib.suppress(OSError):
            if str(WORKER) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):  # still one of ours
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Ids of every process below ``pid`` (children, their children, ...), found before anything is signalled."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in _children(parent)]
        found += children
        frontier = children
    return found


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Launch]:
    """``launched(case)``: the case's launch, run once per module."""
    done: dict[str, Launch] = {}

    def run(case: str) -> Launch:
        if case not in done:
            done[case] = launch(case, tmp_path_factory.mktemp(case))
        return done[case]

    return run


@pytest.fixture(scope="module")
def ranks(launched: Callable[[str], Launch]) -> Callable[[str], Ranks]:
    """``ranks(case)``: the reports of rank 0 and rank 1 of a case that must end well on both."""

    def run(case: str) -> Ranks:
        result = launched(case)
        if result.hung or result.returncode != 0 or len(result.reports) != 2:
            pytest.fail(result.describe())
        rank0, rank1 = result.reports[0], result.reports[1]
        assert (rank0["rank"], rank1["rank"], rank0["world_size"]) == (0, 1, 2)
        return rank0, rank1

    return run


# =================================================================== checks
def assert_trained_alike(rank0: Report, rank1: Report, steps: int) -> None:
    """Both ranks finished every step and hold the very same parameters; every graph was released."""
    for report in (rank0, rank1):
        assert report["finished"] and report["error"] is None, report["error"]
        assert report["global_step"] == steps and len(report["losses"]) == steps
        assert_released(report)
    assert rank0["params"] == rank1["params"], "the DDP ranks ended with different parameters"


def assert_released(report: Report) -> None:
    """Nothing of the package is left on this rank: graphs, their pool, patched forwards, the side stream."""
    where = f"rank {report['rank']}"
    assert report.get("graphs", 0) == 0, f"{where}: graphs still counted alive"
    assert report["patched_forwards"] == [], f"{where}: patched forwards left: {report['patched_forwards']}"
    assert report["graph_pool_bytes"] == 0, f"{where}: {report['graph_pool_bytes']} bytes left in graph pools"
    assert report["on_default_stream"] is True, f"{where}: training left on the package's stream"
    capturable = report["capturable"]
    assert isinstance(capturable, list) and not any(capturable), f"{where}: optimizers not given back: {capturable}"


def assert_same_state(rank0: Report, rank1: Report) -> None:
    """Both ranks ended where the rollout put them together: same stage, rollbacks, level and regions left eager."""
    keys = ("stage", "rollbacks", "level", "graphs")
    assert {k: rank0[k] for k in keys} == {k: rank1[k] for k in keys}, (rank0["reason"], rank1["reason"])
    assert sorted(rank0["exclusions"]) == sorted(rank1["exclusions"])


def assert_losses_as_eager(report: Report) -> None:
    """The rank's losses and final parameters are those of its eager DDP reference, within :data:`TOLERANCE`."""
    assert len(report["losses"]) == worker.PARITY_STEPS, f"rank {report['rank']}"
    assert_losses_close(report["eager_losses"], report["losses"], TOLERANCE)
    assert report["max_param_diff_vs_eager"] < TOLERANCE, f"rank {report['rank']}: {report['max_param_diff_vs_eager']}"


def mentions(report: Report, *words: str) -> bool:
    """Whether the report's reasons (stage, rollbacks, exclusions, fallbacks) mention one of ``words``."""
    texts = [report.get("reason") or "", *report.get("rollback_reasons", []), *report.get("exclusions", {}).values()]
    texts += list(report.get("fallback_reasons", {}))
    return any(word in text for text in texts for word in words)


# =================================================================== graphed DDP trains as eager DDP
def test_eager_ddp_on_two_gpus_trains_the_same_parameters_on_both_ranks(ranks):
    rank0, rank1 = ranks("eager")

    assert_trained_alike(rank0, rank1, worker.PARITY_STEPS)
    for report in (rank0, rank1):
        assert all(math.isfinite(loss) for loss in report["losses"])
        assert "stage" not in report, "plain DDP has no CUDAGraphCallback"
    assert rank0["losses"] != rank1["losses"], "each rank trains on its own shard of the data"


def test_scoped_layer_graphs_under_ddp_match_eager_ddp(ranks):
    rank0, rank1 = ranks("layer")

    assert_trained_alike(rank0, rank1, worker.PARITY_STEPS)
    assert_same_state(rank0, rank1)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"], report["fallbacks"]) == (Stage.REPLAYING, 0, 0), report["reason"]
        assert report["captures"] == 1
        assert report["step_modes"].count(worker.GRAPHED) == worker.PARITY_STEPS - worker.WARMUP
        assert_losses_as_eager(report)
    assert rank0["step_modes"] == rank1["step_modes"]
    assert rank0["replays"] == rank1["replays"] > 0


def test_the_whole_step_under_ddp_matches_eager_ddp(ranks):
    # The eager reference runs AdamW(fused=True): the package runs the whole step's optimizer in that form.
    rank0, rank1 = ranks("full")

    assert_trained_alike(rank0, rank1, worker.PARITY_STEPS)
    assert_same_state(rank0, rank1)
    for report in (rank0, rank1):
        assert (report["stage"], report["rollbacks"]) == (Stage.REPLAYING, 0), report["reason"]
        assert report["captures"] == 1 and report["fallbacks"] == 0
        assert report["steps_replayed"] == worker.PARITY_STEPS - worker.FULL_WARMUP
        assert_losses_as_eager(report)
    assert rank0["step_modes"] == rank1["step_modes"]


def test_scope_auto_under_ddp_settles_both_ranks_on_the_same_level(ranks):
    rank0, rank1 = ranks("auto")

    assert_trained_alike(rank0, rank1, worker.AUTO_STEPS)
    assert_same_state(rank0, rank1)
    for report in (rank0, rank1):
        assert report["stage"] == Stage.REPLAYING, report["reason"]
        assert report["level"] in {"attn", "attn+mlp", "layer", "model", "full_iteration"}
        assert all(row["status"] not in {"trying", "planned"} for row in report["ladder"]), report["ladder"]
        assert all(math.isfinite(loss) for loss in report["losses"])

    def rows(report: Report) -> list[tuple[Any, ...]]:
        return [(row["level"], row["status"], row["step_ms"]) for row in report["ladder"]]

    assert rows(rank0) == rows(rank1), "each level is timed by the slowest rank, so both decide alike"
    assert rank0["eager_step_ms"] == rank1["eager_step_ms"]


def test_a_single_device_graph_strategy_on_two_gpus_is_refused_with_the_ddp_strategy_named():
    # In this process: the refusal comes before Lightning would start any other process.
    with pytest.raises(ValueError, match="ddp_cudagraph"):
        trainer(4, strategy="cudagraph_layer", accelerator="gpu", devices=2).fit(*decoder(TINY))


# =================================================================== a fault on one rank
def test_a_nonfinite_loss_on_one_rank_ends_with_both_ranks_in_the_same_state(ranks):
    # Rank 1 alone sees a NaN loss in a replayed whole step (its gradients stay finite); the whole step holds the
    # all-reduce, so one rank going eager while the other replays would hang or train apart.
    rank0, rank1 = ranks("nonfinite_rank1")
    step = worker.NONFINITE_STEP

    assert math.isnan(rank1["losses"][step]) and math.isfinite(rank0["losses"][step]), "injected on rank 1 only"
    rank1["losses"][step] = rank0["losses"][step] = 0.0  # the injected NaN is not a training failure
    assert_trained_alike(rank0, rank1, worker.FAULT_STEPS)
    assert_same_state(rank0, rank1)
    assert rank1["nonfinite"], "rank 1's in-graph counter saw the NaN"
    assert mentions(rank1, "nonfinite")
    assert all(math.isfinite(loss) for report in (rank0, rank1) for loss in report["losses"])


def test_a_parameter_rebound_on_one_rank_ends_with_both_ranks_in_the_same_state(ranks):
    rank0, rank1 = ranks("rebind_rank1")

    assert_trained_alike(rank0, rank1, worker.FAULT_STEPS)
    assert_same_state(rank0, rank1)
    assert mentions(rank1, "address_changed", "parameters changed"), "rank 1 found the rebind"
    assert all(math.isfinite(loss) for report in (rank0, rank1) for loss in report["losses"])


def test_an_exception_on_one_rank_ends_the_run_with_that_error_and_no_watchdog_hang(launched):
    result = launched("raise_rank1")

    assert not result.hung, result.describe()
    assert result.returncode != 0, "the launch reports the failed rank"
    rank1 = result.reports.get(1)
    assert rank1 is not None, result.describe()
    assert rank1["error"] is not None and worker.RAISE_MESSAGE in rank1["error"]["message"], rank1["error"]
    assert rank1["global_step"] == worker.RAISE_STEP and not rank1["finished"]
    assert_released(rank1)
    assert WATCHDOG not in result.text("launch.log"), result.describe()


def test_an_exception_on_one_rank_leaves_every_rank_released(launched):
    # Rank 0 is in DDP's all-reduce of the step when rank 1 raises: it must end with an error of its own (Lightning's
    # SIGTERMException when the launcher stops it, or a collective's error), and release like rank 1.
    result = launched("raise_rank1")

    rank0 = result.reports.get(0)
    assert rank0 is not None, f"rank 0 wrote no report: it was killed before its fit returned\n{result.describe()}"
    assert rank0["error"] is not None and not rank0["finished"], rank0
    assert_released(rank0)


# =================================================================== a shape seen by one rank only
def test_a_ragged_batch_on_one_rank_costs_speed_not_correctness(ranks):
    # Scoped graphs keep DDP's all-reduce outside: rank 1's eager fallback for its short batch is still right.
    rank0, rank1 = ranks("ragged_rank1")
    ragged = [worker.RAGGED_BATCHES - 1, 2 * worker.RAGGED_BATCHES - 1]
    short = worker.BATCH_SIZE - worker.RAGGED_SHORT

    assert set(rank0["batch_sizes"]) == {worker.BATCH_SIZE}
    assert [rank1["batch_sizes"][i] for i in ragged] == [short, short]
    assert_trained_alike(rank0, rank1, worker.FAULT_STEPS)
    assert all(math.isfinite(loss) for report in (rank0, rank1) for loss in report["losses"])


SHAPE_SEEN_BY_ONE_RANK = (
    "a batch shape seen by one rank only is a per-step local event and the package takes no per-step collective:"
    " rank 1 alone falls back (on_shape_change='eager'), or records and captures the shape, whose capture agreement"
    " then pairs with rank 0's next collective (on_shape_change='recapture'), while rank 0 replays. Remove this mark"
    " once shape changes are decided for all ranks."
)


@pytest.mark.xfail(strict=True, reason=SHAPE_SEEN_BY_ONE_RANK)
@pytest.mark.parametrize("case", ["ragged_rank1", "ragged_recapture_rank1"])
def test_a_shape_change_seen_by_one_rank_is_decided_for_both(ranks, case):
    rank0, rank1 = ranks(case)  # a hang (recapture) fails here, inside the expected failure

    assert_trained_alike(rank0, rank1, worker.FAULT_STEPS)
    assert_same_state(rank0, rank1)
    assert rank0["step_modes"] == rank1["step_modes"], "each step ran the same way on both ranks"

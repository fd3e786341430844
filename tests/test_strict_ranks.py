"""A NaN loss on one rank only during the eager warmup turns graphs off on every rank, not on that rank alone.

Two gloo processes on the CPU (``torch.distributed.run``), scoped graphs on the fake backend. Rank 1's loss is NaN
at one warmup step (its gradients stay finite, so rank 0 never sees a NaN). The decision that ends warmup is taken
for all ranks: both stay eager. A rank that decided alone would capture while the other does not, and the two
would no longer pair up their collectives (a hang under the whole step, an error here).

Run as a script, this file is one rank of that fit: it writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make ``tests`` and the package importable
    sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_cudagraph import Stage  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch"),
    pytest.mark.skipif(dist.is_available() and not dist.is_gloo_available(), reason="needs the gloo backend"),
]

WORKER = Path(__file__).resolve()
TIMEOUT_S = 300
STEPS, WARMUP, NAN_STEP = 6, 2, 1


# =================================================================== one rank (run as a script)
def run_rank(out: Path) -> None:
    """Fit on this rank and write what its rollout decided."""
    from lightning_cudagraph import DDPCUDAGraphStrategy
    from tests.dist_worker import COLLECTIVE_TIMEOUT, fingerprint, report_fields, shut_down
    from tests.fake_backend import FakeBackend
    from tests.helpers import LossRecorder, graph_callback, trainer
    from tests.models import TINY, TINY_DATA, DecoderModule, decoder

    class NaNOnRank1(DecoderModule):
        """Rank 1's loss is NaN at one warmup step; its gradients stay finite (the NaN is added detached)."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_rank == 1 and self.trainer.global_step == NAN_STEP:
                return loss + float("nan") * loss.detach()
            return loss

    backend = FakeBackend()
    strategy = DDPCUDAGraphStrategy(
        scope=["layer"], warmup_steps=WARMUP, process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT
    )
    strategy.capture_backend = backend
    losses = LossRecorder()
    model, data = decoder(TINY, module=NaNOnRank1, **TINY_DATA)
    run = trainer(STEPS, [losses], accelerator="cpu", devices=2, strategy=strategy)
    run.fit(model, datamodule=data)
    report = {
        "rank": run.global_rank,
        "global_step": run.global_step,
        **report_fields(graph_callback(run).report),
        "regions": len(backend.regions),
        "losses": losses.losses,
        "params": fingerprint(model),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{run.global_rank}.json").write_text(json.dumps(report, indent=1))
    shut_down()


# =================================================================== the test
def launch(out: Path) -> tuple[dict, dict]:
    """Both ranks' reports; a hang or a failed rank fails the test."""
    from tests.test_rank_agreement import _children, torchrun_environment

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKER), "--out", str(out)]
    log_path = out / "launch.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=torchrun_environment(), stdout=log, stderr=log)
        try:
            process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            workers = _children(process.pid)
            process.kill()
            process.wait()
            for pid in workers:
                with contextlib.suppress(OSError):
                    if str(WORKER) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                        os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the fit hung: ended after {TIMEOUT_S} s\n{log_path.read_text()[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"the fit failed (exit status {process.returncode})\n{log_path.read_text()[-4000:]}")
    rank0, rank1 = (json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1))
    return rank0, rank1


def test_a_nan_loss_on_one_rank_during_warmup_keeps_graphs_off_on_every_rank(tmp_path):
    rank0, rank1 = launch(tmp_path)
    assert rank1["losses"][NAN_STEP] != rank1["losses"][NAN_STEP], "rank 1's warmup loss was NaN"
    assert all(loss == loss for loss in rank0["losses"]), "rank 0 never saw a NaN"
    for report in (rank0, rank1):
        assert report["global_step"] == STEPS
        assert (report["stage"], report["reason"]) == (int(Stage.DISABLED), "nonfinite_warmup"), report
        assert report["captures"] == report["regions"] == 0
    assert rank0["params"] == rank1["params"], "the ranks trained apart"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    run_rank(parser.parse_args().out)

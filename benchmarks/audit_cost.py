"""What the numerics guard costs: a fit with audits against the same fit without, in alternated rounds.

    PYTHONPATH=. python benchmarks/audit_cost.py --out benchmarks/results/audit --steps 400 --every 25

Each round fits the small GPT twice per scope (``layer`` and the whole step): ``audit_every_n_steps=0`` (the
capture's own shadow step only) and ``--every``. The wall time of each fit's training loop, between two device
syncs, gives the cost of one audit, scaled to a 1000-step fit at the default interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.models import CONFIGS, build, graph_callback
from benchmarks.core.timing import timing_trainer
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

DEFAULT_EVERY = 1000  # the package's default audit_every_n_steps


class LoopClock(pl.Callback):
    """Wall time from the first training batch to the end of training, with a device sync at both ends."""

    def __init__(self) -> None:
        self.seconds, self.started = float("nan"), 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.started = time.perf_counter()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.started


def fit(config: str, scope: str, every: int, steps: int) -> tuple[float, int]:
    """Seconds of the training loop and the audits the fit ran."""
    module, data = build(config)
    clock = LoopClock()
    options: dict[str, Any] = {"warmup_steps": 3, "audit_every_n_steps": every}
    strategy: Any = "auto"
    callbacks: list[pl.Callback] = [clock]
    if scope == "full_iteration":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], **options)
    else:
        callbacks.append(CUDAGraphCallback(scope=[scope], **options))
    trainer = timing_trainer(steps, callbacks, strategy)
    trainer.fit(module, data)
    callback = graph_callback(trainer)
    return clock.seconds, 0 if callback is None else callback.report.audits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/audit"))
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if records.needs_cuda("audit_cost.py"):
        return 2
    scopes = []
    for scope in ("full_iteration", "layer"):
        fit(args.config, scope, 0, 20)  # compile caches and allocator warm
        plain, audited, audits = [], [], 0
        for _ in range(args.rounds):
            plain.append(fit(args.config, scope, 0, args.steps)[0])
            seconds, audits = fit(args.config, scope, args.every, args.steps)
            audited.append(seconds)
        base, guarded = statistics.median(plain), statistics.median(audited)
        extra = max(audits - (scope == "full_iteration"), 1)  # the whole step's capture is a shadow step in both fits
        per_audit_ms, step_ms = (guarded - base) / extra * 1e3, base / args.steps * 1e3
        share = per_audit_ms * (1000 // DEFAULT_EVERY) / (1000 * step_ms)
        scopes.append({"scope": scope, "plain_s": base, "audited_s": guarded, "audits": audits,
                       "per_audit_ms": per_audit_ms, "step_ms": step_ms, "default_share": share})  # fmt: skip
        print(f"{scope}: {per_audit_ms:.2f} ms per audit; {share:.2%} of a 1000-step fit", flush=True)
    record = {"kind": "audit", "config": args.config, "steps": args.steps, "every": args.every, "rounds": args.rounds}
    record.update(default_every=DEFAULT_EVERY, environment=records.environment(), scopes=scopes)
    report.publish(args.out, records.write(record, args.out / "audit.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the numerics guard costs: a fit with audits against the same fit without, in alternated rounds.

    PYTHONPATH=. python benchmarks/audit_cost.py --config small --steps 400 --every 25

Each round fits the small GPT twice per scope (``layer`` and the whole step): ``audit_every_n_steps=0`` (the
capture's own shadow step only) and ``--every``. The wall time of each fit's training loop, between two device
syncs, gives the cost of one audit; the line printed scales it to a 1000-step fit at the default interval.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch

from benchmarks.variants import CONFIGS, _model_and_data, timing_trainer
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy
from lightning_cudagraph.config import CUDAGraphConfig

DEFAULT_EVERY = CUDAGraphConfig.audit_every_n_steps


class LoopClock(pl.Callback):
    """Wall time from the first training batch to the end of training, with a device sync at both ends."""

    def __init__(self) -> None:
        self.seconds = float("nan")
        self._started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self._started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._started


def fit(config: dict, scope: str, every: int, steps: int) -> tuple[float, int]:
    """Seconds of the training loop and the audits the fit ran."""
    model, data = _model_and_data(config)
    clock = LoopClock()
    options = {"warmup_steps": 3, "audit_every_n_steps": every}
    if scope == "full":
        strategy, callbacks = CUDAGraphStrategy(scope=["full_iteration"], **options), [clock]
    else:
        strategy, callbacks = "auto", [clock, CUDAGraphCallback(scope=[scope], **options)]
    trainer = timing_trainer(steps, callbacks, strategy)
    trainer.fit(model, data)
    graph = next(cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback))
    return clock.seconds, graph.report.audits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for scope in ("layer", "full"):
        fit(CONFIGS[args.config], scope, 0, 20)  # compile caches and allocator warm
        plain, audited, audits = [], [], 0
        for _ in range(args.rounds):
            plain.append(fit(CONFIGS[args.config], scope, 0, args.steps)[0])
            seconds, audits = fit(CONFIGS[args.config], scope, args.every, args.steps)
            audited.append(seconds)
        base, guarded = statistics.median(plain), statistics.median(audited)
        extra = max(audits - (scope == "full"), 1)  # the whole step's capture is a shadow step in both fits
        per_audit_ms = (guarded - base) / extra * 1e3
        step_ms = base / args.steps * 1e3
        default_share = per_audit_ms * (1000 // DEFAULT_EVERY) / (1000 * step_ms)
        print(
            f"audit_cost {scope}: fit {base:.3f} s without audits, {guarded:.3f} s with {audits} (every {args.every});"
            f" {per_audit_ms:.2f} ms per audit, {step_ms:.2f} ms per step; at the default every"
            f" {DEFAULT_EVERY} steps a 1000-step fit spends {default_share:.2%} on audits",
            flush=True,
        )


if __name__ == "__main__":
    main()

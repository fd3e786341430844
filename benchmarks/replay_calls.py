"""Host work per replayed training step, counted: the Python function calls a steady replayed step makes.

    PYTHONPATH=. python benchmarks/replay_calls.py                  # this checkout's package
    PYTHONPATH=OTHER:. python benchmarks/replay_calls.py            # another copy (an older commit's), the same way

A CPU fit through the fake capture backend (which, like CUDA, runs no Python of the step at a replay) trains the
test decoder with the whole step (``CUDAGraphStrategy(scope=["full_iteration"])``) and with its layers captured
(``scope=["layer"]``). Once the graphs replay, a profiler counts every Python call between the starts of
``--steps`` batches: all of them, and those made inside the package. The counts are deterministic, so two copies of
the package compare exactly where a timing would scatter; each count is per step.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

# Appended, not prepended: ``PYTHONPATH=OTHER:.`` counts another copy of the package the same way.
sys.path.append(str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
from typing_extensions import override

import lightning_cudagraph
from lightning_cudagraph import CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import trainer
from tests.models import decoder

SIZE = {"vocab_size": 32, "seq_len": 8, "width": 16, "heads": 2, "n_layer": 4}
VARIANTS = {"whole step": ["full_iteration"], "layer": ["layer"]}
PACKAGE = str(Path(lightning_cudagraph.__file__).resolve().parent)


class CallCounter(pl.Callback):
    """Counts Python calls from the batch start of step ``start`` to the batch start of step ``start + steps``."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.calls = self.package_calls = 0
        self.stage: Stage | None = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1
            self.package_calls += frame.f_code.co_filename.startswith(PACKAGE)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.start:
            self.stage = trainer.strategy.rollout.stage
            sys.setprofile(self._profile)
        elif trainer.global_step == self.start + self.steps:
            sys.setprofile(None)


def count(scope: list[str], start: int, steps: int) -> tuple[float, float, str]:
    """Calls per step (all, the package's) of one fit, and the stage the counted steps ran in."""
    module, data = decoder(SIZE, train_samples=4 * (start + steps + 2), batch_size=4)
    strategy = CUDAGraphStrategy(scope=scope, warmup_steps=2, audit_every_n_steps=None, eval_graphs=False)
    strategy.capture_backend = FakeBackend()
    counter = CallCounter(start, steps)
    fit = trainer(start + steps + 1, [counter], strategy=strategy, accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit.fit(module, data)
    stage = counter.stage.name if counter.stage is not None else "never reached"
    return counter.calls / steps, counter.package_calls / steps, stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=12, help="the first counted step (graphs replay by then)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the package's info lines
    print(f"package: {PACKAGE}")
    print("| variant | Python calls per replayed step | of them in the package | stage |\n|---|---|---|---|")
    for name, scope in VARIANTS.items():
        calls, package, stage = count(scope, args.start, args.steps)
        print(f"| {name} | {calls:.1f} | {package:.1f} | {stage} |")


if __name__ == "__main__":
    main()

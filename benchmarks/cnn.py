"""torchvision CNNs through ``CUDAGraphCallback()``: speed against eager Lightning, and BatchNorm statistics as eager's.

    PYTHONPATH=. python benchmarks/cnn.py --out benchmarks/results/cnn

Per model (``resnet18`` and ``mobilenet_v3_small``, batch 32, 64x64 images, SGD with momentum), in one process and
alternated rounds: ``eager``, ``auto-callback`` (``CUDAGraphCallback()``, the ladder) and ``layer``
(``CUDAGraphCallback(scope=["layer"])``). A fit's figure is the median step time (CUDA events between batch starts)
over its last ``--timed`` steps, when the ladder has settled. Parity: eager and ``auto-callback`` train
``--parity-steps`` steps from the same weights on the same batches with deterministic cuDNN kernels; the largest loss
difference and the largest difference of a BatchNorm buffer (running mean, variance, batch count) are printed.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.core import records
from benchmarks.core.figures import ratio
from benchmarks.core.models import graph_callback, report_figures
from benchmarks.core.timing import StepClock, alternate, timing_trainer
from lightning_cudagraph import CUDAGraphCallback

MODELS = ("resnet18", "mobilenet_v3_small")
VARIANTS = ("eager", "auto-callback", "layer")
BATCH, SIZE = 32, 64


class Classifier(pl.LightningModule):
    """A torchvision classifier trained with cross-entropy and SGD with momentum."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def build(model: str) -> tuple[Classifier, DataLoader]:
    """The seeded classifier and its batches (the same for every fit of the model)."""
    import torchvision

    pl.seed_everything(0, verbose=False)
    module = Classifier(getattr(torchvision.models, model)(num_classes=10))
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH * 16, 3, SIZE, SIZE, generator=generator)
    labels = torch.randint(0, 10, (BATCH * 16,), generator=generator)
    return module, DataLoader(TensorDataset(images, labels), batch_size=BATCH, drop_last=True)


def callbacks_of(variant: str) -> list[pl.Callback]:
    if variant == "auto-callback":
        return [CUDAGraphCallback()]
    return [CUDAGraphCallback(scope=["layer"])] if variant == "layer" else []


def measure(model: str, variant: str, steps: int, timed: int, keep: int = 0) -> dict[str, Any]:
    """One fit: the median step time over the last ``timed`` steps, the report, and (``keep``) losses and buffers."""
    module, data = build(model)
    clock = StepClock(keep_losses=keep)
    trainer = timing_trainer(steps, [clock, *callbacks_of(variant)])
    trainer.fit(module, data)
    return {
        "variant": variant,
        "median_ms": statistics.median(clock.step_times(steps - timed)),
        "report": report_figures(graph_callback(trainer)),
        "losses": clock.first_losses(),
        "buffers": {name: b.detach().double().cpu() for name, b in module.named_buffers()},
    }


def parity(model: str, steps: int) -> dict[str, Any]:
    """Eager against ``auto-callback`` for ``steps`` steps with deterministic convolutions: losses and buffers."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        eager, graphed = (measure(model, variant, steps, 1, keep=steps) for variant in ("eager", "auto-callback"))
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before
    loss = max(abs(a - b) for a, b in zip(eager["losses"], graphed["losses"], strict=True))
    buffers = {name: float((graphed["buffers"][name] - b).abs().max()) for name, b in eager["buffers"].items()}
    worst = max(buffers, key=buffers.__getitem__)
    report = graphed["report"] or {}
    return {"steps": steps, "max_loss_diff": loss, "max_buffer_diff": buffers[worst], "worst_buffer": worst,
            "level": report.get("level"), "stage": report.get("stage")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = records.timed_parser(__doc__, steps=120, timed=40, rounds=3)
    parser.add_argument("--parity-steps", type=int, default=60, help="training steps of the parity fits")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=60)
    models = records.names(parser, "--models", args.models, MODELS)
    if records.needs_cuda("cnn.py"):
        return 2
    results: dict[str, Any] = {"environment": records.environment(), "batch_size": BATCH, "size": SIZE, "models": {}}
    for model in models:
        fits = alternate(VARIANTS, args.rounds, lambda v, model=model: measure(model, v, args.steps, args.timed))
        eager = next(fit["median_ms"] for fit in fits if fit["variant"] == "eager")
        rows = {
            fit["variant"]: {"median_ms": fit["median_ms"], "round_ms": fit.get("round_ms"),
                             "x_eager": ratio(eager, fit["median_ms"]), "report": fit.get("report")}
            for fit in fits
        }  # fmt: skip
        rows["parity"] = parity(model, args.parity_steps)
        results["models"][model] = rows
        for name, row in rows.items():
            shown = {k: v for k, v in row.items() if k not in ("report", "round_ms")}
            level = (row.get("report") or {}).get("level")
            print(model, name, json.dumps({**shown, **({"level": level} if level else {})}, default=str))
    records.write(results, args.out / "cnn.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does ``scope="auto"`` hold up fit after fit? ``CUDAGraphCallback()`` on five models, five fits each, on the GPU.

    PYTHONPATH=. python benchmarks/ladder_noise.py
    PYTHONPATH=. python benchmarks/ladder_noise.py --models gpt,convnext_atto --fits 5 --steps 120

Per model, in one process: eager Lightning and the fixed scopes (``--fixed``) once, then ``--fits`` rounds of the
fastest fixed scope and ``CUDAGraphCallback()`` (the ladder), alternated. A fit's figure is the median step time (CUDA
events between batch starts) over its last ``--timed`` steps, when every ladder has settled. Each ladder fit's row
says where it settled, its speed against eager (goal: never below 1.0x) and against the median of the best fixed
scope's fits (goal: at least 0.9x).
Models: the small GPT of ``examples/gpt.py``, a transformers Llama and BERT from small configs, timm's
``convnext_atto`` and torchvision's ``resnet18`` (each skipped where its library is missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.core.timing import StepClock, fresh_device, timing_trainer
from lightning_cudagraph import CUDAGraphCallback

MODELS = ("gpt", "llama", "bert", "convnext_atto", "resnet18")
FIXED = {"attn+mlp": ["attn", "mlp"], "layer": ["layer"]}
NEEDS = {"llama": "transformers", "bert": "transformers", "convnext_atto": "timm", "resnet18": "torchvision"}


class Classifier(pl.LightningModule):
    """Cross-entropy on a classifier's logits (CNNs: images; BERT: token ids), AdamW."""

    def __init__(self, net: nn.Module, tokens: bool = False) -> None:
        super().__init__()
        self.net, self.tokens = net, tokens

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        logits = self.net(input_ids=inputs).logits if self.tokens else self.net(inputs)
        return nn.functional.cross_entropy(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def build(model: str) -> tuple[pl.LightningModule, Any]:
    """The seeded model and its data (the same for every fit of the model)."""
    pl.seed_everything(0, verbose=False)
    if model in ("gpt", "llama"):
        from benchmarks.core.models import build as build_gpt

        return build_gpt("small" if model == "gpt" else "llama")
    generator = torch.Generator().manual_seed(1)
    if model == "bert":
        import transformers

        config = transformers.BertConfig(
            vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
            max_position_embeddings=128, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        net: nn.Module = transformers.BertForSequenceClassification(config)
        inputs = torch.randint(0, 1024, (8 * 16, 128), generator=generator)
        labels = torch.randint(0, 10, (8 * 16,), generator=generator)
        return Classifier(net, tokens=True), DataLoader(TensorDataset(inputs, labels), batch_size=8, drop_last=True)
    if model == "convnext_atto":
        import timm

        net = timm.create_model("convnext_atto", num_classes=10)
    else:
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
    images = torch.randn(32 * 8, 3, 64, 64, generator=generator)
    labels = torch.randint(0, 10, (32 * 8,), generator=generator)
    return Classifier(net), DataLoader(TensorDataset(images, labels), batch_size=32, drop_last=True)


def fit_once(model: str, variant: str, steps: int, timed: int) -> dict[str, Any]:
    """One fit: its median step time over the last ``timed`` steps, and where the package settled."""
    module, data = build(model)
    clock = StepClock()
    graph = None if variant == "eager" else CUDAGraphCallback(**({"scope": FIXED[variant]} if variant in FIXED else {}))
    trainer = timing_trainer(steps, [clock, *([graph] if graph is not None else [])])
    trainer.fit(module, data)
    fit: dict[str, Any] = {"ms": statistics.median(clock.step_times(steps - timed))}
    if graph is not None:
        report = graph.report
        fit.update(stage=report.stage.name, level=report.level, reason=report.reason, eager_ref=report.eager_step_ms)
        fit["ladder"] = "; ".join(f"{r.level} {r.status} {r.step_ms:.2f}" for r in report.ladder)
    return fit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fits", type=int, default=5, help="fits of CUDAGraphCallback() per model")
    parser.add_argument("--steps", type=int, default=130, help="steps per fit (the ladder settles well before)")
    parser.add_argument("--timed", type=int, default=30, help="the last steps of a fit, timed")
    parser.add_argument("--fixed", default=",".join(FIXED), help="the fixed scopes to compare with")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ladder_noise.py needs CUDA")
        return 2
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        __import__("logging").getLogger(name).setLevel("ERROR")
    fixed = [f for f in args.fixed.split(",") if f]
    print("| model | fit | settled on | ms/step | vs eager | vs best fixed (median of its fits) | eager ref | ladder |")
    print("|---|---|---|---|---|---|---|---|")
    failures = 0
    for model in [m for m in args.models.split(",") if m]:
        if model in NEEDS and importlib.util.find_spec(NEEDS[model]) is None:
            print(f"| {model} | skipped: {NEEDS[model]} is not installed |||||||")
            continue
        reference: dict[str, list[float]] = {}
        for variant in ("eager", *fixed):
            fresh_device()
            try:
                reference[variant] = [fit_once(model, variant, args.steps, args.timed)["ms"]]
            except ValueError:  # a fixed scope that finds no module in this model (a CNN has no attention)
                reference[variant] = [float("inf")]
        best = min(fixed, key=lambda v: reference[v][0])
        fits = []
        for _ in range(args.fits):  # alternated: the best fixed scope, then the ladder
            fresh_device()
            reference[best].append(fit_once(model, best, args.steps, args.timed)["ms"])
            fresh_device()
            fits.append(fit_once(model, "auto", args.steps, args.timed))
        eager_ms, best_ms = statistics.median(reference["eager"]), statistics.median(reference[best])
        others = ", ".join(f"{v} {statistics.median(reference[v]):.2f}" for v in fixed)
        print(f"| {model} | eager {eager_ms:.2f}, {others} ms | best fixed: {best} ({len(reference[best])} fits) |||||")
        for index, fit in enumerate(fits):
            vs_eager, vs_best = eager_ms / fit["ms"], best_ms / fit["ms"]
            failures += vs_eager < 1.0 or vs_best < 0.9
            where = fit["level"] or f"eager ({(fit['reason'] or '').split(':')[0]})"
            print(
                f"| {model} | {index + 1} | {where} | {fit['ms']:.2f} | {vs_eager:.2f}x | {vs_best:.2f}x |"
                f" {fit['eager_ref']:.2f} | {fit['ladder']} |",
                flush=True,
            )
    print(f"fits below eager or under 0.9x the best fixed scope: {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Steps whose whole step cannot be one graph: ``strategy="cudagraph"`` against the scoped levels and eager.

    PYTHONPATH=. python benchmarks/host_read.py --out benchmarks/results/host_read

The small GPT trains with two ``training_step`` bodies that no whole-step graph can hold:

- ``item``: the step reads ``loss.item()`` (a host read, as logging code does);
- ``mask``: the loss keeps the labels ``>= 0`` by boolean indexing (a count read on the host, a shape that moves).

Variants: eager Lightning; ``CUDAGraphCallback(scope=["layer"])`` (``layer``, the best scoped level before the model
level and the optimizer graph); ``CUDAGraphStrategy(scope=["layer"])`` (``layer-strategy``, with the optimizer graph);
``strategy="cudagraph"`` (``auto``: the ladder, which settles on the model level here). They alternate for
``--rounds`` rounds in one process, in turns (the order reverses every other round). A step time is the CUDA-event
distance between batch starts; each variant's figure is the median of its rounds' medians. Loss parity: the largest
per-step loss difference against eager over the fit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from benchmarks.core import records
from benchmarks.core.figures import spread
from benchmarks.core.models import WARMUP_STEPS, build, graph_callback
from benchmarks.core.timing import StepClock, in_turns, median_of_rounds, round_ms, timing_trainer
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

KINDS = ("item", "mask")
VARIANTS = ("eager", "layer", "layer-strategy", "auto")
MODEL = "small"
#: Goal of the brief: ``strategy="cudagraph"`` at least this much faster per step than the best scoped level before.
GOAL = 1.3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=160, timed=60, rounds=3)
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=3 * WARMUP_STEPS)
    return args


def reading(kind: str, module: pl.LightningModule) -> pl.LightningModule:
    """The module with a ``training_step`` of ``kind`` (a subclass made here, so Lightning sees an ordinary module)."""
    base = type(module)

    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens).reshape(-1, self.hparams.vocab_size)
        labels = targets.reshape(-1)
        if kind == "item":
            loss = F.cross_entropy(logits, labels)
            self.seen = loss.item()
            return loss
        keep = labels >= 0
        return F.cross_entropy(logits[keep], labels[keep])

    module.__class__ = type(f"{base.__name__}_{kind}", (base,), {"training_step": training_step})
    return module


def measure(kind: str, variant: str, steps: int, timed: int) -> dict[str, Any]:
    """Train one variant once: its step times over the last ``timed`` steps, every loss, the level it reached."""
    module, data = build(MODEL)
    module = reading(kind, module)
    strategy: Any = "auto"
    callbacks: list[pl.Callback] = []
    if variant == "layer":
        callbacks.append(CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP_STEPS))
    elif variant == "layer-strategy":
        strategy = CUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP_STEPS)
    elif variant == "auto":
        strategy = "cudagraph"
    clock = StepClock(keep_losses=steps)
    trainer = timing_trainer(steps, [clock, *callbacks], strategy)
    trainer.fit(module, data)
    report = (callback := graph_callback(trainer)) and callback.report
    return {
        "variant": variant,
        **spread(clock.step_times(steps - timed)),
        "losses": clock.first_losses(),
        "level": report.level if report else None,
        "stage": report.stage.name if report else None,
        "reason": report.reason if report else None,
        "optimizer_graph": report.optimizer_graph if report else None,
        "fallbacks": dict(report.fallback_reasons) if report else None,
    }


def case(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant of one kind over the rounds: medians, per-round figures, ratios and loss parity."""
    fits = in_turns(
        VARIANTS,
        args.rounds,
        lambda variant: measure(kind, variant, args.steps, args.timed),
        lambda index, fit: (
            f"[{kind} {index}] {fit['variant']:>15}: {fit['median_ms']:8.3f} ms/step level={fit['level']}"
        ),
    )
    median = median_of_rounds(fits)
    eager_losses = fits["eager"][0]["losses"]
    return {
        "median_ms": median,
        "round_ms": round_ms(fits),
        "vs_eager": {variant: median["eager"] / median[variant] for variant in VARIANTS},
        "auto_vs_layer": median["layer"] / median["auto"],
        "auto_vs_layer_strategy": median["layer-strategy"] / median["auto"],
        "max_loss_diff": {
            variant: max(abs(a - b) for a, b in zip(eager_losses, fits[variant][0]["losses"], strict=True))
            for variant in VARIANTS
        },
        "report": {
            variant: {k: v for k, v in fits[variant][0].items() if k not in ("losses",)} for variant in VARIANTS
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("host_read.py"):
        return 2
    cases = {kind: case(kind, args) for kind in KINDS}
    record = {
        "kind": "host_read",
        "model": MODEL,
        "steps": args.steps,
        "timed": args.timed,
        "rounds": args.rounds,
        "goal": GOAL,
        "cases": cases,
        "environment": records.environment(),
    }
    records.write(record, args.out / "host_read.json")
    for kind, figures in cases.items():
        for variant in VARIANTS:
            rounds = ", ".join(f"{ms:.3f}" for ms in figures["round_ms"][variant])
            level = figures["report"][variant]["level"]
            print(f"{kind} {variant:>15}: median {figures['median_ms'][variant]:.3f} ms/step, "
                  f"{figures['vs_eager'][variant]:.2f}x eager, level {level}, "
                  f"loss diff {figures['max_loss_diff'][variant]:.3g} (rounds {rounds})")  # fmt: skip
        print(f"{kind}: auto {figures['auto_vs_layer']:.3f}x layer, {figures['auto_vs_layer_strategy']:.3f}x "
              f"layer-strategy (goal {GOAL}x over layer)")  # fmt: skip
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

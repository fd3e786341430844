"""Compiled scoped regions once the host no longer paces the step: ``layer`` through the strategy.

    PYTHONPATH=. python benchmarks/scoped_compile.py --out benchmarks/results/scoped_compile

``CUDAGraphStrategy(scope=["layer"])`` replays the optimizer step as a graph of its own, so a model whose kernels
take longer than the host's work per step is paced by the GPU: there the compiled kernels inside the layer graphs
show. The GPTs train in bf16-mixed with ``compile=False`` and ``compile={"regions": True}``, alternated for
``--rounds`` rounds in one process, in turns (the order reverses every other round), and nothing else runs in that
process. ``compile=True`` alone would leave the layer regions uncompiled, so the compiled variant passes
``regions=True``. A step time is the CUDA-event distance between batch starts; each variant's figure is the median of
its rounds' medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.core import records
from benchmarks.core.figures import finite, spread
from benchmarks.core.models import WARMUP_STEPS, build, graph_callback
from benchmarks.core.timing import StepClock, in_turns, median_of_rounds, ratio_per_round, round_ms, timing_trainer
from lightning_cudagraph import CUDAGraphStrategy

VARIANTS = ("layer-strategy", "layer-strategy+compile")
PRECISION = "bf16-mixed"
#: Goal of the brief: compiled regions at least this much faster per step than the same scope without them.
GOAL = 1.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=160, timed=60, rounds=3)
    parser.add_argument("--models", default="medium,small", help="comma-separated from medium, small, tiny")
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=3 * WARMUP_STEPS)
    args.models = records.names(parser, "--models", args.models, ["medium", "small", "tiny"])
    return args


def measure(model: str, variant: str, steps: int, timed: int) -> dict[str, Any]:
    """Train one variant once: its step times over the last ``timed`` steps and the state of its graphs."""
    module, data = build(model)
    compiled: bool | dict[str, bool] = {"regions": True} if variant.endswith("+compile") else False
    strategy = CUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP_STEPS, compile=compiled)
    clock = StepClock()
    trainer = timing_trainer(steps, [clock], strategy, PRECISION)
    trainer.fit(module, data)
    report = (callback := graph_callback(trainer)) and callback.report
    return {
        "variant": variant,
        **spread(clock.step_times(steps - timed)),
        "host_ms": clock.host_median_ms(steps - timed),
        "final_loss": finite(float(clock.last_loss)) if clock.last_loss is not None else None,
        "stage": report.stage.name if report else None,
        "optimizer_graph": report.optimizer_graph if report else None,
        "compile_s": finite(report.compile_s) if report else None,
    }


def case(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both variants of one model over the rounds: medians, per-round figures and the ratio."""
    fits = in_turns(
        VARIANTS,
        args.rounds,
        lambda variant: measure(model, variant, args.steps, args.timed),
        lambda index, fit: f"[{model} {index}] {fit['variant']:>22}: {fit['median_ms']:8.3f} ms/step {fit['stage']}",
    )
    median = median_of_rounds(fits)
    return {
        "median_ms": median,
        "round_ms": round_ms(fits),
        "speedup": median[VARIANTS[0]] / median[VARIANTS[1]],
        "speedup_per_round": ratio_per_round(fits, *VARIANTS),
        "report": {variant: fits[variant][0] for variant in VARIANTS},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("scoped_compile.py"):
        return 2
    models = {model: case(model, args) for model in args.models}
    record = {"kind": "scoped_compile", "precision": PRECISION, "steps": args.steps, "timed": args.timed}
    record.update(rounds=args.rounds, goal=GOAL, models=models, environment=records.environment())
    records.write(record, args.out / "scoped_compile.json")
    for model, figures in models.items():
        per_round = ", ".join(f"{r:.3f}" for r in figures["speedup_per_round"])
        medians = ", ".join(f"{v} {ms:.3f} ms" for v, ms in figures["median_ms"].items())
        print(f"{model}: {medians}; compile {figures['speedup']:.3f}x (rounds {per_round}; goal {GOAL}x)")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

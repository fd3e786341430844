"""What the optimizer step as a graph of its own buys a scoped step: ``scope=["layer"]`` with it and without it.

    PYTHONPATH=. python benchmarks/optimizer_graph.py --out benchmarks/results/optimizer_graph

The small GPT trains in bf16-mixed through ``CUDAGraphStrategy(scope=["layer"])``: its update captured as its own
graph and replayed after the eager backward (the default), and kept eager (``optimizer_graph=False``),
with the AdamW a user writes (PyTorch's default ``foreach`` form). The two alternate for ``--rounds`` rounds in one
process, in turns (which goes first alternates too). A step time is the CUDA-event distance between batch starts; each
variant's figure is the median of its rounds' medians.

Parity, in a first round of its own: the optimizer graph runs AdamW in its fused capturable form for the whole fit,
which rounds differently from the ``foreach`` form, and Adam turns the rounding noise of a gradient that is zero in
exact arithmetic (the key bias of attention) into steps of ``lr`` either way. So the parity fits build AdamW with
``fused=True`` and ``lr=2**-10`` (a float32 learning-rate tensor holds it exactly): eager Lightning against the
optimizer graph, same arithmetic; the largest per-step loss difference and the largest relative parameter difference.
The default-optimizer fits are compared with eager too, for what a user sees.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch

from benchmarks.core import records
from benchmarks.core.figures import finite, spread
from benchmarks.core.models import WARMUP_STEPS, build, config_of, graph_callback, model_args
from benchmarks.core.timing import (
    StepClock,
    fresh_device,
    in_turns,
    median_of_rounds,
    ratio_per_round,
    round_ms,
    timing_trainer,
)
from lightning_cudagraph import CUDAGraphStrategy

VARIANTS = ("layer", "layer+optimizer_graph")
#: The parity fits: the same arithmetic in eager Lightning and under the optimizer graph (see the module's docstring).
PARITY_VARIANTS = ("eager", "eager/fused", "layer+optimizer_graph/fused")
EXACT = {"lr": 2**-10, "fused": True}
MODEL, PRECISION = "small", "bf16-mixed"
#: Goal of the brief: the optimizer graph at least this much faster per step than the same scope without it.
GOAL = 1.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=300, timed=250, rounds=3)
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=WARMUP_STEPS + 3)
    return args


def measure(variant: str, steps: int, timed: int) -> dict[str, Any]:
    """Train one variant once: its step times over the last ``timed`` steps, every loss, the final parameters."""
    from examples.gpt import GPTModule

    base, _, exact = variant.partition("/")
    module, data = build(MODEL)
    if exact:
        pl.seed_everything(0, verbose=False)
        module = GPTModule(**model_args(config_of(MODEL)), **EXACT)
    strategy: Any = "auto"
    if base != "eager":
        strategy = CUDAGraphStrategy(
            scope=["layer"], warmup_steps=WARMUP_STEPS, optimizer_graph=base == "layer+optimizer_graph"
        )
    clock = StepClock(keep_losses=steps)
    trainer = timing_trainer(steps, [clock], strategy, PRECISION)
    trainer.fit(module, data)
    callback = graph_callback(trainer)
    report = callback.report if callback is not None else None
    return {
        "variant": variant,
        **spread(clock.step_times(steps - timed)),
        "losses": clock.first_losses(),
        "params": {name: p.detach().float().cpu() for name, p in module.named_parameters()},
        "stage": None if report is None else report.stage.name,
        "optimizer_graph": None if report is None else report.optimizer_graph,
        "optimizer_replays": None if report is None else report.optimizer_replays,
        "optimizer_parity_err": None if report is None else finite(report.optimizer_parity_err),
        "fallbacks": None if report is None else dict(report.fallback_reasons),
    }


def parity(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Largest per-step loss difference and largest relative parameter difference of ``other`` against ``reference``."""
    loss = max(abs(a - b) for a, b in zip(reference["losses"], other["losses"], strict=True))
    relative = {
        name: float((other["params"][name] - p).norm() / p.norm().clamp_min(1e-12))
        for name, p in reference["params"].items()
    }
    worst = max(relative, key=relative.__getitem__)
    return {"max_loss_diff": loss, "max_rel_param_diff": relative[worst], "worst_param": worst}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("optimizer_graph.py"):
        return 2
    checks: dict[str, dict[str, Any]] = {}
    for variant in PARITY_VARIANTS:
        fresh_device()
        checks[variant] = measure(variant, args.steps, args.timed)
        print(f"[parity] {variant:>27}: {checks[variant]['median_ms']:8.3f} ms/step")
    fits = in_turns(
        VARIANTS,
        args.rounds,
        lambda variant: measure(variant, args.steps, args.timed),
        lambda index, fit: (
            f"[{index}] {fit['variant']:>27}: {fit['median_ms']:8.3f} ms/step {fit['optimizer_graph'] or ''}"
        ),
    )
    median = median_of_rounds(fits)
    per_round = ratio_per_round(fits, "layer", "layer+optimizer_graph")
    speedup = median["layer"] / median["layer+optimizer_graph"]
    first = {variant: fits[variant][0] for variant in VARIANTS}
    record = {
        "kind": "optimizer_graph",
        "model": MODEL,
        "precision": PRECISION,
        "steps": args.steps,
        "timed": args.timed,
        "rounds": args.rounds,
        "median_ms": median,
        "round_ms": round_ms(fits),
        "speedup_per_round": per_round,
        "speedup": speedup,
        "goal": GOAL,
        "eager_ms": checks["eager"]["median_ms"],
        "parity_same_arithmetic": parity(checks["eager/fused"], checks["layer+optimizer_graph/fused"]),
        "parity_default_optimizer": {variant: parity(checks["eager"], first[variant]) for variant in VARIANTS},
        "report": {
            variant: {k: v for k, v in fit.items() if k not in ("losses", "params")}
            for variant, fit in [*first.items(), *checks.items()]
        },
        "environment": records.environment(),
    }
    records.write(record, args.out / "optimizer_graph.json")
    for variant in VARIANTS:
        rounds = ", ".join(f"{ms:.3f}" for ms in record["round_ms"][variant])
        print(f"{variant:>22}: median {median[variant]:.3f} ms/step (rounds {rounds})")
    print(f"optimizer graph: {speedup:.3f}x per step (rounds {', '.join(f'{r:.3f}' for r in per_round)}; goal {GOAL}x)")
    print(f"eager Lightning: {record['eager_ms']:.3f} ms/step")
    print(f"parity, fused AdamW lr=2**-10, eager vs optimizer graph: {record['parity_same_arithmetic']}")
    for variant, figures in record["parity_default_optimizer"].items():
        print(f"parity, default AdamW, eager vs {variant}: {figures}")
    print(f"optimizer graph report: {record['report']['layer+optimizer_graph']}")
    print(f"optimizer graph report (parity fit): {record['report']['layer+optimizer_graph/fused']}")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

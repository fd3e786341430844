"""Gradient accumulation inside the whole step: speed per sample against eager and a 4x micro-batch, and parity.

    PYTHONPATH=. python benchmarks/accumulation.py --out benchmarks/results/accumulation

On the small GPT and a Hugging Face Llama (small configs), each variant trains with gradient clipping and a
step-wise scheduler, in alternated rounds in one process:
``eager`` (accumulate 4), ``full_iteration`` (``cudagraph_full``, accumulate 4), ``full_iteration_x4`` (accumulate 1,
four times the micro-batch), ``layer`` (``CUDAGraphCallback(scope=["layer"])``, accumulate 4), ``layer-strategy``
(``CUDAGraphStrategy(scope=["layer"])``: the same regions, and the optimizer step as a graph of its own) and
``auto-callback`` (``CUDAGraphCallback()``, timed on its last ``--timed`` optimizer steps, after the ladder settled).
A micro-batch's time is the GPU-timeline distance between batch starts (CUDA events); the table compares
milliseconds per sample.
Parity: eager and ``full_iteration`` train ``--parity-steps`` optimizer steps from the same weights on the same
batches; the largest loss difference and the largest relative parameter difference are printed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from benchmarks.core import records
from benchmarks.core.figures import finite, spread
from benchmarks.core.models import build, config_of, graph_callback
from benchmarks.core.timing import StepClock, alternate, peak_memory
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

ACCUMULATE = 4
VARIANTS = ("eager", "full_iteration", "full_iteration_x4", "layer", "layer-strategy", "auto-callback")
#: Optimizer steps of an ``auto-callback`` fit: the ladder climbs four scoped levels before it settles.
AUTO_STEPS = 150
MODELS = ("small", "llama")
WARMUP = 3
#: The figures printed per variant.
SHOWN = ("median_ms", "ms_per_sample", "x_eager", "x_full_iteration", "peak_mib", "stage", "level", "replays")
SHOWN += ("optimizer_graph", "max_loss_diff")
SHOWN += ("max_rel_param_diff", "worst_param", "fallbacks", "reason")


def trainer_for(variant: str, steps: int, clock: StepClock, accumulate: int) -> Any:
    import lightning.pytorch as pl

    strategy: Any = "auto"
    callbacks: list[Any] = [clock]
    if variant.startswith("full_iteration"):
        strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
    elif variant == "layer":
        callbacks.append(CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP))
    elif variant == "layer-strategy":
        strategy = CUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP)
    elif variant == "auto-callback":
        callbacks.append(CUDAGraphCallback(warmup_steps=WARMUP))
    return pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=steps, callbacks=callbacks,
                      accumulate_grad_batches=accumulate, gradient_clip_val=1.0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip


def with_scheduler(module: Any) -> Any:
    """The module's optimizer with a step-wise StepLR (the graph must read the learning rate it sets)."""
    configure = module.configure_optimizers

    def configure_optimizers() -> Any:
        optimizer = configure()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    return module


def measure(model: str, variant: str, steps: int, keep: int = 0, timed: int | None = None) -> dict[str, Any]:
    """One fit of ``steps`` optimizer steps: micro-batch times, ms per sample, memory, the report, losses.

    ``timed``: time only the last ``timed`` optimizer steps (``None``: every step after warmup and confirmation).
    """
    micro = config_of(model)["batch_size"]
    big = variant == "full_iteration_x4"
    accumulate, batch = (1, micro * ACCUMULATE) if big else (ACCUMULATE, micro)
    module, data = build(model, "eager", batch)
    module = with_scheduler(module)
    clock = StepClock(keep_losses=keep)
    trainer = trainer_for(variant, steps, clock, accumulate)
    with peak_memory() as peak:
        trainer.fit(module, data)
    skip = (WARMUP + 4) * accumulate if timed is None else (steps - timed) * accumulate
    times = spread(clock.step_times(skip))
    callback = graph_callback(trainer)
    report = None if callback is None else callback.report
    median = times.get("median_ms")
    return {
        "variant": variant,
        "model": model,
        "batch_size": batch,
        "accumulate": accumulate,
        **times,
        "ms_per_sample": None if median is None else median / batch,
        "peak_mib": finite(peak()),
        "stage": None if report is None else report.stage.name,
        "level": None if report is None else report.level,
        "optimizer_graph": None if report is None else report.optimizer_graph,
        "captures": None if report is None else report.captures,
        "replays": None if report is None else report.replays,
        "fallbacks": None if report is None else dict(report.fallback_reasons),
        "reason": None if report is None else report.reason,
        "losses": clock.first_losses(),
        "params": {name: p.detach().float().cpu() for name, p in module.named_parameters()},
    }


def parity(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Largest per-micro-batch loss difference, and largest relative parameter difference, against ``reference``."""
    loss = max(abs(a - b) for a, b in zip(reference["losses"], other["losses"], strict=True))
    diffs = {
        k: float((other["params"][k] - p).norm() / p.norm().clamp_min(1e-12)) for k, p in reference["params"].items()
    }
    worst = max(diffs, key=diffs.__getitem__)
    return {"max_loss_diff": loss, "max_rel_param_diff": diffs[worst], "worst_param": worst}


def timed_fit(model: str, variant: str, args: Any) -> dict[str, Any]:
    """One timed fit; ``auto-callback`` runs long enough to settle, and is timed on its last ``args.timed`` steps."""
    if variant == "auto-callback":
        return measure(model, variant, max(AUTO_STEPS, args.steps), timed=args.timed)
    return measure(model, variant, args.steps)


def main(argv: list[str] | None = None) -> int:
    parser = records.timed_parser(__doc__, steps=30, timed=20, rounds=3)
    parser.add_argument("--parity-steps", type=int, default=100, help="optimizer steps of the parity fits")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"environment": records.environment(), "accumulate": ACCUMULATE, "models": {}}
    for model in args.models.split(","):
        fits = alternate(VARIANTS, args.rounds, lambda variant, model=model: timed_fit(model, variant, args))
        by = {fit["variant"]: fit for fit in fits}
        eager, full = by["eager"].get("ms_per_sample"), by["full_iteration"].get("ms_per_sample")
        rows = {}
        for fit in fits:
            ms = fit.get("ms_per_sample")
            rows[fit["variant"]] = {
                **{k: v for k, v in fit.items() if k not in ("losses", "params")},
                "x_eager": None if ms is None or eager is None else eager / ms,
                "x_full_iteration": None if ms is None or full is None else full / ms,
            }
        steps = args.parity_steps
        eager_fit = measure(model, "eager", steps, keep=steps * ACCUMULATE)
        graph_fit = measure(model, "full_iteration", steps, keep=steps * ACCUMULATE)
        rows["parity"] = {**parity(eager_fit, graph_fit), "steps": steps, "stage": graph_fit["stage"],
                          "replays": graph_fit["replays"], "fallbacks": graph_fit["fallbacks"]}  # fmt: skip
        results["models"][model] = rows
        for name, row in rows.items():
            shown = {k: row.get(k) for k in SHOWN}
            print(model, name, json.dumps(shown, default=str))
    records.write(results, args.out / "accumulation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

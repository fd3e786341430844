"""Evaluation graphs: a validation loop of 200 batches, eager Lightning against ``strategy="cudagraph_full"``.

    PYTHONPATH=. python3 benchmarks/evaluation.py --models small llama --batches 200 --rounds 3

The same weights and the same batches for both ways, alternated for ``--rounds`` rounds in one process. Two figures
per loop: the steady batch time (CUDA events at each batch start, from batch 10 to the loop's end, read once after
the loop) and the whole ``trainer.validate()`` call (a device sync at both ends: the graphed one includes its eager
warmup batch, its capture and its release). The ratios are eager over graphed; the logged ``val_loss`` of both and
the memory the evaluation graphs took are printed.

``--regions`` adds the callback's way on the first model: a short fit (8 steps) through ``CUDAGraphCallback(scope=
["layer"])`` then one validation of the same batches, against the same fit and validation in eager Lightning; the
regions' forward-only graphs serve the validation (steady batch time, as above).
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
from torch.utils.data import DataLoader

from benchmarks.core.models import build, config_of
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

SKIP = 10
WAYS = ("eager", "graphed")


class BatchClock(pl.Callback):
    """A CUDA event at every validation batch start, and one at the loop's end."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int, dl: int = 0) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def steady_ms(self) -> float:
        """Milliseconds per batch from batch ``SKIP`` to the loop's end (one sync, on the last event)."""
        self.events[-1].synchronize()
        first, last = self.events[SKIP], self.events[-1]
        return first.elapsed_time(last) / (len(self.events) - 1 - SKIP)


def batches(model_name: str, count: int, vocab: int) -> DataLoader:
    """``count`` fixed batches ``(x, y)`` made up front (the loader adds no collation to either way)."""
    config = config_of(model_name)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (count, config["batch_size"], config["seq_len"] + 1), generator=generator)
    data = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in tokens]
    return DataLoader(data, batch_size=None)


def validate(module: pl.LightningModule, loader: DataLoader, way: str, count: int) -> dict[str, Any]:
    """One validation loop of ``count`` batches, timed."""
    clock = BatchClock()
    strategy = CUDAGraphStrategy(scope=["full_iteration"]) if way == "graphed" else "auto"
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=count,
        callbacks=[clock],
    )
    torch.cuda.synchronize()
    started = time.perf_counter()
    results = trainer.validate(module, loader, verbose=False)
    torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - started) * 1e3
    record: dict[str, Any] = {"steady_ms": clock.steady_ms(), "loop_ms": loop_ms, "val_loss": results[0]["val_loss"]}
    if way == "graphed":
        evaluation = trainer.strategy.rollout.report.evaluation
        record.update(
            captures=evaluation.captures,
            replays=evaluation.replays,
            memory_mib=evaluation.memory_mib,
            capture_ms=evaluation.capture_ms,
            reason=evaluation.reason,
        )
    return record


def fit_then_validate(name: str, loader: DataLoader, way: str, count: int) -> dict[str, Any]:
    """A fit of 8 steps (eager, or through the callback's ``layer`` graphs), then a validation of ``count`` batches."""
    module, data = build(name)
    data.setup("fit")
    clock = BatchClock()
    graphs = CUDAGraphCallback(scope=["layer"]) if way == "regions" else None
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=8,
        val_check_interval=8,
        check_val_every_n_epoch=None,
        limit_val_batches=count,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock] + ([graphs] if graphs is not None else []),
    )
    trainer.fit(module, train_dataloaders=data.train_dataloader(), val_dataloaders=loader)
    record: dict[str, Any] = {"steady_ms": clock.steady_ms(), "val_loss": float(trainer.callback_metrics["val_loss"])}
    if graphs is not None:
        evaluation = graphs.report.evaluation
        record.update(mode=evaluation.mode, captures=evaluation.captures, memory_mib=evaluation.memory_mib)
    return record


def run_regions(name: str, count: int, rounds: int) -> dict[str, Any]:
    """Alternated rounds of eager and the callback's regions way on one model."""
    module, _ = build(name)
    loader = batches(name, count, module.hparams.vocab_size)
    seen: dict[str, list[dict[str, Any]]] = {"eager": [], "regions": []}
    for _ in range(rounds):
        for way in seen:
            seen[way].append(fit_then_validate(name, loader, way, count))
    eager_ms = statistics.median(r["steady_ms"] for r in seen["eager"])
    regions_ms = statistics.median(r["steady_ms"] for r in seen["regions"])
    last = seen["regions"][-1]
    return {
        "model": name,
        "eager_steady_ms": eager_ms,
        "regions_steady_ms": regions_ms,
        "speedup": eager_ms / regions_ms,
        "val_loss_abs_diff": abs(seen["eager"][-1]["val_loss"] - last["val_loss"]),
        "mode": last["mode"],
        "captures": last["captures"],
        "memory_mib": last["memory_mib"],
    }


def run_model(name: str, count: int, rounds: int) -> dict[str, Any]:
    """Alternated rounds of both ways on one model; the medians and the ratios."""
    module, _ = build(name)
    vocab = module.hparams.vocab_size
    loader = batches(name, count, vocab)
    module.cuda()
    validate(module, loader, "eager", min(count, SKIP + 5))  # cuDNN/cuBLAS handles and kernels, for both ways
    seen: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            seen[way].append(validate(module, loader, way, count))
    summary: dict[str, Any] = {"model": name, "batches": count, "rounds": rounds}
    for way in WAYS:
        summary[f"{way}_steady_ms"] = statistics.median(r["steady_ms"] for r in seen[way])
        summary[f"{way}_loop_ms"] = statistics.median(r["loop_ms"] for r in seen[way])
        summary[f"{way}_val_loss"] = seen[way][-1]["val_loss"]
    graphed = seen["graphed"][-1]
    summary.update(
        steady_speedup=summary["eager_steady_ms"] / summary["graphed_steady_ms"],
        loop_speedup=summary["eager_loop_ms"] / summary["graphed_loop_ms"],
        val_loss_abs_diff=abs(summary["eager_val_loss"] - summary["graphed_val_loss"]),
        val_loss_equal=summary["eager_val_loss"] == summary["graphed_val_loss"],
        memory_mib=graphed["memory_mib"],
        capture_ms=graphed["capture_ms"],
        captures=graphed["captures"],
        replays=graphed["replays"],
        reason=graphed["reason"],
        rounds_steady_speedup=[
            round(e["steady_ms"] / g["steady_ms"], 3) for e, g in zip(seen["eager"], seen["graphed"], strict=True)
        ],
    )
    return summary


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "llama"])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--regions", action="store_true", help="add the callback's way (scoped layer graphs)")
    args = parser.parse_args(argv)
    if args.batches <= SKIP + 1:
        parser.error(f"--batches must be more than {SKIP + 1} (the first {SKIP} batches are not timed)")
    summaries = []
    for name in args.models:
        summary = run_model(name, args.batches, args.rounds)
        summaries.append(summary)
        print(
            f"{name}: validation of {args.batches} batches, median of {args.rounds} alternated rounds:"
            f" eager {summary['eager_steady_ms']:.3f} ms/batch, graphed {summary['graphed_steady_ms']:.3f} ms/batch,"
            f" steady speedup {summary['steady_speedup']:.2f}x (rounds {summary['rounds_steady_speedup']});"
            f" whole loop eager {summary['eager_loop_ms']:.1f} ms, graphed {summary['graphed_loop_ms']:.1f} ms"
            f" ({summary['loop_speedup']:.2f}x, capture and release included);"
            f" val_loss eager {summary['eager_val_loss']:.8f} graphed {summary['graphed_val_loss']:.8f}"
            f" (abs diff {summary['val_loss_abs_diff']:.2e}); evaluation graphs {summary['memory_mib']:.1f} MiB,"
            f" {summary['captures']} capture(s) in {summary['capture_ms']:.1f} ms, {summary['replays']} replays,"
            f" reason {summary['reason']}",
            flush=True,
        )
    if args.regions:
        regions = run_regions(args.models[0], args.batches, args.rounds)
        summaries.append(regions)
        print(
            f"{regions['model']} through CUDAGraphCallback(scope=['layer']) after an 8-step fit: eager"
            f" {regions['eager_steady_ms']:.3f} ms/batch, regions {regions['regions_steady_ms']:.3f} ms/batch,"
            f" speedup {regions['speedup']:.2f}x; mode {regions['mode']}, {regions['captures']} forward-only graphs,"
            f" {regions['memory_mib']:.1f} MiB; val_loss abs diff {regions['val_loss_abs_diff']:.2e} (trained apart)",
            flush=True,
        )
    return summaries


if __name__ == "__main__":
    main()

"""Variable sequence lengths on the GPU: bucketed padding and the per-shape graph cache against one fixed length.

Lengths are drawn from a fixed seeded distribution (uniform 32..512), grouped by length into batches (as Hugging
Face's ``group_by_length`` does, so batches span every bucket) and padded to 8 buckets (64, 128, ..., 512)
by :class:`lightning_cudagraph.bucketing.PadToBucket`; the same model then trains on every sequence padded to one
fixed length (the mean padded length). For eager Lightning, ``scope=["layer"]`` and ``cudagraph_full``, each in one
process: GPU time over the timed steps (CUDA events at every batch start, read once at the end), the speedup over
eager on the same batches, the graph pool, the share of steps that replayed after every bucket was captured, and
the per-step loss difference against eager.

    python benchmarks/shapes.py --out benchmarks/results/shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.variants import StepClock, timing_trainer
from examples.gpt import GPTModule
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy
from lightning_cudagraph.bucketing import PadToBucket, bucket_length

BUCKETS = [64, 128, 192, 256, 320, 384, 448, 512]
BATCH, VOCAB = 8, 1024


def samples(count: int, fixed: int | None, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, targets)`` pairs, lengths uniform in 32..512 (or all ``fixed``); padded targets are -100."""
    generator = torch.Generator().manual_seed(seed)
    lengths = grouped_by_length(torch.randint(32, 513, (count,), generator=generator).tolist(), generator)
    out = []
    for length in lengths:
        tokens = torch.randint(VOCAB, (length + 1,), generator=generator)
        out.append((tokens[:-1], tokens[1:]) if fixed is None else _padded(tokens, fixed))
    return out


def grouped_by_length(lengths: list[int], generator: torch.Generator, group: int = 8 * BATCH) -> list[int]:
    """Lengths ordered so that each batch holds similar ones (Hugging Face's ``group_by_length`` does the same):
    sorted within groups of 8 batches, whose batch order is then shuffled."""
    ordered = []
    for start in range(0, len(lengths), group):
        chunk = sorted(lengths[start : start + group], reverse=True)
        batches = [chunk[i : i + BATCH] for i in range(0, len(chunk), BATCH)]
        for index in torch.randperm(len(batches), generator=generator).tolist():
            ordered.extend(batches[index])
    return ordered


def _padded(tokens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.zeros(length, dtype=torch.long), torch.full((length,), -100, dtype=torch.long)
    n = min(length, len(tokens) - 1)
    x[:n], y[:n] = tokens[:n], tokens[1 : n + 1]
    return x, y


class Watch(pl.Callback):
    """Per step: the loss (kept on the device) and whether the step replayed (host counters of the report)."""

    def __init__(self, callback_of: Any) -> None:
        self.callback_of = callback_of
        self.losses: list[torch.Tensor] = []
        self.replayed: list[int] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(outputs["loss"].detach().clone())
        report = self.callback_of(trainer)
        self.replayed.append(report.steps_replayed if report is not None else 0)


def graph_report(trainer: pl.Trainer) -> Any:
    found = [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)]
    return found[0].report if found else None


def build_model(name: str) -> pl.LightningModule:
    """The small GPT of ``examples/gpt.py``, or the Llama of ``examples/hf_causal_lm.py``, for 512 positions."""
    if name == "gpt":
        return GPTModule(vocab_size=VOCAB, seq_len=BUCKETS[-1], n_layer=6, width=256, heads=4)
    from examples.hf_causal_lm import HFCausalLM  # its loss ignores padded positions (targets -100)

    return HFCausalLM(kind="llama", vocab_size=VOCAB, max_position_embeddings=BUCKETS[-1])


def run(variant: str, data: list, steps: int, skip: int, model_name: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = build_model(model_name)
    loader = DataLoader(data, batch_size=BATCH, collate_fn=PadToBucket(buckets=BUCKETS, pad_values={1: -100}))
    clock, watch = StepClock(), Watch(graph_report)
    callbacks: list[pl.Callback] = [clock, watch]
    strategy: Any = "auto"
    recapture = {"on_shape_change": "recapture", "max_graphs": len(BUCKETS)}
    if variant == "layer":
        callbacks.insert(0, CUDAGraphCallback(scope=["layer"], **recapture))
    elif variant == "full":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], **recapture)
    trainer = timing_trainer(steps, callbacks, strategy)
    trainer.fit(model, loader)
    times = clock.step_times(skip)
    report = graph_report(trainer)
    replayed = [b - a for a, b in zip(watch.replayed, watch.replayed[1:], strict=False)]
    return {
        "variant": variant,
        "total_ms": sum(times),
        "median_ms": statistics.median(times),
        "losses": torch.stack(watch.losses).float().cpu().tolist(),
        "stage": int(report.stage) if report else None,
        "reason": report.reason if report else None,
        "captures": report.captures if report else 0,
        "evictions": report.evictions if report else 0,
        "pool_mib": report.pool_mib if report else 0.0,
        "replayed_after_skip": sum(replayed[skip:]) / max(len(replayed[skip:]), 1) if report else 0.0,
    }


def summary(model_name: str, results: dict[str, dict[str, Any]], fixed_length: int, args: Any) -> str:
    """One Markdown table: each graphed variant's speedup on variable vs fixed lengths, memory, replays, parity."""
    rows = []
    for variant in ("layer", "full"):
        var, fix = results[f"{variant}/variable"], results[f"{variant}/fixed"]
        speed_var = results["eager/variable"]["total_ms"] / var["total_ms"]
        speed_fix = results["eager/fixed"]["total_ms"] / fix["total_ms"]
        eager_losses = results["eager/variable"]["losses"][:20]
        parity = max(abs(a - b) for a, b in zip(var["losses"][:20], eager_losses, strict=True))
        rows.append(
            f"| {variant} | {speed_var:.2f}x | {speed_fix:.2f}x | {speed_var / speed_fix:.2f} | {var['pool_mib']:.0f}"
            f" | {fix['pool_mib']:.0f} | {var['pool_mib'] / max(fix['pool_mib'], 1e-9):.2f} | {var['captures']}"
            f" | {var['replayed_after_skip']:.3f} | {parity:.1e} |"
        )
    name = {"gpt": "small GPT (6 layers, width 256)", "llama": "transformers Llama (4 layers, width 256)"}[model_name]
    return "\n".join([
        f"**{name}**: lengths 32..512 padded to {len(BUCKETS)} buckets vs one fixed length ({fixed_length}),"
        f" batch {BATCH}, fp32, {args.steps} steps, the first {args.skip} not timed; GPU time of the median of"
        f" {args.rounds} round-robin rounds.",
        "",
        "| variant | speedup, variable | speedup, fixed | ratio | pool MiB, 8 buckets | pool MiB, 1 | pool ratio |"
        " captures | replayed after the first epoch of buckets | loss diff, 20 steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=40, help="steps not timed: warmup and the captures of every bucket")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin repeats; the median round is reported")
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt (small GPT), llama (transformers)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/shapes.py measures CUDA graphs and needs a CUDA GPU; none is visible here.")
    os.makedirs(args.out, exist_ok=True)
    variable = samples(args.steps * BATCH, fixed=None)
    mean_padded = statistics.mean(bucket_length(len(x), BUCKETS) for x, _ in variable)
    fixed_length = bucket_length(round(mean_padded), BUCKETS)
    fixed = samples(args.steps * BATCH, fixed=fixed_length)
    tables, records = [], {}
    for model_name in args.models.split(","):
        rounds: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):  # round robin, so that drifts of the host hit every variant alike
            for data_name, data in (("variable", variable), ("fixed", fixed)):
                for variant in ("eager", "layer", "full"):
                    result = run(variant, data, args.steps, args.skip, model_name)
                    rounds.setdefault(f"{variant}/{data_name}", []).append(result)
        results: dict[str, dict[str, Any]] = {}
        for name, runs in rounds.items():
            result = sorted(runs, key=lambda r: r["total_ms"])[len(runs) // 2]  # the median round
            result["rounds_total_ms"] = [r["total_ms"] for r in runs]
            results[name] = result
            variant, data_name = name.split("/")
            print(f"{model_name} {variant:6s} {data_name:9s} {result['median_ms']:8.3f} ms/step"
                  f"  total {result['total_ms']:9.1f} ms (rounds {[round(t) for t in result['rounds_total_ms']]})"
                  f"  captures {result['captures']}  pool {result['pool_mib']:.0f} MiB  stage {result['stage']}"
                  f"  replayed {result['replayed_after_skip']:.3f}", flush=True)  # fmt: skip
        records[model_name] = results
        tables.append(summary(model_name, results, fixed_length, args))
    table = "\n\n".join(tables)
    print(table)
    with open(os.path.join(args.out, "shapes.json"), "w") as handle:
        json.dump({"fixed_length": fixed_length, "buckets": BUCKETS, "models": records}, handle, indent=1)
    with open(os.path.join(args.out, "SHAPES.md"), "w") as handle:
        handle.write(table + "\n")


if __name__ == "__main__":
    main()

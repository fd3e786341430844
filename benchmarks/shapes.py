"""Variable sequence lengths: bucketed padding and the per-shape graph cache against one fixed length.

    PYTHONPATH=. python benchmarks/shapes.py --out benchmarks/results/shapes

Lengths uniform in 32..512, grouped by length into batches (as Hugging Face's ``group_by_length`` does) and padded
by ``PadToBucket`` to 8 buckets; the same model then trains on every sequence padded to one fixed length (the mean
padded length). Eager Lightning, ``scope=["layer"]`` and ``cudagraph_full`` with ``on_shape_change="recapture"``, in
round-robin rounds (the median round counts): GPU time over the timed steps, the graph pool, the share of steps that
replayed once every bucket was captured, and the per-step loss against eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.models import graph_callback
from benchmarks.core.timing import StepClock, timing_trainer
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy
from lightning_cudagraph.bucketing import PadToBucket, bucket_length

BUCKETS = [64, 128, 192, 256, 320, 384, 448, 512]
BATCH, VOCAB = 8, 1024


def grouped_by_length(lengths: list[int], generator: torch.Generator, group: int = 8 * BATCH) -> list[int]:
    """Lengths ordered so each batch holds similar ones: sorted within groups of 8 batches, batch order shuffled."""
    ordered = []
    for start in range(0, len(lengths), group):
        chunk = sorted(lengths[start : start + group], reverse=True)
        batches = [chunk[i : i + BATCH] for i in range(0, len(chunk), BATCH)]
        for index in torch.randperm(len(batches), generator=generator).tolist():
            ordered.extend(batches[index])
    return ordered


def samples(count: int, fixed: int | None, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, targets)`` pairs, lengths uniform in 32..512 (or all padded to ``fixed``; padded targets -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in grouped_by_length(torch.randint(32, 513, (count,), generator=generator).tolist(), generator):
        tokens = torch.randint(VOCAB, (length + 1,), generator=generator)
        if fixed is None:
            out.append((tokens[:-1], tokens[1:]))
            continue
        x, y = torch.zeros(fixed, dtype=torch.long), torch.full((fixed,), -100, dtype=torch.long)
        n = min(fixed, length)
        x[:n], y[:n] = tokens[:n], tokens[1 : n + 1]
        out.append((x, y))
    return out


class Watch(pl.Callback):
    """Per step: the loss (kept on the device) and the report's count of replayed steps."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.replayed: list[int] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.losses.append(outputs["loss"].detach().clone())
        callback = graph_callback(trainer)
        self.replayed.append(callback.report.steps_replayed if callback is not None else 0)


def build_model(name: str) -> pl.LightningModule:
    """The small GPT, or the Llama of ``examples/hf_causal_lm.py``, for 512 positions."""
    if name == "gpt":
        from examples.gpt import GPTModule

        return GPTModule(vocab_size=VOCAB, seq_len=BUCKETS[-1], n_layer=6, width=256, heads=4)
    from examples.hf_causal_lm import HFCausalLM

    return HFCausalLM(kind="llama", vocab_size=VOCAB, max_position_embeddings=BUCKETS[-1])


def run(variant: str, data: list, steps: int, skip: int, model_name: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = build_model(model_name)
    loader: DataLoader[Any] = DataLoader(
        data,  # type: ignore[arg-type]
        batch_size=BATCH,
        collate_fn=PadToBucket(buckets=BUCKETS, pad_values={1: -100}),
    )
    clock, watch = StepClock(), Watch()
    recapture: dict[str, Any] = {"on_shape_change": "recapture", "max_graphs": len(BUCKETS)}
    callbacks: list[pl.Callback] = [clock, watch]
    strategy: Any = "auto"
    if variant == "layer":
        callbacks.insert(0, CUDAGraphCallback(scope=["layer"], **recapture))
    elif variant == "full":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], **recapture)
    trainer = timing_trainer(steps, callbacks, strategy)
    trainer.fit(model, loader)
    times = clock.step_times(skip)
    callback = graph_callback(trainer)
    report_ = None if callback is None else callback.report
    replayed = [b - a for a, b in zip(watch.replayed, watch.replayed[1:], strict=False)][skip:]
    return {
        "variant": variant, "total_ms": sum(times), "median_ms": statistics.median(times),
        "losses": torch.stack(watch.losses).float().cpu().tolist(),
        "stage": int(report_.stage) if report_ else None, "reason": report_.reason if report_ else None,
        "captures": report_.captures if report_ else 0, "evictions": report_.evictions if report_ else 0,
        "pool_mib": report_.pool_mib if report_ else 0.0,
        "replayed_after_skip": sum(replayed) / max(len(replayed), 1) if report_ else 0.0,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=40, help="steps not timed: warmup and the captures of every bucket")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin repeats; the median round is reported")
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt (small GPT), llama (transformers)")
    args = parser.parse_args(argv)
    models = records.names(parser, "--models", args.models, ["gpt", "llama"])
    if records.needs_cuda("shapes.py"):
        return 2
    variable = samples(args.steps * BATCH, fixed=None)
    fixed_length = bucket_length(round(statistics.mean(bucket_length(len(x), BUCKETS) for x, _ in variable)), BUCKETS)
    fixed = samples(args.steps * BATCH, fixed=fixed_length)
    measured = {}
    for model in models:
        rounds: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):  # round robin, so that drifts of the host hit every variant alike
            for data_name, data in (("variable", variable), ("fixed", fixed)):
                for variant in ("eager", "layer", "full"):
                    result = run(variant, data, args.steps, args.skip, model)
                    rounds.setdefault(f"{variant}/{data_name}", []).append(result)
                    print(f"{model} {variant} {data_name}: {result['median_ms']:.3f} ms/step", flush=True)
        measured[model] = {
            name: {
                **sorted(runs, key=lambda r: r["total_ms"])[len(runs) // 2],
                "rounds_total_ms": [r["total_ms"] for r in runs],
            }
            for name, runs in rounds.items()
        }
    record = {"kind": "shapes", "fixed_length": fixed_length, "buckets": BUCKETS, "steps": args.steps}
    record.update(skip=args.skip, environment=records.environment(), models=measured)
    report.publish(args.out, records.write(record, args.out / "shapes.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure every way of training the same model, in one process: ``python benchmarks/run.py --config small``.

Prints a Markdown table and writes ``results.json`` and ``results.md`` (and charts with ``--charts``) to ``--out``.
On a machine without CUDA it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.variants import CONFIGS, LIGHTNING_VARIANTS, PYTORCH_VARIANTS, Result, run_variant

DEFAULT_VARIANTS = (
    "eager",
    "attn",
    "attn+mlp",
    "layer",
    "handwritten_layer",
    "full_iteration",
    "pytorch_eager",
    "pytorch_block_graphs",
    "pytorch_full_graph",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated, or 'all'")
    parser.add_argument("--steps", type=int, default=80, help="training steps per variant")
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the timing (warmup, capture)")
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/run.py measures CUDA graphs and needs a CUDA GPU; none is visible here.")
        return 2
    names = (*LIGHTNING_VARIANTS, *PYTORCH_VARIANTS) if args.variants == "all" else args.variants.split(",")
    config = CONFIGS[args.config]
    results = []
    for name in names:
        result = run_variant(name, config, args.precision, args.steps, args.skip)
        results.append(result)
        print(f"{name:>26}: {result.median_ms:8.3f} ms/step  {result.note}", flush=True)
    table = markdown_table(results, args)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stem = f"{args.config}_{args.precision}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as handle:
        json.dump(
            {"environment": environment(), "args": vars(args), "results": [as_dict(r) for r in results]},
            handle,
            indent=2,
        )
    with open(os.path.join(args.out, f"{stem}.md"), "w") as handle:
        handle.write(table + "\n")
    return 0


def environment() -> dict[str, str]:
    import lightning

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "date": date.today().isoformat(),
    }


def as_dict(result: Result) -> dict[str, object]:
    low, high = result.spread_ms
    return {
        "variant": result.variant,
        "median_ms": result.median_ms,
        "p25_ms": low,
        "p75_ms": high,
        "steps_timed": len(result.step_ms),
        "peak_mib": result.peak_mib,
        "pool_mib": result.pool_mib,
        "capture_ms": result.capture_ms,
        "replays": result.replays,
        "fallbacks": result.fallbacks,
        "final_loss": result.final_loss,
        "note": result.note,
    }


def markdown_table(results: list[Result], args: argparse.Namespace) -> str:
    by_name = {r.variant: r for r in results}
    eager = by_name.get("eager")
    rows = [
        f"{args.config} config, {args.precision}, {environment()['gpu']}, torch {torch.__version__}",
        "",
        "| variant | median ms/step | p25-p75 | vs eager Lightning | peak MiB | graph pool MiB | capture ms"
        " | final loss | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        low, high = r.spread_ms
        speedup = eager.median_ms / r.median_ms if eager and r.median_ms == r.median_ms else float("nan")
        rows.append(
            f"| {r.variant} | {r.median_ms:.3f} | {low:.2f}-{high:.2f} | {speedup:.2f}x | {r.peak_mib:.0f} |"
            f" {r.pool_mib:.1f} | {r.capture_ms:.0f} | {r.final_loss:.4f} | {r.note} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())

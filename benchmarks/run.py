"""Measure every way of training the same GPT, in one process, variants alternated in turns.

    PYTHONPATH=. python benchmarks/run.py --config small                # one config and precision
    PYTHONPATH=. python benchmarks/run.py --sweep batch --config small  # batch sizes 1..256
    PYTHONPATH=. python benchmarks/run.py --suite readme                # every run behind the docs' tables

Writes one JSON record per config and precision (``small_32-true.json``, ``sweep_batch_small_32-true.json``) to
``--out`` and regenerates ``RESULTS.md`` and the charts there (``python benchmarks/report.py DIR`` does the same
without a GPU). Without CUDA it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.models import COMPILE_VARIANTS, CONFIGS, KNOWN_VARIANTS, TE_VARIANTS, model_args, train
from benchmarks.core.timing import alternate

DEFAULT: tuple[str, ...] = ("eager", "attn", "attn+mlp", "layer", "handwritten_layer", "full_iteration")
DEFAULT += ("pytorch_eager", "pytorch_block_graphs", "pytorch_full_graph")
MOE = ("eager", "moe_router+preprocess", "layer", "full_iteration")
SWEEP = ("eager", "layer", "full_iteration", "pytorch_full_graph")
SWEEP_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALL = (*DEFAULT, "mlp", *COMPILE_VARIANTS)


@dataclass(frozen=True)
class Spec:
    """One config and precision over a list of variants (at several batch sizes for a sweep)."""

    config: str
    precision: str
    variants: tuple[str, ...]
    steps: int = 80
    skip: int = 20
    rounds: int = 1
    batch_sizes: tuple[int, ...] = ()  # a sweep where given

    @property
    def stem(self) -> str:
        te = "_te" if all(v in TE_VARIANTS for v in self.variants) else ""
        return f"{'sweep_batch_' if self.batch_sizes else ''}{self.config}_{self.precision}{te}"


def readme_plan() -> list[Spec]:
    """The runs behind the docs' tables (``--suite readme``); the compile variants run last (their caches stay)."""
    medium = ("eager", "layer", "full_iteration", "pytorch_full_graph")
    bf16 = ("eager", "layer", "full_iteration", "pytorch_full_graph", "compile_reduce_overhead")
    return [
        *(Spec("small", p, TE_VARIANTS) for p in ("bf16-mixed", "transformer-engine")),
        Spec("small", "32-true", ALL, rounds=3),
        Spec("small", "bf16-mixed", bf16, rounds=3),
        *(Spec("medium", p, medium, steps=30, skip=10) for p in ("32-true", "bf16-mixed")),
        *(Spec("moe", p, MOE) for p in ("32-true", "bf16-mixed")),
        Spec("small", "32-true", SWEEP, steps=50, batch_sizes=SWEEP_BATCH_SIZES),
    ]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Spec]]:
    """The options and the plan (exits with code 2 on an unknown variant or a conflicting option)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--suite", choices=["readme"], help="run every config, variant and sweep behind the docs")
    mode.add_argument("--sweep", choices=["batch"], help="measure --variants at every --batch-sizes")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="default: small")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed", "transformer-engine"], help="default: 32-true")
    parser.add_argument("--variants", help="comma-separated, or 'all' (default: the usual ones of the config)")
    parser.add_argument("--batch-sizes", help="for --sweep batch (default: 1,2,...,256)")
    parser.add_argument("--steps", type=int, help="training steps per variant (default: 80, sweeps 50)")
    parser.add_argument("--skip", type=int, help="steps left out of the timing (default: 20)")
    parser.add_argument("--rounds", type=int, help="alternated fits per variant; the fastest counts (default: 1)")
    parser.add_argument("--out", type=Path, help="results directory (default: benchmarks/results with --suite)")
    args = parser.parse_args(argv)
    fixed = ("config", "precision", "variants", "batch_sizes", "steps", "skip", "rounds")
    if args.suite:
        if any(getattr(args, name) is not None for name in fixed):
            parser.error("--suite fixes its own configs, variants and step counts; pass only --out with it")
        return args, readme_plan()
    if args.batch_sizes and not args.sweep:
        parser.error("--batch-sizes goes with --sweep batch")
    config = args.config or "small"
    moe = "experts" in CONFIGS[config]
    default = SWEEP if args.sweep else MOE if moe else DEFAULT
    variants: tuple[str, ...] = default
    if args.variants:
        given = (MOE if moe else ALL) if args.variants == "all" else None
        variants = given or tuple(records.names(parser, "--variants", args.variants, KNOWN_VARIANTS))
    batch_sizes: tuple[int, ...] = ()
    if args.sweep:
        text = args.batch_sizes or ",".join(map(str, SWEEP_BATCH_SIZES))
        if not all(part.strip().isdigit() and int(part) > 0 for part in text.split(",")):
            parser.error(f"--batch-sizes takes positive integers separated by commas, not {text!r}")
        batch_sizes = tuple(int(part) for part in text.split(","))
    steps = args.steps if args.steps is not None else 50 if args.sweep else 80
    skip = args.skip if args.skip is not None else 20
    if not 0 <= skip < steps:
        parser.error(f"--skip must be at least 0 and below --steps so that some steps are timed (got {skip}, {steps})")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    spec = Spec(config, args.precision or "32-true", variants, steps, skip, args.rounds or 1, batch_sizes)
    return args, [spec]


def measure(spec: Spec) -> dict[str, Any]:
    """One spec's JSON record: each variant's fastest round (at each batch size of a sweep)."""
    results = []
    for batch in spec.batch_sizes or (None,):
        one_fit = partial(
            train, spec.config, precision=spec.precision, steps=spec.steps, skip=spec.skip, batch_size=batch
        )
        fits = alternate(spec.variants, spec.rounds, one_fit)
        results += [{k: v for k, v in fit.items() if k != "losses"} for fit in fits]
    return {
        "kind": "sweep" if spec.batch_sizes else "table", "sweep": "batch" if spec.batch_sizes else None,
        "config": spec.config, "precision": spec.precision,
        "batch_size": None if spec.batch_sizes else CONFIGS[spec.config]["batch_size"],
        "batch_sizes": list(spec.batch_sizes) or None, "model": model_args(CONFIGS[spec.config]),
        "variants": list(spec.variants), "steps": spec.steps, "skip": spec.skip, "rounds": spec.rounds,
        "environment": records.environment(), "results": results,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    if records.needs_cuda("run.py"):
        return 2
    out = args.out or Path(__file__).resolve().parent / ("results" if args.suite else "out")
    for index, spec in enumerate(plan, 1):
        print(f"[{index}/{len(plan)}] {spec.stem}: {', '.join(spec.variants)}", flush=True)
        print(f"wrote {records.write(measure(spec), out / f'{spec.stem}.json')}", flush=True)
    report.publish(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

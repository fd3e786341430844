"""Measure every way of training the same model, in one process.

    python benchmarks/run.py --config small     # one config and precision (--precision, --variants)
    python benchmarks/run.py --sweep batch      # batch sizes 1..64 on the small config
    python benchmarks/run.py --suite readme     # every figure of the README, then the report

Every run writes its measurements and the environment (GPU, versions, date, the command line) as JSON to
``--out``, prints its Markdown table, and regenerates ``RESULTS.md`` and the PNG charts there from all the JSON of
that directory (``python benchmarks/report.py DIR`` does the same without a GPU). On a machine without CUDA it says
so and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from tqdm import tqdm

from benchmarks import report
from benchmarks.variants import (
    CONFIGS,
    LIGHTNING_VARIANTS,
    MOE_VARIANTS,
    PYTORCH_VARIANTS,
    TE_VARIANTS,
    Result,
    model_args,
    run_variant,
    te_available,
    variants_for,
)

SCHEMA_VERSION = 1
BENCH_DIR = Path(__file__).resolve().parent
NEEDS_CUDA = "benchmarks/run.py measures CUDA graphs and needs a CUDA GPU; none is visible here."

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
SWEEP_VARIANTS = ("eager", "layer", "full_iteration", "pytorch_full_graph")
SWEEP_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COMPILE_VARIANTS = ("compile_default", "compile_reduce_overhead")
KNOWN_VARIANTS = frozenset((*LIGHTNING_VARIANTS, *PYTORCH_VARIANTS, *MOE_VARIANTS))


@dataclass(frozen=True)
class RunSpec:
    """One config and precision, measured over a list of variants with the same step counts."""

    config: str
    precision: str
    variants: tuple[str, ...]
    steps: int = 80
    skip: int = 20
    repeat: int = 1  # rounds over the variants (round robin), so slow drifts of the host hit every variant alike


@dataclass(frozen=True)
class SweepSpec:
    """Variants of one config measured at several batch sizes."""

    config: str
    precision: str
    variants: tuple[str, ...] = SWEEP_VARIANTS
    batch_sizes: tuple[int, ...] = SWEEP_BATCH_SIZES
    steps: int = 50
    skip: int = 20
    sweep: str = "batch"


Spec = RunSpec | SweepSpec


def readme_plan(te: bool) -> list[Spec]:
    """The runs behind every figure of the README (``--suite readme``).

    Args:
        te: Transformer Engine is importable (``te_layer`` is measured only then).
    """
    small = [v for v in variants_for(CONFIGS["small"]) if v not in TE_VARIANTS]
    te_runs = [RunSpec("small", precision, TE_VARIANTS) for precision in ("bf16-mixed", "transformer-engine")]
    medium = ("eager", "layer", "full_iteration", "pytorch_full_graph")
    return [
        *(te_runs if te else []),
        RunSpec("small", "32-true", compile_last(small), repeat=3),
        RunSpec(
            "small",
            "bf16-mixed",
            compile_last(["eager", "layer", "full_iteration", "compile_reduce_overhead", "pytorch_full_graph"]),
            repeat=3,
        ),
        *(RunSpec("medium", precision, medium, steps=30, skip=10) for precision in ("32-true", "bf16-mixed")),
        *(RunSpec("moe", precision, MOE_VARIANTS) for precision in ("32-true", "bf16-mixed")),
        SweepSpec("small", "32-true"),
    ]


SUITES = {"readme": readme_plan}


def compile_last(variants: Sequence[str]) -> tuple[str, ...]:
    """The variants with the ``torch.compile`` ones moved to the end (their compile threads and caches stay)."""
    return (*(v for v in variants if v not in COMPILE_VARIANTS), *(v for v in variants if v in COMPILE_VARIANTS))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on an unknown variant or a conflicting option)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--suite", choices=sorted(SUITES), help="run a named plan of configs, variants and sweeps")
    mode.add_argument("--sweep", choices=["batch"], help="measure --variants at every --batch-sizes")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="default: small")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], help="default: 32-true")
    parser.add_argument("--variants", help="comma-separated, or 'all' (default: the usual ones of the config)")
    parser.add_argument("--batch-sizes", help=f"for --sweep batch (default: {','.join(map(str, SWEEP_BATCH_SIZES))})")
    steps_help = f"training steps per variant (default: {RunSpec.steps}, sweeps {SweepSpec.steps})"
    parser.add_argument("--steps", type=int, help=steps_help)
    skip_help = f"steps left out of the timing: warmup, capture (default: {RunSpec.skip}, sweeps {SweepSpec.skip})"
    parser.add_argument("--skip", type=int, help=skip_help)
    parser.add_argument(
        "--out", help="results directory (default: benchmarks/results with --suite, else benchmarks/out)"
    )
    args = parser.parse_args(argv)
    fixed = ("config", "precision", "variants", "batch_sizes", "steps", "skip")
    if args.suite and any(getattr(args, name) is not None for name in fixed):
        parser.error("--suite fixes its own configs, variants and step counts; pass only --out with it")
    if args.batch_sizes and not args.sweep:
        parser.error("--batch-sizes goes with --sweep batch")
    if not all(b.isdigit() and int(b) > 0 for b in _split(args.batch_sizes)):
        parser.error(f"--batch-sizes takes positive integers separated by commas, not {args.batch_sizes!r}")
    spec = SweepSpec if args.sweep else RunSpec
    steps, skip = _or(args.steps, spec.steps), _or(args.skip, spec.skip)
    if not 0 <= skip < steps:
        parser.error(f"--skip must be at least 0 and below --steps so that some steps are timed (got {skip}, {steps})")
    unknown = sorted(set(_split(args.variants)) - KNOWN_VARIANTS - {"all"})
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_VARIANTS))}")
    return args


def build_plan(args: argparse.Namespace) -> list[Spec]:
    """What to measure, from the parsed command line."""
    if args.suite:
        return SUITES[args.suite](te_available())
    config = args.config or "small"
    precision = args.precision or "32-true"
    steps = {} if args.steps is None else {"steps": args.steps}
    skip = {} if args.skip is None else {"skip": args.skip}
    if args.sweep:
        variants = _variants(args.variants, config, SWEEP_VARIANTS)
        batch_sizes = tuple(int(b) for b in _split(args.batch_sizes)) or SWEEP_BATCH_SIZES
        return [SweepSpec(config, precision, variants, batch_sizes, **steps, **skip, sweep=args.sweep)]
    default = MOE_VARIANTS if "experts" in CONFIGS[config] else DEFAULT_VARIANTS
    return [RunSpec(config, precision, _variants(args.variants, config, default), **steps, **skip)]


def output_dir(args: argparse.Namespace) -> Path:
    """``--out``, or the default directory of the mode."""
    if args.out:
        return Path(args.out)
    return BENCH_DIR / ("results" if args.suite else "out")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 2
    plan = build_plan(args)
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    started = time.perf_counter()
    for index, spec in enumerate(plan, 1):
        print(f"[{index}/{len(plan)}] {describe(spec)}", flush=True)
        record = measure_sweep(spec, env) if isinstance(spec, SweepSpec) else measure_run(spec, env)
        path = write_record(record, out)
        section = report.sweep_section if isinstance(spec, SweepSpec) else report.run_section
        print(section(record), f"wrote {path}", sep="\n", flush=True)
    for path in report.write_report(out):
        print(f"wrote {path}")
    print(f"finished in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def describe(spec: Spec) -> str:
    """One line naming what a spec measures."""
    what = f"{spec.config} {spec.precision}: {len(spec.variants)} variants, {spec.steps} steps ({spec.skip} untimed)"
    if isinstance(spec, SweepSpec):
        return f"{spec.sweep} sweep over {', '.join(map(str, spec.batch_sizes))}; {what}"
    return what


def measure_run(spec: RunSpec, env: dict[str, str]) -> dict[str, Any]:
    """Measure each variant of a run once; the run's JSON record."""
    config = CONFIGS[spec.config]
    started = time.perf_counter()
    merged: dict[str, Result] = {}
    for round_index in range(spec.repeat):
        for name in spec.variants:
            if round_index and name in COMPILE_VARIANTS:
                continue  # compiling again would measure the compiler's cache, not the variant
            result = run_variant(name, config, spec.precision, spec.steps, spec.skip)
            print(progress_line(result), flush=True)
            merged[name] = merge_rounds(merged.get(name), result)
    results = [as_dict(merged[name], config["batch_size"]) for name in spec.variants]
    return make_record(spec, env, results, time.perf_counter() - started)


def merge_rounds(earlier: Result | None, later: Result) -> Result:
    """One variant's rounds as one result: every timed step of every round, the largest peak memory."""
    if earlier is None:
        return later
    later.step_ms = [*earlier.step_ms, *later.step_ms]
    later.peak_mib = max(earlier.peak_mib, later.peak_mib)
    return later


def measure_sweep(spec: SweepSpec, env: dict[str, str]) -> dict[str, Any]:
    """Measure each variant at each batch size, with a progress bar over the points; the sweep's JSON record."""
    started = time.perf_counter()
    results = []
    points = [(batch, name) for batch in spec.batch_sizes for name in spec.variants]
    bar = tqdm(points, desc=f"{spec.sweep} sweep", unit="point", dynamic_ncols=True)
    for batch, name in bar:
        bar.set_postfix_str(f"batch {batch}, {name}")
        config = {**CONFIGS[spec.config], "batch_size": batch}
        result = run_variant(name, config, spec.precision, spec.steps, spec.skip)
        results.append(as_dict(result, batch))
        bar.write(f"batch {batch:>3} {progress_line(result)}")
    bar.close()
    return make_record(spec, env, results, time.perf_counter() - started)


def progress_line(result: Result) -> str:
    """The line printed as each variant finishes."""
    return f"{result.variant:>26}: {result.median_ms:8.3f} ms/step  {result.note}"


def make_record(spec: Spec, env: dict[str, str], results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The JSON record of a run or sweep: what was measured, where, how, and the results."""
    sweep = isinstance(spec, SweepSpec)
    return {
        "schema": SCHEMA_VERSION,
        "kind": "sweep" if sweep else "table",
        "sweep": spec.sweep if sweep else None,
        "config": spec.config,
        "precision": spec.precision,
        "batch_size": None if sweep else CONFIGS[spec.config]["batch_size"],
        "batch_sizes": list(spec.batch_sizes) if sweep else None,
        "model": model_args(CONFIGS[spec.config]),
        "variants": list(spec.variants),
        "steps": spec.steps,
        "skip": spec.skip,
        "wall_s": round(wall_s, 1),
        "environment": env,
        "results": results,
    }


def record_name(record: dict[str, Any]) -> str:
    """The JSON file name of a record: ``small_32-true.json``, ``sweep_batch_small_32-true.json``."""
    return f"{report.record_stem(record)}.json"


def write_record(record: dict[str, Any], out: Path) -> Path:
    """Write a record as strict JSON (non-finite figures as ``null``) into ``out``."""
    path = out / record_name(record)
    with path.open("w") as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")
    return path


def environment() -> dict[str, str]:
    """GPU, versions, date and the exact command line of this process."""
    import lightning

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "date": date.today().isoformat(),
        "command": shlex.join(sys.orig_argv),
    }


def as_dict(result: Result, batch_size: int) -> dict[str, object]:
    """A result as JSON-ready figures (non-finite ones as ``None``)."""
    low, high = result.spread_ms
    return {
        "variant": result.variant,
        "batch_size": batch_size,
        "median_ms": _finite_or_none(result.median_ms),
        "p25_ms": _finite_or_none(low),
        "p75_ms": _finite_or_none(high),
        "steps_timed": len(result.step_ms),
        "peak_mib": _finite_or_none(result.peak_mib),
        "pool_mib": _finite_or_none(result.pool_mib),
        "capture_ms": _finite_or_none(result.capture_ms),
        "replays": result.replays,
        "fallbacks": result.fallbacks,
        "final_loss": _finite_or_none(result.final_loss),
        "note": result.note,
    }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _variants(text: str | None, config: str, default: Sequence[str]) -> tuple[str, ...]:
    if text == "all":
        return tuple(variants_for(CONFIGS[config]))
    return tuple(_split(text)) or tuple(default)


if __name__ == "__main__":
    raise SystemExit(main())

"""What a replayed whole step's ``self.log`` calls cost: the package's direct re-issue against ``self.log`` each time.

    python benchmarks/logging_cost.py --out benchmarks/results/logging
    python benchmarks/logging_cost.py --out DIR --steps 160 --timed 60 --rounds 2

A whole-step graph cannot run ``self.log`` (logging a number copies it to the GPU), so the package records the calls
of ``training_step`` while capturing and re-issues them after each replay: the first time through ``self.log``, later
straight into the metric Lightning registered for them. The reference re-issues every call through ``self.log``,
which is what a LightningModule that overrides ``log`` gets (the package never skips an override). Both train the
GPT of ``benchmarks/variants.py`` with ``strategy="cudagraph_full"`` (``warmup_steps=3``), one ``self.log`` per
step, from the same seed, alternated for ``--rounds`` rounds in one process.

Per case and way: the median ms per step over the last ``--timed`` of ``--steps`` steps (CUDA events at batch starts,
read once at the end) and the median host ms between batch starts (equal to the step where the host paces it), each
way counted at its fastest round; the ratio is the reference's ms over the package's. Writes ``DIR/logging.json`` and
``DIR/LOGGING.md``. On a machine without CUDA it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch

from benchmarks.run import environment
from benchmarks.variants import CONFIGS, StepClock, _model_and_data, least, module_class, timing_trainer
from lightning_cudagraph import CUDAGraphStrategy

NEEDS_CUDA = "benchmarks/logging_cost.py measures CUDA graphs and needs a CUDA GPU; none is visible here."
MARKDOWN = "LOGGING.md"
WARMUP_STEPS = 3
#: (model config, precision, compile=): the cases, in the order they run.
CASES = (
    ("tiny", "32-true", False),
    ("small", "bf16-mixed", False),
    ("small", "bf16-mixed", True),
    ("small", "32-true", False),
)
WAYS = ("direct", "self.log")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on a bad value)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=160, help="training steps per fit (default: 160)")
    parser.add_argument("--timed", type=int, default=60, help="last steps of each fit timed (default: 60)")
    parser.add_argument("--rounds", type=int, default=2, help="fits per case and way, alternated (default: 2)")
    args = parser.parse_args(argv)
    if not 0 < args.timed < args.steps - WARMUP_STEPS - 1:
        parser.error(f"--timed must be at least 1 and leave the warmup and capture untimed (got {args.timed})")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    return args


def through_log(module: type[pl.LightningModule]) -> type[pl.LightningModule]:
    """``module`` with a ``log`` of its own that only calls Lightning's: every re-issued call goes through it."""

    def log(self: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        module.log(self, *args, **kwargs)

    return type(f"{module.__name__}ThroughLog", (module,), {"log": log})


def measure(case: tuple[str, str, bool], way: str, steps: int, skip: int) -> dict[str, float]:
    """One fit of ``case`` with its logs re-issued ``way``: its median device and host ms per step."""
    torch.compiler.reset()
    gc.collect()
    torch.cuda.empty_cache()
    model_name, precision, compiled = case
    model, data = _model_and_data(CONFIGS[model_name])
    if way == "self.log":
        model.__class__ = through_log(module_class(CONFIGS[model_name]))
    clock = StepClock()
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP_STEPS, compile=compiled)
    timing_trainer(steps, [clock], strategy, precision).fit(model, data)
    return {"ms": round(statistics.median(clock.step_times(skip)), 4), "host_ms": clock.host_median_ms(skip)}


def fastest(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The round with the least ms, with every round's ms."""
    return {**least(rounds, "ms"), "round_ms": [r["ms"] for r in rounds]}


def case_name(case: tuple[str, str, bool]) -> str:
    """``model precision`` and ``+ compile`` where compiled."""
    model, precision, compiled = case
    return f"{model} {precision}" + (" + compile" if compiled else "")


def markdown(record: dict[str, Any]) -> str:
    """``LOGGING.md``: one row per case."""
    env = record["environment"]
    rows = [
        f"| {row['case']} | {row['direct']['ms']:.3f} | {row['direct']['host_ms']:.3f} | {row['self.log']['ms']:.3f}"
        f" | {row['self.log']['host_ms']:.3f} | {row['ratio']:.2f}x |"
        for row in record["cases"]
    ]
    return (
        "# A replayed whole step's `self.log` calls: re-issued directly or through `self.log`\n\n"
        'Written by `benchmarks/logging_cost.py` from the JSON beside this file. `strategy="cudagraph_full"`,'
        f" one `self.log` per step; median ms per step over the last {record['timed']} of {record['steps']} steps"
        " (CUDA events at batch starts) and median host ms between batch starts, each way at its fastest of"
        f" {record['rounds']} alternated rounds in one process. {env['gpu']}, torch {env['torch']}, lightning"
        f" {env['lightning']}, {env['date']}.\n\n"
        "| case | direct ms | direct host ms | through `self.log` ms | through `self.log` host ms | speedup |\n"
        "|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Measure every case both ways; write ``logging.json`` and ``LOGGING.md``."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = args.steps - args.timed
    cases = []
    for case in CASES:
        rounds: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                rounds[way].append(measure(case, way, args.steps, skip))
        row = {"case": case_name(case), **{way: fastest(rounds[way]) for way in WAYS}}
        row["ratio"] = round(row["self.log"]["ms"] / row["direct"]["ms"], 3)
        print(
            f"{row['case']}: direct {row['direct']['ms']:.3f} ms, through self.log {row['self.log']['ms']:.3f} ms"
            f" ({row['ratio']:.2f}x)",
            flush=True,
        )
        cases.append(row)
    record = {
        "steps": args.steps,
        "timed": args.timed,
        "rounds": args.rounds,
        "environment": environment(),
        "cases": cases,
    }
    (out / "logging.json").write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    (out / MARKDOWN).write_text(markdown(record))
    print(f"wrote {out / 'logging.json'} and {out / MARKDOWN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

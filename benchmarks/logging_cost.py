"""What a replayed whole step's ``self.log`` calls cost: the package's direct re-issue against ``self.log`` each time.

    PYTHONPATH=. python benchmarks/logging_cost.py --out benchmarks/results/logging

The package re-issues the logged values of a replayed whole step straight into the metrics Lightning registered.
The reference re-issues every call through ``self.log``, which a LightningModule that overrides ``log`` gets. Both
train with ``strategy="cudagraph_full"``, alternated for ``--rounds`` rounds in one process, each way at its fastest.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.figures import ratio
from benchmarks.core.models import CONFIGS, train
from benchmarks.core.timing import alternate

#: (model config, precision, compile=): the cases, in the order they run.
CASES: tuple[tuple[str, str, bool], ...] = (
    ("tiny", "32-true", False),
    ("small", "bf16-mixed", False),
    ("small", "bf16-mixed", True),
)
CASES += (("small", "32-true", False),)
WAYS = ("direct", "self.log")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=160, timed=60, rounds=2)
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=4)
    return args


class ThroughLog(pl.Callback):
    """Gives the module a ``log`` of its own that calls Lightning's: every re-issued call goes through it."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        base = type(pl_module)

        def log(self: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
            base.log(self, *args, **kwargs)

        pl_module.__class__ = type(f"{base.__name__}ThroughLog", (base,), {"log": log})


def measure(way: str, **options: Any) -> dict[str, Any]:
    """One fit of a case with its logs re-issued ``way``."""
    return {**train(**options, callbacks=(ThroughLog(),) if way == "self.log" else ()), "variant": way}


def case_name(case: tuple[str, str, bool]) -> str:
    model, precision, compiled = case
    return f"{model} {precision}" + (" + compile" if compiled else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("logging_cost.py"):
        return 2
    cases = []
    for case in CASES:
        model, precision, compiled = case
        variant = "full_iteration+compile" if compiled else "full_iteration"
        skip = args.steps - args.timed

        fit = partial(measure, model=model, variant=variant, precision=precision, steps=args.steps, skip=skip)
        fits = {fit["variant"]: fit for fit in alternate(WAYS, args.rounds, fit)}
        row: dict[str, Any] = {"case": case_name(case)}
        for way in WAYS:
            row[way] = {
                "ms": fits[way]["median_ms"],
                "host_ms": fits[way].get("host_ms"),
                "round_ms": fits[way]["round_ms"],
            }
        row["ratio"] = ratio(row["self.log"]["ms"], row["direct"]["ms"])
        cases.append(row)
    record = {"kind": "logging", "steps": args.steps, "timed": args.timed, "rounds": args.rounds}
    record.update(configs={m: CONFIGS[m] for m, _, _ in CASES}, environment=records.environment(), cases=cases)
    report.publish(args.out, records.write(record, args.out / "logging.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

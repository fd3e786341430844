"""Measure ``scope="auto"`` (the ladder) against eager training and every fixed scope, in one process.

    PYTHONPATH=. python benchmarks/auto.py --out benchmarks/results/auto --steps 160 --timed 60
    PYTHONPATH=. python benchmarks/auto.py --out DIR --precision bf16-mixed --models gpt,qwen3_moe --cost-steps 0

Models: the small GPT and the Hugging Face Llama and Qwen3-MoE (skipped where transformers is missing). Variants:
eager Lightning, the fixed scopes, the whole step, ``auto-callback`` (``CUDAGraphCallback()``: the ladder stops below
the whole step) and ``auto-strategy`` (``strategy="cudagraph"``). Each variant counts at its fastest of ``--rounds``
alternated fits. Speed ratios: ``auto-strategy`` against the best fixed variant and ``auto-callback`` against the
best fixed scope (goal 0.9x), on Qwen3-MoE both against eager (goal 1.25x). The ladder's cost: ``--cost-steps``
fits of ``auto-strategy`` and of the fixed variant at the level it settled on, alternated, the fastest of each
counted; the climb's extra wall time to the start of step 100 (one host sync there) as a share of the fit (goal 5%).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.figures import add_relative, finite, least, ratio
from benchmarks.core.models import HF_MODELS, build, config_of, graph_callback, report_figures, setup, train
from benchmarks.core.timing import alternate, failure_note, fresh_device, timing_trainer
from lightning_cudagraph import CUDAGraphCallback

PAIRS = {"gpt": "attn+mlp", "llama": "attn+mlp", "qwen3_moe": "attn+moe_router"}
AUTO = ("auto-callback", "auto-strategy")
MODELS = {model: ("eager", "attn", pair, "layer", "full_iteration", *AUTO) for model, pair in PAIRS.items()}
BEST_FIXED_GOAL, EAGER_GOALS, COST_GOAL = 0.9, {"qwen3_moe": 1.25}, 0.05
PARITY_STEPS, COST_ROUNDS, CLIMB_STEPS = 20, 3, 100
#: What the package's exclusion reason says of a layer replaced by its dense parts.
PARTS_INSTEAD = "its parts are captured instead"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=200, timed=60, rounds=3)
    parser.add_argument("--cost-steps", type=int, default=1000, help="steps of each ladder-cost fit; 0 skips them")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=0)
    if args.cost_steps < 0:
        parser.error("--cost-steps must be at least 0")
    args.models = records.names(parser, "--models", args.models, list(MODELS))
    return args


def fixed_variant_for(model: str, report: dict[str, Any]) -> str:
    """The fixed variant at the level a ladder settled on (layers narrowed to their dense parts: the pair)."""
    level = report.get("level")
    narrowed = any(PARTS_INSTEAD in why for why in (report.get("exclusions") or {}).values())
    if level is None:
        return "eager"
    return PAIRS[model] if level == "attn+mlp" or (level == "layer" and narrowed) else level


def ratios(model: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The auto variants against the best fixed variants, eager (with its goal) and every fixed one that rolled back."""
    found = {r["variant"]: r for r in results}
    fixed = [v for v in MODELS[model][1:5] if found.get(v, {}).get("median_ms") is not None]
    fastest = lambda names: min(names, key=lambda v: found[v]["median_ms"], default=None)  # noqa: E731
    wanted: list[tuple[str, str, str | None, float | None]] = [
        ("auto-strategy", "best fixed", fastest(fixed), BEST_FIXED_GOAL),
        ("auto-callback", "best fixed scope", fastest([v for v in fixed if v != "full_iteration"]), BEST_FIXED_GOAL),
    ]
    for variant in AUTO:
        if model in EAGER_GOALS:
            wanted.append((variant, "eager", "eager", EAGER_GOALS[model]))
        wanted += [(variant, "rolled back", v, None) for v in fixed if (found[v].get("report") or {}).get("rollbacks")]
    entries = []
    for variant, against, reference, goal in wanted:
        if variant in found and reference in found:
            value = ratio(found[reference]["median_ms"], found[variant]["median_ms"])
            met = None if goal is None or value is None else value >= goal
            entry = {"variant": variant, "against": against, "reference": reference, "ratio": value, "goal": goal}
            entries.append({**entry, "met": met})
    return entries


class ClimbMark(pl.Callback):
    """The wall time from ``started`` to the start of step ``CLIMB_STEPS``: one host sync there, none elsewhere."""

    def __init__(self) -> None:
        self.started, self.seconds = 0.0, cast(float | None, None)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == CLIMB_STEPS:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.started


def fit_wall(model: str, variant: str, precision: str, steps: int) -> dict[str, Any]:
    """The wall time of one fit and of its climb, and the package's report."""
    fresh_device()
    mark = ClimbMark()
    try:
        module, data = build("small" if model == "gpt" else model)
        options, strategy = setup(variant)
        graph = [] if options is None else [CUDAGraphCallback(**options)]
        trainer = timing_trainer(steps, [mark, *graph], strategy, precision)
        torch.cuda.synchronize()
        mark.started = time.perf_counter()
        trainer.fit(module, data)
        torch.cuda.synchronize()
    except Exception as err:
        return {"variant": variant, "wall_s": None, "climb_s": None, "report": None, "note": failure_note(err)}
    wall = time.perf_counter() - mark.started
    report = report_figures(graph_callback(trainer))
    return {"variant": variant, "wall_s": wall, "climb_s": mark.seconds, "report": report, "note": ""}


def cost(model: str, precision: str, steps: int) -> dict[str, Any]:
    """The ladder's cost: ``auto-strategy`` against the fixed variant at the level its ladder settled on."""
    autos, fixeds = [], []
    for _ in range(COST_ROUNDS):
        autos.append(fit_wall(model, "auto-strategy", precision, steps))
        fixeds.append(fit_wall(model, fixed_variant_for(model, autos[0].get("report") or {}), precision, steps))
    auto, fixed = least(autos, "wall_s"), least(fixeds, "wall_s")
    climbs = [
        min((f["climb_s"] for f in fits if f.get("climb_s") is not None), default=None) for fits in (autos, fixeds)
    ]
    report = auto.get("report") or {}
    whole: float | None = None
    climb: float | None = None
    if auto["wall_s"] and fixed["wall_s"] is not None:
        whole = finite((auto["wall_s"] - fixed["wall_s"]) / auto["wall_s"])
        settled = 3 + sum(row.get("steps") or 0 for row in report.get("ladder", [])) <= CLIMB_STEPS
        climb_auto, climb_fixed = climbs
        if climb_auto is not None and climb_fixed is not None and settled:
            extra = climb_auto - climb_fixed
            climb = finite(extra / (fixed["wall_s"] + extra))
    decisive = climb if climb is not None else whole
    return {
        "steps": steps, "level": report.get("level"), "fixed_variant": fixed["variant"],
        "wall_auto_s": auto["wall_s"], "wall_fixed_s": fixed["wall_s"], "cost": whole,
        "climb_steps": CLIMB_STEPS, "climb_auto_s": climbs[0], "climb_fixed_s": climbs[1], "climb_cost": climb,
        "goal": COST_GOAL, "met": None if decisive is None else decisive <= COST_GOAL,
        "capture_ms_total": report.get("capture_ms_total"),
        "ladder_steps": {row["level"]: row["steps"] for row in report.get("ladder", [])},
        "note": "; ".join(f"{f['variant']}: {f['note']}" for f in (auto, fixed) if f.get("note")),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("auto.py"):
        return 2
    have_hf = importlib.util.find_spec("transformers") is not None
    skipped = {m: "skipped: transformers>=5 is not installed" for m in args.models if m in HF_MODELS and not have_hf}
    measured = {}
    for model in (m for m in args.models if m not in skipped):
        name, skip = "small" if model == "gpt" else model, args.steps - args.timed  # the GPT is the small config
        one_fit = partial(train, name, precision=args.precision, steps=args.steps, skip=skip, keep_losses=PARITY_STEPS)
        fits = alternate(MODELS[model], args.rounds, one_fit)
        add_relative(fits, {fit["variant"]: fit.pop("losses", []) for fit in fits})
        measured[model] = {
            "config": config_of(name),
            "results": fits,
            "ratios": ratios(model, fits),
            "cost": cost(model, args.precision, args.cost_steps) if args.cost_steps else None,
        }
    record = {
        "kind": "auto", "precision": args.precision, "steps": args.steps, "timed": args.timed,
        "cost_steps": args.cost_steps, "rounds": args.rounds, "warmup_steps": 3, "parity_steps": PARITY_STEPS,
        "environment": records.environment(), "skipped": skipped, "models": measured,
    }  # fmt: skip
    report.publish(args.out, records.write(record, args.out / f"auto_{args.precision}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure ``scope="auto"`` (the adaptive ladder) against eager training and every fixed scope, in one process.

    python benchmarks/auto.py --out benchmarks/results/auto                  # fp32; gpt, llama, qwen3_moe
    python benchmarks/auto.py --out DIR --precision bf16-mixed --models gpt,qwen3_moe
    python benchmarks/auto.py --out DIR --steps 200 --timed 60 --cost-steps 0   # no 1000-step cost fits
    python benchmarks/auto.py --out DIR --rounds 1                              # one fit per variant

Models: the small GPT of ``benchmarks/variants.py`` (``examples/gpt.py``, 6 layers, width 256) and the Hugging Face
Llama and Qwen3-MoE of ``benchmarks/hf.py`` (``examples/hf_causal_lm.py`` at its defaults; skipped, with a message,
where transformers is not installed). Variants, each trained from the same seed: eager Lightning; the fixed scopes
(``attn``, ``attn`` with ``mlp`` or, on Qwen3-MoE, ``moe_router``, ``layer``) through ``CUDAGraphCallback`` with
``warmup_steps=3``; the whole step (``strategy="cudagraph_full"``); ``auto-callback`` (``CUDAGraphCallback()`` alone:
``scope="auto"`` without a strategy, so the ladder stops below the whole step) and ``auto-strategy``
(``strategy="cudagraph"``: ``scope="auto"`` with the whole step as the last rung).

Per variant: the median ms/step over the last ``--timed`` of ``--steps`` steps (a CUDA event at every batch start,
read once at the end), after the ladder has settled, in the fastest of ``--rounds`` fits (the variants alternate
round by round; every round's median is kept beside it); the speedup over eager Lightning; loss parity (the largest
per-step difference from eager Lightning's loss over the first 20 steps); and the package's report (stage, level,
ladder, exclusions, rollback reasons, pool MiB, total capture ms). Then speed ratios (ms of the reference over ms of
the variant): ``auto-strategy`` against the best fixed variant and ``auto-callback`` against the best fixed scope
(goal: at least 0.9x), on Qwen3-MoE the auto variants against eager (goal: at least 1.25x), and the auto variants
against every fixed variant that rolled back. Last, the ladder's cost: ``--cost-steps`` steps of ``auto-strategy``
and of the fixed variant at the level its ladder settled on, ``COST_ROUNDS`` fits each, alternated. Two figures, each
the fastest of its rounds: the climb, the wall time from the call of ``trainer.fit`` to the start of step
``CLIMB_STEPS`` (one host sync there), after which both fits run the same graphs; and the whole fit. The ladder's
cost is the climb's extra time as a share of the auto fit, ``(climb_auto - climb_fixed) / (fixed + climb_auto -
climb_fixed)`` (goal: at most 5%); the whole fits' ``(auto - fixed) / auto`` is given beside it, and decides where
the climb was not measured (it also holds the host's step-time scatter over the steps after the climb).

Writes ``DIR/auto_<precision>.json`` and ``DIR/AUTO.md`` (rebuilt from every ``auto_*.json`` in ``DIR``). On a
machine without CUDA it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch

from benchmarks import hf
from benchmarks.report import write_records_markdown
from benchmarks.run import environment as suite_environment
from benchmarks.variants import CONFIGS, Result, least, model_args, module_class, peak_memory, timing_trainer
from examples.gpt import TokenDataModule
from examples.hf_causal_lm import INSTALL, HFCausalLM
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphReport

SCHEMA_VERSION = 1
NEEDS_CUDA = "benchmarks/auto.py measures CUDA graphs and needs a CUDA GPU; none is visible here."
MARKDOWN = "AUTO.md"
PRECISIONS = hf.PRECISIONS

WARMUP_STEPS = 3
PARITY_STEPS = 20
#: About how many steps the ladder takes to settle (warmup, then capture, confirmation and timing per rung).
LADDER_STEPS = 40
GPT_CONFIG = CONFIGS["small"]
HF_MODELS = ("llama", "qwen3_moe")
#: The scope pair of each model: the fixed variant that matches the ladder's ``attn+mlp`` rung.
PAIRS = {"gpt": "attn+mlp", "llama": "attn+mlp", "qwen3_moe": "attn+moe_router"}
AUTO_VARIANTS = ("auto-callback", "auto-strategy")
#: The variants of each model, in the order they run and appear.
MODELS = {model: ("eager", "attn", pair, "layer", "full_iteration", *AUTO_VARIANTS) for model, pair in PAIRS.items()}
TITLES = {"gpt": "GPT (small)", **hf.TITLES}
#: Fixed-scope variants: the scopes each captures.
SCOPES = hf.SCOPES
#: Variants trained through a strategy of the package, by its registered name.
STRATEGIES = {"full_iteration": "cudagraph_full", "auto-strategy": "cudagraph"}
LABELS = {
    **hf.LABELS,
    "auto-callback": "`CUDAGraphCallback()` (auto)",
    "auto-strategy": '`strategy="cudagraph"` (auto)',
}

#: Speed ratio goals: the auto variants against the best fixed variant they could have been.
BEST_FIXED_GOAL = 0.9
#: Models whose auto variants must beat eager Lightning by this much.
EAGER_GOALS = {"qwen3_moe": 1.25}
#: The largest share of a long fit's wall time the ladder may cost.
COST_GOAL = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on a bad value).

    Args:
        argv: The arguments (``sys.argv[1:]`` when ``None``).

    Returns:
        The options, with ``models`` as a list.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per variant (default: 200)")
    parser.add_argument("--timed", type=int, default=60, help="last steps of each variant timed (default: 60)")
    parser.add_argument(
        "--cost-steps", type=int, default=1000, help="steps of each ladder-cost fit; 0 skips them (default: 1000)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="fits of each variant, alternated; the fastest counts (default: 3)"
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    if not 0 < args.timed < args.steps:
        parser.error(f"--timed must be at least 1 and below --steps (got {args.timed}, {args.steps})")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    if args.cost_steps < 0:
        parser.error(f"--cost-steps must be 0 (no cost fits) or more (got {args.cost_steps})")
    if args.steps - args.timed < WARMUP_STEPS + LADDER_STEPS:
        print(
            f"note: timing starts at step {args.steps - args.timed}; the ladder takes about"
            f" {WARMUP_STEPS + LADDER_STEPS} steps to settle, so the timing may include it",
            flush=True,
        )
    args.models = hf.names(parser, "--models", "model", args.models, MODELS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure every requested model and write the JSON record and ``AUTO.md``; 2 where CUDA is missing."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 2
    models, skipped = runnable_models(args.models, transformers_version() is not None)
    for model, why in skipped.items():
        print(f"{model}: {why}")
    if not models:
        print("nothing to measure: every model asked for was skipped")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    skip = args.steps - args.timed
    measured = {}
    for model in models:
        print(
            f"{model} {args.precision}: {len(MODELS[model])} variants, {args.rounds} round(s), {args.steps} steps"
            f" ({args.timed} timed)"
        )
        measured[model] = measure_model(model, args.precision, args.steps, skip, args.cost_steps, args.rounds)
        print(summary(measured[model]), flush=True)
    record = {
        "schema": SCHEMA_VERSION,
        "kind": "auto",
        "precision": args.precision,
        "steps": args.steps,
        "timed": args.timed,
        "cost_steps": args.cost_steps,
        "rounds": args.rounds,
        "warmup_steps": WARMUP_STEPS,
        "parity_steps": min(PARITY_STEPS, args.steps),
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
        "skipped": skipped,
        "models": measured,
    }
    path = out / f"auto_{args.precision}.json"
    with path.open("w") as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")
    markdown = write_markdown(out)
    print(f"wrote {path}", f"wrote {markdown}", sep="\n")
    print(f"finished in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def runnable_models(requested: Sequence[str], have_transformers: bool) -> tuple[list[str], dict[str, str]]:
    """The models that can run here, and why each of the others is skipped.

    Args:
        requested: Model names, in order.
        have_transformers: Whether transformers is importable (the Hugging Face models need it).

    Returns:
        The models to run, and a reason per skipped model.
    """
    if have_transformers:
        return list(requested), {}
    why = f"skipped: transformers>=5 is not installed ({INSTALL})"
    return [m for m in requested if m not in HF_MODELS], {m: why for m in requested if m in HF_MODELS}


# =================================================================== measuring
def measure_model(model: str, precision: str, steps: int, skip: int, cost_steps: int, rounds: int) -> dict[str, Any]:
    """Every variant of one model in ``rounds`` alternated fits, the ratios, and the ladder's cost (``cost_steps``)."""
    fits: dict[str, list[dict[str, Any]]] = {variant: [] for variant in MODELS[model]}
    losses: dict[str, list[float]] = {}
    for _ in range(rounds):
        for variant in MODELS[model]:
            result, first_losses = run_variant(model, variant, precision, steps, skip)
            fits[variant].append(result)
            losses[variant] = losses.get(variant) or first_losses  # the same seed and batches every round
            print(progress_line(result), flush=True)
    results = [fastest_round(fits[variant]) for variant in MODELS[model]]
    add_relative_figures(results, losses)
    cost = measure_cost(model, precision, cost_steps) if cost_steps else None
    return {"config": model_config(model), "results": results, "ratios": ratios(model, results), "cost": cost}


def fastest_round(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's fit with the lowest median (the first where none was timed), with every round's median and level.

    One fit is not enough on these host-bound steps: the host's speed differs between fits of the same graphs by a
    third or more, in stretches of consecutive fits (``scope=["attn", "moe_router"]`` on Qwen3-MoE: 18.3, 25.7 and
    20.9 ms/step in the three rounds of one run, while eager Lightning stayed at 27.3-27.8 ms).
    """
    return {
        **least(fits, "median_ms"),
        "round_ms": [fit["median_ms"] for fit in fits],
        "round_levels": [level_reached(fit) for fit in fits],
    }


def model_config(model: str) -> dict[str, Any]:
    """The model's constructor arguments (with ``kind``), and the batch and sequence the data use."""
    if model == "gpt":
        return {**model_args(GPT_CONFIG), "batch_size": GPT_CONFIG["batch_size"], "kind": model}
    return {**hf.model_config(model), "seq_len": hf.SEQ_LEN, "batch_size": hf.BATCH_SIZE}


def build(model: str) -> tuple[pl.LightningModule, TokenDataModule]:
    """The seeded module and its data: the same weights and batches for every variant."""
    pl.seed_everything(0, verbose=False)
    if model == "gpt":
        config = GPT_CONFIG
        module = module_class(config)(**model_args(config))
        vocab, seq, batch = config["vocab_size"], config["seq_len"], config["batch_size"]
    else:
        module = HFCausalLM(kind=model)
        vocab, seq, batch = module.hparams.vocab_size, hf.SEQ_LEN, hf.BATCH_SIZE
    return module, TokenDataModule(vocab, seq, batch_size=batch, train_samples=64 * batch, val_samples=8)


def variant_setup(variant: str) -> tuple[dict[str, Any] | None, str]:
    """How a variant trains: the ``CUDAGraphCallback`` options (``None``: no callback) and the Trainer's strategy.

    Raises:
        ValueError: An unknown variant.
    """
    if variant == "eager":
        return None, "auto"
    if variant in SCOPES:
        return {"scope": SCOPES[variant], "warmup_steps": WARMUP_STEPS}, "auto"
    if variant == "auto-callback":
        return {}, "auto"
    if variant in STRATEGIES:
        return None, STRATEGIES[variant]
    raise ValueError(f"unknown variant {variant!r}")


def trainer_for(variant: str, steps: int, precision: str, callbacks: list[pl.Callback]) -> pl.Trainer:
    """The timing Trainer of a variant, with its graph callback (if any) after ``callbacks``."""
    options, strategy = variant_setup(variant)
    graph = [] if options is None else [CUDAGraphCallback(**options)]
    return timing_trainer(steps, [*callbacks, *graph], strategy, precision)


def graph_callback(trainer: pl.Trainer) -> CUDAGraphCallback | None:
    """The Trainer's ``CUDAGraphCallback`` (the one a strategy adds included), or ``None``."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)), None)


def run_variant(model: str, variant: str, precision: str, steps: int, skip: int) -> tuple[dict[str, Any], list[float]]:
    """Train one variant and measure it; a failure is reported in its note, never hides the other variants."""
    _release_memory()
    try:
        return measure(model, variant, precision, steps, skip)
    except Exception as err:
        torch.cuda.set_stream(torch.cuda.default_stream())
        return as_dict(Result(variant, note=failure_note(err))), []


def measure(model: str, variant: str, precision: str, steps: int, skip: int) -> tuple[dict[str, Any], list[float]]:
    """One variant's step times (after ``skip`` steps), peak memory, report and first losses."""
    module, data = build(model)
    clock = hf.LossClock(min(PARITY_STEPS, steps))
    trainer = trainer_for(variant, steps, precision, [clock])
    with peak_memory() as peak:
        trainer.fit(module, data)
    result = Result(variant, clock.step_times(skip), peak_mib=peak(), final_loss=float(clock.last_loss))
    losses = torch.stack(clock.losses).float().tolist() if clock.losses else []
    return as_dict(result, graph_callback(trainer)), losses


#: Fits of each variant in the cost measurement, alternated; each one's fastest counts (a single fit of a few
#: seconds can be off by a tenth of a second or more, as much as the 5% measured: two rounds gave 4.9% and 12.3%
#: for the same model in two runs).
COST_ROUNDS = 3
#: The climb is timed up to the start of this step. The longest climb measured on the H200 took 30 steps (warmup
#: included); with every level a close call it could take about 50.
CLIMB_STEPS = 100


def measure_cost(model: str, precision: str, steps: int) -> dict[str, Any]:
    """The ladder's cost: ``auto-strategy`` against the fixed variant at the level its ladder settled on."""
    autos, fixeds = [], []
    for _ in range(COST_ROUNDS):
        autos.append(fit_wall(model, "auto-strategy", precision, steps))
        report = autos[0].get("report") or {}
        fixed = fixed_variant_for(model, report.get("level"), narrowed(report))
        fixeds.append(fit_wall(model, fixed, precision, steps))
    return cost_record(steps, fastest_fit(autos), fastest_fit(fixeds))


def fastest_fit(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """The fit with the shortest wall time (a failed one only if every one failed), with the shortest climb of all."""
    climbs = [fit["climb_s"] for fit in fits if fit["wall_s"] is not None and fit.get("climb_s") is not None]
    return {**least(fits, "wall_s"), "climb_s": min(climbs, default=None)}


class ClimbMark(pl.Callback):
    """The wall time from ``started`` to the start of step ``at``: one host sync there, none at any other step."""

    def __init__(self, at: int) -> None:
        self.at, self.started = at, math.nan
        self.seconds: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.at:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.started


def fit_wall(model: str, variant: str, precision: str, steps: int) -> dict[str, Any]:
    """The wall time of one ``trainer.fit`` of ``steps`` steps and of its climb (GPU work included), and the report."""
    _release_memory()
    mark = ClimbMark(CLIMB_STEPS)
    try:
        module, data = build(model)
        trainer = trainer_for(variant, steps, precision, [mark])
        torch.cuda.synchronize()
        mark.started = time.perf_counter()
        trainer.fit(module, data)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - mark.started
    except Exception as err:
        torch.cuda.set_stream(torch.cuda.default_stream())
        return {"variant": variant, "wall_s": None, "climb_s": None, "report": None, "note": failure_note(err)}
    graph = graph_callback(trainer)
    report = None if graph is None else report_figures(graph.report)
    return {"variant": variant, "wall_s": wall_s, "climb_s": mark.seconds, "report": report, "note": ""}


def failure_note(err: Exception) -> str:
    """The note of a run that raised."""
    return f"failed: {type(err).__name__}: {str(err)[:200]}"


def _release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# =================================================================== figures (pure)
def as_dict(result: Result, graph: CUDAGraphCallback | None = None) -> dict[str, Any]:
    """A variant's figures as JSON-ready values, with the package's report (the ladder's fields included)."""
    figures = hf.as_dict(result)
    if graph is not None:
        figures["report"] = report_figures(graph.report)
    return figures


def report_figures(report: CUDAGraphReport) -> dict[str, Any]:
    """What the benchmark keeps of the package's report, as JSON-ready values."""
    return {**hf.report_core(report), **ladder_fields(report)}


def ladder_fields(report: CUDAGraphReport) -> dict[str, Any]:
    """The report's ``scope="auto"`` fields as JSON-ready values (absent fields read as empty)."""
    return {
        "level": getattr(report, "level", None),
        "ladder": [
            {
                "level": row.level,
                "status": row.status,
                "step_ms": hf._finite_or_none(row.step_ms),
                "capture_ms": hf._finite_or_none(row.capture_ms),
                "steps": row.steps,
                "reason": row.reason,
            }
            for row in getattr(report, "ladder", [])
        ],
        "exclusions": dict(getattr(report, "exclusions", {})),
        "capture_ms_total": hf._finite_or_none(getattr(report, "capture_ms_total", math.nan)),
    }


def add_relative_figures(results: list[dict[str, Any]], losses: dict[str, list[float]]) -> None:
    """Add each variant's ``speedup`` over eager Lightning and ``loss_max_abs_diff`` from its losses (in place)."""
    eager = next((r for r in results if r["variant"] == "eager"), None)
    eager_ms = eager["median_ms"] if eager is not None else None
    for result in results:
        result["speedup"] = speed_ratio(eager_ms, result["median_ms"])
        diff = hf.max_abs_diff(losses.get("eager", []), losses.get(result["variant"], []))
        result["loss_max_abs_diff"] = hf._finite_or_none(diff)


def speed_ratio(reference_ms: float | None, variant_ms: float | None) -> float | None:
    """How much faster the variant is than the reference: ``reference_ms / variant_ms`` (``None`` if unmeasured)."""
    return hf._finite_or_none(hf._ratio(reference_ms, variant_ms))


def narrowed(report: dict[str, Any]) -> bool:
    """Whether layers of a report's level were replaced by their dense parts (its exclusions say so)."""
    return any(PARTS_INSTEAD in why for why in (report.get("exclusions") or {}).values())


#: What the package's exclusion reason says of a layer replaced by its dense parts.
PARTS_INSTEAD = "its parts are captured instead"


def fixed_variant_for(model: str, level: str | None, layers_narrowed: bool = False) -> str:
    """The fixed variant that trains at a ladder level (``None``: the ladder settled on eager training).

    Args:
        model: The model (its dense-parts pair differs).
        level: The level the ladder settled on.
        layers_narrowed: The level's layers were replaced by their dense parts (as on Qwen3-MoE): it captures what the
            dense-parts pair does, while a fixed ``layer`` scope rolls back there.

    Raises:
        ValueError: An unknown level.
    """
    if level is None:
        return "eager"
    if level == "attn+mlp" or (level == "layer" and layers_narrowed):
        return PAIRS[model]
    if level in ("attn", "layer", "full_iteration"):
        return level
    raise ValueError(f"unknown level {level!r}")


def fastest(results: dict[str, dict[str, Any]], variants: Sequence[str]) -> str | None:
    """The fastest of ``variants`` that has a measured median (``None`` if none has)."""
    timed = [v for v in variants if v in results and results[v].get("median_ms") is not None]
    return min(timed, key=lambda v: results[v]["median_ms"], default=None)


def rolled_back(result: dict[str, Any]) -> bool:
    """Whether a variant's graphs were given up during the fit (its report counts a rollback)."""
    report = result.get("report") or {}
    return bool(report.get("rollbacks") or report.get("rollback_reasons"))


def ratios(model: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The speed ratios of the auto variants against their references, with their goals.

    Args:
        model: The model (its goals differ).
        results: The variants' figures (``variant``, ``median_ms`` and ``report`` are read).

    Returns:
        One entry per comparison: ``variant``; ``against`` (``best fixed``, ``best fixed scope``, ``eager`` or
        ``rolled back``); ``reference`` (the variant compared with); ``ratio`` (ms of the reference over ms of the
        variant); ``goal`` (the least ratio wanted, or ``None``); ``met`` (``None`` without a goal or a ratio).
    """
    by_name = {r["variant"]: r for r in results}
    fixed = [v for v in MODELS[model] if v in SCOPES or v == "full_iteration"]
    comparisons: list[tuple[str, str, str | None, float | None]] = [
        ("auto-strategy", "best fixed", fastest(by_name, fixed), BEST_FIXED_GOAL),
        ("auto-callback", "best fixed scope", fastest(by_name, [v for v in fixed if v in SCOPES]), BEST_FIXED_GOAL),
    ]
    for variant in AUTO_VARIANTS:
        if model in EAGER_GOALS:
            comparisons.append((variant, "eager", "eager", EAGER_GOALS[model]))
        back = [v for v in fixed if v in by_name and rolled_back(by_name[v])]
        comparisons.extend((variant, "rolled back", other, None) for other in back)
    entries = []
    for variant, against, reference, goal in comparisons:
        if variant not in by_name or reference not in by_name:
            continue
        ratio = speed_ratio(by_name[reference]["median_ms"], by_name[variant]["median_ms"])
        met = None if goal is None or ratio is None else ratio >= goal
        entries.append(
            {"variant": variant, "against": against, "reference": reference, "ratio": ratio, "goal": goal, "met": met}
        )
    return entries


def cost_record(steps: int, auto: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The ladder's cost from the fits of :func:`fit_wall` (see the module's docstring).

    ``climb_cost`` is ``None`` where a climb was not timed, or the ladder had not settled by :data:`CLIMB_STEPS`
    (then the whole fits' ``cost`` decides ``met``).
    """
    report = auto.get("report") or {}
    wall_auto, wall_fixed = auto.get("wall_s"), fixed.get("wall_s")
    climb_auto, climb_fixed = auto.get("climb_s"), fixed.get("climb_s")
    cost = climb_cost = None
    if wall_auto and wall_fixed is not None:
        cost = hf._finite_or_none((wall_auto - wall_fixed) / wall_auto)
    settled_in_climb = bool(report) and ladder_settle_step(report) <= CLIMB_STEPS
    if cost is not None and climb_auto is not None and climb_fixed is not None and settled_in_climb:
        extra = climb_auto - climb_fixed
        climb_cost = hf._finite_or_none(extra / (wall_fixed + extra))
    decisive = climb_cost if climb_cost is not None else cost
    return {
        "steps": steps,
        "level": report.get("level"),
        "fixed_variant": fixed["variant"],
        "wall_auto_s": wall_auto,
        "wall_fixed_s": wall_fixed,
        "cost": cost,
        "climb_steps": CLIMB_STEPS,
        "climb_auto_s": climb_auto,
        "climb_fixed_s": climb_fixed,
        "climb_cost": climb_cost,
        "goal": COST_GOAL,
        "met": None if decisive is None else decisive <= COST_GOAL,
        "capture_ms_total": report.get("capture_ms_total"),
        "fixed_capture_ms_total": (fixed.get("report") or {}).get("capture_ms_total"),
        "ladder_steps": {row["level"]: row["steps"] for row in report.get("ladder", [])},
        "note": "; ".join(f"{run['variant']}: {run['note']}" for run in (auto, fixed) if run.get("note")),
    }


def level_reached(result: dict[str, Any]) -> str:
    """The level a variant ended the fit at: the ladder's for auto, the variant's own scope for a fixed one."""
    report = result.get("report")
    if not report:
        return ""
    if result["variant"] in AUTO_VARIANTS:
        return report.get("level") or "eager"
    return "eager" if report.get("stage") == "DISABLED" else result["variant"]


def ladder_settle_step(report: dict[str, Any], warmup_steps: int = WARMUP_STEPS) -> int:
    """About the step at which the ladder settled: its warmup and the steps spent on its rungs."""
    return warmup_steps + sum(row.get("steps") or 0 for row in report.get("ladder", []))


# =================================================================== text
def progress_line(result: dict[str, Any]) -> str:
    """One line per variant as it finishes: ms/step, stage, level and why graphs are off (if they are)."""
    level = level_reached(result)
    line = hf.progress_line(result)
    return f"{line}  level {level}" if level else line


def ratio_line(entry: dict[str, Any]) -> str:
    """One ratio in words, with its goal."""
    ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.{_digits(entry)}f}x"
    reference = LABELS.get(entry["reference"], entry["reference"])
    if entry["against"] != "eager":
        reference = f"{entry['against']} ({reference})"
    goal = ""
    if entry["goal"] is not None:
        verdict = "n/a" if entry["met"] is None else ("met" if entry["met"] else "missed")
        goal = f" (goal >= {entry['goal']:.2f}x: {verdict})"
    return f"{LABELS.get(entry['variant'], entry['variant'])} vs {reference}: {ratio}{goal}"


def _digits(entry: dict[str, Any]) -> int:
    """Two decimals, or three where two would show a missed goal as the goal itself (1.248x as 1.25x)."""
    missed_at_two = entry["goal"] is not None and not entry["met"] and round(entry["ratio"], 2) >= entry["goal"]
    return 3 if missed_at_two else 2


def cost_line(cost: dict[str, Any] | None) -> str:
    """The ladder's cost in words (or why it was not measured)."""
    if cost is None:
        return "Ladder cost: not measured (`--cost-steps 0`)."
    if cost["cost"] is None:
        return f"Ladder cost over {cost['steps']} steps: not measured ({cost['note'] or 'no wall time'})."
    verdict = f"(goal <= {100 * cost['goal']:.0f}%: {'met' if cost['met'] else 'missed'})"
    rungs = ", ".join(f"{level} {steps}" for level, steps in cost["ladder_steps"].items())
    fixed_ms = cost["fixed_capture_ms_total"]
    fixed_captures = f" (the fixed variant's: {fixed_ms:.0f} ms)" if fixed_ms is not None else ""
    fixed = LABELS.get(cost["fixed_variant"], cost["fixed_variant"])
    whole = (
        f"{LABELS['auto-strategy']} {cost['wall_auto_s']:.2f} s (settled on {cost['level'] or 'eager'}) vs {fixed}"
        f" {cost['wall_fixed_s']:.2f} s: {100 * cost['cost']:.1f}%"
    )
    if cost.get("climb_cost") is None:
        head = f"Ladder cost over a fit of {cost['steps']} steps: {whole} {verdict} (the climb was not timed)"
    else:
        head = (
            f"Ladder cost over a fit of {cost['steps']} steps: the first {cost['climb_steps']} steps took"
            f" {cost['climb_auto_s']:.2f} s with {LABELS['auto-strategy']} vs {cost['climb_fixed_s']:.2f} s with"
            f" {fixed}: {100 * cost['climb_cost']:.1f}% of the fit {verdict}; whole fits: {whole}"
        )
    return (
        f"{head}; captures {hf._fmt(cost['capture_ms_total'], 0) or 'n/a'} ms in all{fixed_captures};"
        f" steps per rung: {rungs or 'none'}."
    )


def summary(measured: dict[str, Any]) -> str:
    """The ratios and the cost of one model, as printed after its variants."""
    lines = [f"  {ratio_line(entry)}" for entry in measured["ratios"]]
    return "\n".join([*lines, f"  {cost_line(measured['cost'])}"])


def write_markdown(out: Path) -> Path:
    """``AUTO.md`` from every ``auto_*.json`` in ``out``: per model and precision, the tables and the ratios."""
    return write_records_markdown(out / MARKDOWN, "auto", PRECISIONS, '`scope="auto"`: the adaptive ladder', section)


def section(record: dict[str, Any]) -> str:
    """The Markdown of one record: per model, the variants, the ratios, the ladder of ``auto-strategy``, the cost."""
    env = record["environment"]
    skip = record["steps"] - record["timed"]
    parts = []
    for model, measured in record["models"].items():
        results = measured["results"]
        auto = next((r for r in results if r["variant"] == "auto-strategy"), {})
        parts.append(
            f"## {TITLES.get(model, model)}, {record['precision']}\n\n"
            f"Median ms per step over the last {record['timed']} of {record['steps']} steps (CUDA events, no host"
            f" sync per step), after the ladder has settled, in the fastest of {record.get('rounds', 1)} alternated"
            f" fit(s) per variant; fixed scopes with `warmup_steps={record['warmup_steps']}`;"
            f" loss parity: largest per-step difference from eager Lightning over the first {record['parity_steps']}"
            f" steps. {env['gpu']}, torch {env['torch']}, lightning {env['lightning']}, transformers"
            f" {env.get('transformers', 'n/a')}, {env['date']}.\n\n"
            + table(results, skip)
            + "\nSpeed ratios (ms of the reference / ms of the variant):\n\n"
            + "".join(f"- {ratio_line(entry)}\n" for entry in measured["ratios"])
            + f"\nLadder of {LABELS['auto-strategy']}:\n\n"
            + ladder_table((auto.get("report") or {}).get("ladder", []))
            + f"\n{cost_line(measured.get('cost'))}\n"
        )
    for model, why in record.get("skipped", {}).items():
        parts.append(f"## {TITLES.get(model, model)}, {record['precision']}\n\n{why}\n")
    return "\n".join(parts)


def table(results: list[dict[str, Any]], skip: int) -> str:
    """The variants of one model: ms/step, speedup, level reached, stage, loss parity, notes and every round's ms."""
    header = (
        "| variant | ms/step | vs eager | level reached | stage | loss parity | note | ms/step per round |\n"
        "|---|---:|---:|---|---|---:|---|---|\n"
    )
    rows = []
    for result in results:
        report = result.get("report") or {}
        speedup = result.get("speedup")
        cells = [
            LABELS.get(result["variant"], result["variant"]),
            hf._fmt(result["median_ms"], 2),
            "" if speedup is None else f"{speedup:.2f}x",
            level_reached(result),
            report.get("stage", "").lower(),
            "" if result["variant"] == "eager" else hf._fmt(result.get("loss_max_abs_diff"), None),
            hf._cell(note(result, skip), 200),
            rounds_cell(result),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return header + "\n".join(rows) + "\n"


def rounds_cell(result: dict[str, Any]) -> str:
    """Every round's median, with the level an auto variant reached in it (a ladder may settle apart by round)."""
    levels = result.get("round_levels") if result["variant"] in AUTO_VARIANTS else None
    cells = [hf._fmt(ms, 2) or "n/a" for ms in result.get("round_ms", [])]
    if levels and len(levels) == len(cells):
        cells = [f"{ms} ({level})" for ms, level in zip(cells, levels, strict=True)]
    return " / ".join(cells)


def note(result: dict[str, Any], skip: int) -> str:
    """A variant's note: its failure, rollbacks, why graphs are off, regions left eager, a ladder still walking."""
    report = result.get("report") or {}
    reasons = report.get("rollback_reasons") or []
    parts = [result.get("note", ""), *(f"rolled back: {r}" for r in reasons)]
    if not reasons and report.get("reason"):
        parts.append(f"graphs off: {report['reason']}")
    exclusions = report.get("exclusions") or {}
    if exclusions:
        parts.append(f"left eager: {'; '.join(f'{name} ({why})' for name, why in exclusions.items())}")
    if report.get("ladder") and ladder_settle_step(report) > skip:
        parts.append(f"ladder walked until about step {ladder_settle_step(report)}: the timing (from {skip}) has it")
    return "; ".join(filter(None, parts))


def ladder_table(rows: list[dict[str, Any]]) -> str:
    """The rungs ``scope="auto"`` tried: level, status, ms/step, capture ms, steps and reason."""
    if not rows:
        return "(no ladder recorded)\n"
    header = "| level | status | ms/step | capture ms | steps | reason |\n|---|---|---:|---:|---:|---|\n"
    lines = [
        "| "
        + " | ".join(
            [
                row["level"],
                row["status"],
                hf._fmt(row.get("step_ms"), 2),
                hf._fmt(row.get("capture_ms"), 0),
                str(row.get("steps", "")),
                hf._cell(row.get("reason") or "", 160),
            ]
        )
        + " |"
        for row in rows
    ]
    return header + "\n".join(lines) + "\n"


# =================================================================== helpers
def transformers_version() -> str | None:
    """The installed transformers version, or ``None``."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def environment() -> dict[str, str]:
    """The benchmark suite's record of GPU, versions, date and command line, with the transformers version."""
    return {**suite_environment(), "transformers": transformers_version() or "not installed"}


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure ``compile=True`` (torch.compile kernels inside the package's CUDA graphs) against the alternatives.

    python benchmarks/compile.py --out benchmarks/results/compile          # small and medium GPT, fp32 and bf16
    python benchmarks/compile.py --out DIR --models small --precisions bf16-mixed --steps 160 --timed 60
    python benchmarks/compile.py --out DIR --rounds 1                      # one fit per variant

Models: the GPTs of ``benchmarks/variants.py`` (``CONFIGS["small"]``: 6 layers, width 256, sequence 128;
``CONFIGS["medium"]``: 6 layers, width 1024, sequence 512; batch 8, AdamW; ``tiny`` for a quick look). Variants,
each trained from the same seed on the same batches, one process, ``torch.compiler.reset()`` before each:

- ``eager``: eager Lightning;
- ``compile_reduce_overhead``: Lightning with ``model.model = torch.compile(model.model, mode="reduce-overhead")``;
- ``full_iteration``: ``CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=3)`` (``strategy="cudagraph_full"``);
- ``full_iteration+compile``: the same with ``compile=True``;
- ``layer``: ``CUDAGraphCallback(scope=["layer"], warmup_steps=3)``;
- ``layer+compile``: the same with ``compile=True``;
- ``pytorch_full_graph``: the hand-written whole-step capture of ``benchmarks/variants.py`` (no Lightning);
- ``thunder``: Lightning Thunder (``benchmarks/thunder_peer.py``; skipped, with its note, where it is not installed).

Every variant is timed the same way: a CUDA event at every batch start, read once at the end (no host sync per step);
the figure is the median of the distances between batch starts over the last ``--timed`` of ``--steps`` steps, in the
fastest of ``--rounds`` fits (the variants alternate round by round, so a stretch of slow host hits every variant).

Per variant also: the speedup over eager Lightning; the median host ms between batch starts over the same steps
(equal to the step time where the host paces the step); for the package's variants, a kernel profile of 10 steps
ending 5 steps before the timed ones (:mod:`benchmarks.kernels`: kernel ms per step and the floor ``compile=`` leaves
as it is, with which a ratio goal that needs a shorter step is marked out of reach); the package's report (stage,
level, reason, ``compile_s``, ``recompiles``, captures, replays, fallbacks, rollbacks, pool MiB, capture ms); peak
memory; the final loss; loss parity (the largest per-step difference from eager Lightning's loss over the first 100
steps); and three wall-clock
milestones of the Lightning variants, each taken with one host sync at that point only (never inside the timed steps).
The end of step ``n`` is read at the start of step ``n + 1`` (after Lightning fetched that batch, before any callback
of the package ran for it) or at the end of training:

- ``first_step_s``: the wall time of step 1 (a sync at its start and at its end);
- ``to_graphs_s``: from the call of ``trainer.fit`` to the end of the first step the package's report counts as run
  on graphs (``steps_replayed`` turns positive), with that step's number (``graphs_from_step``): the package's
  variants only;
- ``to_step_s``: from the call of ``trainer.fit`` to the end of step ``warmup_steps + 2`` = 5 (the eager warmup, the
  capture step and one step after it), the same point for every Lightning variant.

``compile_s`` is the report's for the package's variants; for ``compile_reduce_overhead`` and Thunder it is the wall
time of their first step (where torch.compile compiles the forward and backward; where Thunder traces, compiles and
captures), marked as such; it is not measured for the hand-written capture (nothing is compiled). Thunder's loop
(``benchmarks/thunder_peer.py``) trains batch ``i`` at step ``i`` and gives its first losses and first-step time;
the hand-written loop warms up three times on its first batch, so its steps do not line up with Lightning's: loss
parity and the milestones are not measured for it, nor ``to_step_s`` for Thunder. Inductor's on-disk cache is left
on, as users have it: a kernel compiled by an earlier variant or an earlier run compiles faster.

Speed ratios (ms of the reference / ms of the variant), with goals: ``full_iteration+compile`` vs ``full_iteration``
(at least 1.3x in 32-true, 1.8x in bf16-mixed), vs ``compile_reduce_overhead`` (2.5x), vs ``thunder`` (1.25x);
``layer+compile`` vs ``layer`` (1.2x); ``full_iteration+compile`` vs the hand-written capture (no goal).

Writes ``DIR/compile_<precision>.json``, a bar chart ``DIR/compile_<precision>.png`` (where matplotlib is importable)
and ``DIR/COMPILE.md`` (rebuilt from every ``compile_*.json`` in ``DIR``). On a machine without CUDA it says so and
exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch

from benchmarks import hf
from benchmarks.kernels import KernelWindow
from benchmarks.report import write_records_markdown
from benchmarks.run import environment as suite_environment
from benchmarks.variants import (
    CONFIGS,
    Result,
    _model_and_data,
    least,
    peak_memory,
    pytorch_variant,
    timing_trainer,
)
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

SCHEMA_VERSION = 1
NEEDS_CUDA = "benchmarks/compile.py measures CUDA graphs and needs a CUDA GPU; none is visible here."
MARKDOWN = "COMPILE.md"
KIND = "compile"

PRECISIONS = ("32-true", "bf16-mixed")
#: The GPT configs of ``benchmarks/variants.py`` this benchmark trains (``tiny`` for a quick run only).
MODELS = ("small", "medium", "tiny")
DEFAULT_MODELS = ("small", "medium")
WARMUP_STEPS = 3
#: ``to_step_s`` is taken at the end of this step: the warmup, the capture step and one step after it.
LATENCY_STEPS = WARMUP_STEPS + 2
PARITY_STEPS = 100
#: The kernel profile of a package variant: this many steps, ending this many steps before the timed ones.
KERNEL_STEPS, KERNEL_GAP = 10, 5

#: The variants, in the order they run and appear.
VARIANTS = (
    "eager",
    "compile_reduce_overhead",
    "full_iteration",
    "full_iteration+compile",
    "layer",
    "layer+compile",
    "pytorch_full_graph",
    "thunder",
)
#: Variants that train through the package (they have its report).
PACKAGE_VARIANTS = ("full_iteration", "full_iteration+compile", "layer", "layer+compile")
LIGHTNING_VARIANTS = ("eager", "compile_reduce_overhead", *PACKAGE_VARIANTS)
#: Variants that compile inside their first step (its wall time stands for their compile time).
FIRST_STEP_COMPILES = ("compile_reduce_overhead", "thunder")
LABELS = {
    "eager": "eager Lightning",
    "compile_reduce_overhead": '`torch.compile(mode="reduce-overhead")`',
    "full_iteration": '`strategy="cudagraph_full"`',
    "full_iteration+compile": '`strategy="cudagraph_full"` + `compile=True`',
    "layer": '`scope=["layer"]`',
    "layer+compile": '`scope=["layer"]` + `compile=True`',
    "pytorch_full_graph": "hand-written whole-step capture",
    "thunder": "Thunder",
}
#: Short names on the chart's axis.
CHART_LABELS = {
    "eager": "eager",
    "compile_reduce_overhead": "compile reduce-overhead",
    "full_iteration": "cudagraph_full",
    "full_iteration+compile": "cudagraph_full + compile",
    "layer": "layer",
    "layer+compile": "layer + compile",
    "pytorch_full_graph": "hand-written full graph",
    "thunder": "thunder",
}

#: The speed ratios reported: (variant, reference, least ratio wanted: one for all precisions, one per precision,
#: or ``None`` for no goal).
COMPARISONS: tuple[tuple[str, str, float | dict[str, float] | None], ...] = (
    ("full_iteration+compile", "full_iteration", {"32-true": 1.3, "bf16-mixed": 1.8}),
    ("full_iteration+compile", "compile_reduce_overhead", 2.5),
    ("full_iteration+compile", "thunder", 1.25),
    ("layer+compile", "layer", 1.2),
    ("full_iteration+compile", "pytorch_full_graph", None),
)


# =================================================================== command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on a bad value).

    Args:
        argv: The arguments (``sys.argv[1:]`` when ``None``).

    Returns:
        The options, with ``models`` and ``precisions`` as lists.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=160, help="training steps per variant (default: 160)")
    parser.add_argument("--timed", type=int, default=60, help="last steps of each variant timed (default: 60)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="fits of each variant, alternated; the fastest counts (default: 2)"
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated from {', '.join(MODELS)} (default: small,medium)",
    )
    parser.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated from {', '.join(PRECISIONS)} (default: both)",
    )
    args = parser.parse_args(argv)
    if args.steps < LATENCY_STEPS:
        parser.error(
            f"--steps must be at least {LATENCY_STEPS} (warmup, capture and a step on graphs; got {args.steps})"
        )
    if not 0 < args.timed < args.steps:
        parser.error(f"--timed must be at least 1 and below --steps (got {args.timed}, {args.steps})")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    if args.steps - args.timed < LATENCY_STEPS:
        print(
            f"note: timing starts at step {args.steps - args.timed}; the warmup, compilation and capture take the first"
            f" {LATENCY_STEPS} steps, so the timing includes them",
            flush=True,
        )
    args.models = hf.names(parser, "--models", "model", args.models, MODELS)
    args.precisions = hf.names(parser, "--precisions", "precision", args.precisions, PRECISIONS)
    return args


# =================================================================== running
def main(argv: list[str] | None = None) -> int:
    """Measure every model and precision asked for; write the JSON records, the charts and ``COMPILE.md``."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    skip = args.steps - args.timed
    env = environment()
    for precision in args.precisions:
        precision_started = time.perf_counter()
        measured = {}
        for model in args.models:
            print(
                f"{model} {precision}: {len(VARIANTS)} variants, {args.rounds} round(s), {args.steps} steps"
                f" ({args.timed} timed)",
                flush=True,
            )
            measured[model] = measure_model(model, precision, args.steps, skip, args.rounds)
            print(summary(measured[model]), flush=True)
        record = {
            "schema": SCHEMA_VERSION,
            "kind": KIND,
            "precision": precision,
            "steps": args.steps,
            "timed": args.timed,
            "rounds": args.rounds,
            "warmup_steps": WARMUP_STEPS,
            "latency_steps": LATENCY_STEPS,
            "parity_steps": min(PARITY_STEPS, args.steps),
            "wall_s": round(time.perf_counter() - precision_started, 1),
            "environment": env,
            "models": measured,
        }
        record.update(draw_chart_or_note(record, out))
        path = out / f"{KIND}_{precision}.json"
        with path.open("w") as handle:
            json.dump(record, handle, indent=2, allow_nan=False)
            handle.write("\n")
        print(f"wrote {path}" + (f" and {out / record['chart']}" if record["chart"] else f" ({record['chart_note']})"))
    markdown = write_markdown(out)
    print(f"wrote {markdown}")
    print(f"finished in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def measure_model(model: str, precision: str, steps: int, skip: int, rounds: int = 1) -> dict[str, Any]:
    """Every variant of one model in ``rounds`` alternated fits, their figures against eager Lightning, the ratios."""
    config = CONFIGS[model]
    fits: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    losses: dict[str, list[float]] = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            result, first_losses = run_variant(variant, config, precision, steps, skip)
            fits[variant].append(result)
            losses[variant] = losses.get(variant) or first_losses  # the same seed and batches every round
            print(progress_line(result), flush=True)
    results = [fastest_round(fits[variant]) for variant in VARIANTS]
    add_relative_figures(results, losses)
    return {"config": dict(config), "results": results, "ratios": ratios(results, precision)}


#: Figures read from a variant's first fit: later rounds find inductor's caches warm, so they compile faster.
COLD_START_FIGURES = ("compile_s", "compile_source", "first_step_s", "to_step_s", "to_graphs_s", "graphs_from_step")


def fastest_round(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's fit with the least median step, its time to steady state from the first fit, every round's median.

    One fit is not enough where the host paces a step: the host's speed differs between fits of the same graphs by
    a quarter or more, in stretches of consecutive fits (``scope=["layer"]`` on the medium GPT in bf16: 11.27, then
    8.82 ms/step in two fits of one run).

    Example:
        >>> fits = [{"median_ms": 3.0, "compile_s": 9.0}, {"median_ms": 2.0, "compile_s": 1.0}]
        >>> fastest_round(fits)
        {'median_ms': 2.0, 'compile_s': 9.0, 'round_ms': [3.0, 2.0]}
    """
    cold = {key: fits[0][key] for key in COLD_START_FIGURES if key in fits[0]}
    return {**least(fits, "median_ms"), **cold, "round_ms": [fit["median_ms"] for fit in fits]}


def run_variant(
    variant: str, config: dict[str, Any], precision: str, steps: int, skip: int
) -> tuple[dict[str, Any], list[float]]:
    """Train one variant and measure it; a failure is reported in its note, never hides the other variants."""
    torch.compiler.reset()  # each variant compiles afresh (and no variant meets another's recompile limit)
    gc.collect()
    torch.cuda.empty_cache()
    try:
        if variant in LIGHTNING_VARIANTS:
            return measure_lightning(variant, config, precision, steps, skip)
        if variant == "pytorch_full_graph":
            return figures(pytorch_variant(variant, config, precision, steps, skip)), []
        if variant == "thunder":
            return thunder_figures(thunder_result(config, precision, steps, skip))
        raise ValueError(f"unknown variant {variant!r}")
    except Exception as err:
        torch.cuda.set_stream(torch.cuda.default_stream())
        return figures(Result(variant, note=failure_note(err))), []


def thunder_result(config: dict[str, Any], precision: str, steps: int, skip: int) -> Result:
    """Thunder's figures, or its note where Thunder is not installed (imported here: the peer module is optional)."""
    from benchmarks.thunder_peer import THUNDER_SKIPPED, thunder_available, thunder_variant

    if not thunder_available():
        return Result("thunder", note=THUNDER_SKIPPED)
    return thunder_variant(config, precision, steps, skip)


def thunder_figures(result: Result) -> tuple[dict[str, Any], list[float]]:
    """Thunder's figures and first losses: its ``first_step_s`` and ``losses`` where its result has them."""
    first_step_s = getattr(result, "first_step_s", math.nan)
    milestones = {"first_step_s": hf._finite_or_none(first_step_s)}
    return figures(result, None, milestones), list(getattr(result, "losses", []))


def failure_note(err: Exception) -> str:
    """The note of a variant that raised."""
    return f"failed: {type(err).__name__}: {str(err)[:200]}"


def variant_setup(variant: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """How a Lightning variant trains: ``CUDAGraphCallback`` options and ``CUDAGraphStrategy`` options (or ``None``).

    Raises:
        ValueError: A variant that is not a Lightning variant.
    """
    if variant not in LIGHTNING_VARIANTS:
        raise ValueError(f"unknown Lightning variant {variant!r}")
    if variant in ("eager", "compile_reduce_overhead"):
        return None, None
    scope, _, compiled = variant.partition("+")
    options: dict[str, Any] = {"scope": [scope], "warmup_steps": WARMUP_STEPS}
    if compiled:
        options["compile"] = True
    return (None, options) if scope == "full_iteration" else (options, None)


def measure_lightning(
    variant: str, config: dict[str, Any], precision: str, steps: int, skip: int
) -> tuple[dict[str, Any], list[float]]:
    """One Lightning variant's step times, milestones, peak memory, report and first losses."""
    model, data = _model_and_data(config)
    if variant == "compile_reduce_overhead":
        model.model = torch.compile(model.model, mode="reduce-overhead")
    callback_options, strategy_options = variant_setup(variant)
    clock = CompileClock(min(PARITY_STEPS, steps), LATENCY_STEPS)
    # The clock comes first: at its batch start, the package has done all of the previous step and none of this one.
    callbacks: list[pl.Callback] = [clock]
    window = kernel_window(variant, skip)
    if window is not None:
        callbacks.append(window)
    if callback_options is not None:
        callbacks.append(CUDAGraphCallback(**callback_options))
    strategy: Any = "auto" if strategy_options is None else CUDAGraphStrategy(**strategy_options)
    trainer = timing_trainer(steps, callbacks, strategy, precision)
    with peak_memory() as peak:
        clock.milestones.fit_starts()
        trainer.fit(model, data)
    result = Result(variant, clock.step_times(skip), peak_mib=peak(), final_loss=float(clock.last_loss))
    losses = torch.stack(clock.losses).float().tolist() if clock.losses else []
    graph = graph_callback(trainer)
    report = None if graph is None else report_figures(graph.report)
    out = figures(result, report, clock.milestones.as_dict())
    out["host_ms"] = clock.host_median_ms(skip)
    out["kernels"] = None if window is None else window.summary
    return out, losses


def kernel_window(variant: str, skip: int) -> KernelWindow | None:
    """The kernel profile of a package variant, on graphs and before the timed steps (``None``: no room for it)."""
    start = skip - KERNEL_GAP - KERNEL_STEPS
    if variant not in PACKAGE_VARIANTS or start < LATENCY_STEPS:
        return None
    return KernelWindow(start, KERNEL_STEPS)


def graph_callback(trainer: pl.Trainer) -> CUDAGraphCallback | None:
    """The Trainer's ``CUDAGraphCallback`` (the one a strategy adds included), or ``None``."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)), None)


class Milestones:
    """Wall-clock milestones of one fit, each taken with a host sync at that point only.

    Fed with the number of steps done at every batch start and at the end of training, so at most four syncs happen
    per fit: fit start, the start and end of step 1, the end of step ``latency_steps``, and the end of the first step
    on graphs (several of which can coincide).

    Args:
        latency_steps: The step whose end ``to_step_s`` is taken at.
        sync: Waits for the device (``torch.cuda.synchronize``).
        now: The host clock in seconds.
    """

    def __init__(
        self,
        latency_steps: int,
        sync: Callable[[], None] = torch.cuda.synchronize,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.latency_steps = latency_steps
        self._sync, self._now = sync, now
        self.fit_started = math.nan
        self.first_step_started = math.nan
        self.first_step_s = math.nan
        self.to_step_s = math.nan
        self.to_graphs_s = math.nan
        #: The 1-based number of the first step the package's report counts as run on graphs.
        self.graphs_from_step: int | None = None

    def fit_starts(self) -> None:
        """Called right before ``trainer.fit``."""
        self.fit_started = self._synced_now()

    def steps_done(self, done: int, replayed: int | None) -> None:
        """Called with the steps finished so far and the report's ``steps_replayed`` (``None``: no package)."""
        first_on_graphs = bool(replayed) and self.graphs_from_step is None
        if done not in (0, 1, self.latency_steps) and not first_on_graphs:
            return
        now = self._synced_now()
        if done == 0:
            self.first_step_started = now
        if done == 1:
            self.first_step_s = now - self.first_step_started
        if done == self.latency_steps:
            self.to_step_s = now - self.fit_started
        if first_on_graphs:
            self.graphs_from_step = done
            self.to_graphs_s = now - self.fit_started

    def as_dict(self) -> dict[str, Any]:
        """The milestones as JSON-ready values (``None`` where not reached)."""
        return {
            "first_step_s": hf._finite_or_none(self.first_step_s),
            "to_step_s": hf._finite_or_none(self.to_step_s),
            "to_graphs_s": hf._finite_or_none(self.to_graphs_s),
            "graphs_from_step": self.graphs_from_step,
        }

    def _synced_now(self) -> float:
        self._sync()
        return self._now()


class CompileClock(hf.LossClock):
    """:class:`~benchmarks.hf.LossClock` (events at batch starts, the first losses) with the fit's :class:`Milestones`.

    The milestones are fed at every batch start (the steps done before it) and at the end of training.
    """

    def __init__(self, parity_steps: int, latency_steps: int) -> None:
        super().__init__(parity_steps)
        self.milestones = Milestones(latency_steps)
        self._graph: CUDAGraphCallback | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.milestones.steps_done(len(self.events), self._replayed(trainer))
        super().on_train_batch_start(trainer, pl_module, batch, idx)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.milestones.steps_done(len(self.events), self._replayed(trainer))

    def _replayed(self, trainer: pl.Trainer) -> int | None:
        if self._graph is None:
            self._graph = graph_callback(trainer)
        return None if self._graph is None else self._graph.report.steps_replayed


# =================================================================== figures (pure)
def report_figures(report: Any) -> dict[str, Any]:
    """What the benchmark keeps of the package's report, as JSON-ready values (``compile_s`` and ``recompiles``
    read as ``None`` where the report has no such field)."""
    compile_s = getattr(report, "compile_s", None)
    return {
        **hf.report_core(report),
        "level": getattr(report, "level", None),
        "compile_s": None if compile_s is None else hf._finite_or_none(float(compile_s)),
        "recompiles": getattr(report, "recompiles", None),
        "steps_replayed": report.steps_replayed,
    }


def figures(
    result: Result, report: dict[str, Any] | None = None, milestones: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A variant's figures as JSON-ready values: timing, memory, loss, report, milestones and ``compile_s``."""
    out = hf.as_dict(result)
    out["report"] = report
    out.update({"first_step_s": None, "to_step_s": None, "to_graphs_s": None, "graphs_from_step": None})
    out.update(milestones or {})
    out["compile_s"], out["compile_source"] = compile_figure(result.variant, report, out["first_step_s"])
    return out


def compile_figure(
    variant: str, report: dict[str, Any] | None, first_step_s: float | None
) -> tuple[float | None, str | None]:
    """A variant's compile time in seconds and where it comes from (``None`` where it is not measured).

    The package's report says it for the package's variants; ``compile_reduce_overhead`` and Thunder compile during
    their first step, so that step's wall time stands for it; nothing else is measured.
    """
    if report is not None and report.get("compile_s") is not None:
        return report["compile_s"], "report"
    if variant in FIRST_STEP_COMPILES and first_step_s is not None:
        return first_step_s, "first step"
    return None, None


def add_relative_figures(results: list[dict[str, Any]], losses: dict[str, list[float]]) -> None:
    """Add each variant's ``speedup`` over eager Lightning and ``loss_max_abs_diff`` from its losses (in place)."""
    eager = next((r for r in results if r["variant"] == "eager"), None)
    eager_ms = None if eager is None else eager["median_ms"]
    for result in results:
        result["speedup"] = speed_ratio(eager_ms, result["median_ms"])
        diff = hf.max_abs_diff(losses.get("eager", []), losses.get(result["variant"], []))
        result["loss_max_abs_diff"] = hf._finite_or_none(diff)


def speed_ratio(reference_ms: float | None, variant_ms: float | None) -> float | None:
    """How much faster the variant is than the reference: ``reference_ms / variant_ms`` (``None`` if unmeasured)."""
    return hf._finite_or_none(hf._ratio(reference_ms, variant_ms))


def goal_for(goal: float | dict[str, float] | None, precision: str) -> float | None:
    """The least ratio wanted at a precision (``None``: no goal there)."""
    return goal.get(precision) if isinstance(goal, dict) else goal


def graphs_off(result: dict[str, Any]) -> str | None:
    """Why a package variant did not end the fit on graphs (rolled back or disabled), or ``None``."""
    report = result.get("report") or {}
    if report.get("rollback_reasons"):
        return f"rolled back: {report['rollback_reasons'][0]}"
    if report.get("stage") == "DISABLED":
        return f"graphs off: {report.get('reason') or 'disabled'}"
    return None


def ratios(results: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
    """The speed ratios of :data:`COMPARISONS`, with their goals at ``precision``.

    Args:
        results: The variants' figures (``variant``, ``median_ms``, ``note`` and ``report`` are read).
        precision: The precision trained (a goal may depend on it).

    Returns:
        One entry per comparison: ``variant``; ``reference``; ``ratio`` (ms of the reference over ms of the variant,
        ``None`` where either was not measured); ``goal`` (``None`` without one); ``met`` (``None`` without a goal or
        a ratio); ``why``: for a side not measured, its note, and for a package variant that did not stay on
        graphs, why; ``needed_ms``: the step the goal asks of the variant; ``floor_ms``: the variant's kernel time
        that ``compile=`` leaves as it is (:mod:`benchmarks.kernels`); ``reachable``: whether ``needed_ms`` is at
        least that floor (``None`` where either is not known); ``kernel_ms`` and ``host_ms``: the variant's kernel
        time and host time per step; ``limit``: for a missed goal, what alone takes longer than ``needed_ms``
        (:func:`limit_of`).
    """
    by_name = {r["variant"]: r for r in results}
    entries = []
    for variant, reference, goal in COMPARISONS:
        sides = [by_name.get(variant), by_name.get(reference)]
        ms = [None if side is None else side.get("median_ms") for side in sides]
        ratio = speed_ratio(ms[1], ms[0])
        why = []
        for name, side, side_ms in zip((variant, reference), sides, ms, strict=True):
            if side_ms is None:
                why.append(f"{name}: {(side or {}).get('note') or 'not measured'}")
            elif side is not None and graphs_off(side):
                why.append(f"{name}: {graphs_off(side)}")
        wanted = goal_for(goal, precision)
        met = None if wanted is None or ratio is None else ratio >= wanted
        kernels = (sides[0] or {}).get("kernels") or {}
        floor, kernel_ms, host_ms = kernels.get("floor_ms"), kernels.get("kernel_ms"), (sides[0] or {}).get("host_ms")
        needed = None if wanted is None or ms[1] is None else round(ms[1] / wanted, 4)
        reachable = None if floor is None or needed is None else needed >= floor
        entries.append(
            {
                "variant": variant,
                "reference": reference,
                "ratio": ratio,
                "goal": wanted,
                "met": met,
                "why": why,
                "needed_ms": needed,
                "floor_ms": floor,
                "reachable": reachable,
                "kernel_ms": kernel_ms,
                "host_ms": host_ms,
                "limit": None if met is not False else limit_of(needed, floor, kernel_ms, host_ms),
            }
        )
    return entries


def limit_of(
    needed_ms: float | None, floor_ms: float | None, kernel_ms: float | None, host_ms: float | None
) -> str | None:
    """What alone takes longer than the step a goal needs, the hardest limit first (``None``: nothing measured does).

    - ``"floor"``: the GEMM, attention and optimizer kernels, which no fusion by ``compile=`` shortens;
    - ``"kernels"``: the compiled kernels as inductor made them (fewer or faster ones could still reach it);
    - ``"host"``: the host's time per step (Lightning's loop, the eager code around the graphs), where the kernels
      fit: compiling cuts GPU time, not host time.

    Example:
        >>> limit_of(needed_ms=1.0, floor_ms=0.5, kernel_ms=1.2, host_ms=0.8)
        'kernels'
    """
    if needed_ms is None:
        return None
    for limit, ms in (("floor", floor_ms), ("kernels", kernel_ms)):
        if ms is not None and ms > needed_ms:
            return limit
    if kernel_ms is not None and host_ms is not None and host_ms > needed_ms:  # the GPU is not what paces it
        return "host"
    return None


# =================================================================== text
def progress_line(result: dict[str, Any]) -> str:
    """One line per variant as it finishes."""
    report = result.get("report") or {}
    parts = [f"{result['variant']:>24}: {_num(result['median_ms'], 3):>8} ms/step"]
    if report:
        parts.append(report["stage"].lower())
    if result.get("compile_s") is not None:
        parts.append(f"compile {result['compile_s']:.1f} s ({result['compile_source']})")
    if result.get("graphs_from_step") is not None:
        parts.append(f"on graphs from step {result['graphs_from_step']} ({result['to_graphs_s']:.1f} s)")
    return "  ".join([*parts, note(result)]).rstrip()


def ratio_line(entry: dict[str, Any]) -> str:
    """One ratio in words, with its goal and, where a side is missing or fell off graphs, why."""
    ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.2f}x"
    goal = ""
    if entry["goal"] is not None:
        verdict = "n/a" if entry["met"] is None else ("goal met" if entry["met"] else "goal missed")
        goal = f" (goal >= {entry['goal']:.2f}x: {verdict})"
    why = f"; {'; '.join(entry['why'])}" if entry["why"] else ""
    limit = entry.get("limit")
    if limit is not None:
        needs = f"the goal needs at most {entry['needed_ms']:.2f} ms/step, and the variant's"
        why += {
            "floor": f"; out of reach by compiling: {needs} GEMM, attention and optimizer kernels alone take"
            f" {entry['floor_ms']:.2f} ms",
            "kernels": f"; bounded by the compiled kernels: {needs} kernels take {entry['kernel_ms']:.2f} ms (its"
            f" GEMM, attention and optimizer kernels {entry['floor_ms']:.2f} ms)",
            "host": f"; paced by the host: {needs} host takes {entry['host_ms']:.2f} ms a step (its kernels"
            f" {entry['kernel_ms']:.2f} ms), which compiling does not shorten",
        }[limit]
    return f"{_label(entry['variant'])} vs {_label(entry['reference'])}: {ratio}{goal}{why}"


def summary(measured: dict[str, Any]) -> str:
    """The ratios of one model, as printed after its variants."""
    return "\n".join(f"  {ratio_line(entry)}" for entry in measured["ratios"])


def write_markdown(out: Path) -> Path:
    """``COMPILE.md`` from every ``compile_*.json`` in ``out``: per model and precision, the table and the ratios."""
    title = "`compile=True`: torch.compile kernels inside CUDA graphs"
    return write_records_markdown(out / MARKDOWN, KIND, PRECISIONS, title, section)


def section(record: dict[str, Any]) -> str:
    """The Markdown of one record: per model, its table and ratios; then the record's chart."""
    env = record["environment"]
    skip = record["steps"] - record["timed"]
    parts = []
    for model, measured in record["models"].items():
        config = measured["config"]
        parts.append(
            f"## GPT {model}, {record['precision']}\n\n"
            f"{config['n_layer']} layers, width {config['width']}, {config['heads']} heads, sequence"
            f" {config['seq_len']}, batch {config['batch_size']}, vocabulary {config['vocab_size']}, AdamW;"
            f" `warmup_steps={record['warmup_steps']}`. Median ms per step over the last {record['timed']} of"
            f" {record['steps']} steps (CUDA events between batch starts, no host sync per step), in the fastest of"
            f" {record.get('rounds', 1)} alternated fits (*rounds ms*: every fit's median; compile and milestones"
            " from the first fit, with inductor's caches cold). *host ms*: the"
            " median host time between batch starts over the same steps (the step time where the host paces it)."
            " *kernel ms (floor)*: the package's variants, from a 10-step profile before the timed steps: GPU kernel"
            " time per step and, in brackets, its GEMM, attention and optimizer kernels, which `compile=` leaves as"
            " they are. *compile s*: the"
            " package's report for its variants; for reduce-overhead and Thunder, the wall time of the first step"
            " (marked *1st*)."
            " *first step s*: wall time of step 1. *to graphs s*: from the call of `trainer.fit` to the end of the"
            " first step the package's report counts as run on graphs (that step in brackets)."
            f" *{record['latency_steps']} steps s*: from the call of `trainer.fit` to the end of step"
            f" {record['latency_steps']}, the same point for every Lightning variant. Each milestone is one host sync"
            " there. Loss parity: the largest per-step difference from eager Lightning's loss over the first"
            f" {record['parity_steps']} steps. n/a: not measured for that variant. {env['gpu']}, torch"
            f" {env['torch']}, lightning {env['lightning']}, thunder {env.get('thunder', 'n/a')}, {env['date']}.\n\n"
            + table(measured["results"], record["latency_steps"], skip)
            + "\nSpeed ratios (ms of the reference / ms of the variant):\n\n"
            + "".join(f"- {ratio_line(entry)}\n" for entry in measured["ratios"])
        )
    if record.get("chart"):
        parts.append(f"![median ms/step per variant, {record['precision']}]({record['chart']})\n")
    else:
        parts.append(f"No chart for {record['precision']}: {record.get('chart_note') or 'not drawn'}.\n")
    return "\n".join(parts)


def table(results: list[dict[str, Any]], latency_steps: int, skip: int) -> str:
    """The variants of one model: ms/step, speedup, stage, compile time, milestones, memory, loss and notes."""
    header = (
        f"| variant | ms/step | host ms | kernel ms (floor) | vs eager | stage | compile s | first step s | to graphs s"
        f" | {latency_steps} steps s | peak MiB | final loss | loss parity | note | rounds ms |\n"
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n"
    )
    rows = []
    for result in results:
        report = result.get("report") or {}
        stage = report.get("stage", "").lower()
        if report.get("level"):
            stage += f" ({report['level']})"
        compile_s = _num(result.get("compile_s"), 1)
        if result.get("compile_source") == "first step":
            compile_s += " *1st*"
        to_graphs = _num(result.get("to_graphs_s"), 2)
        if result.get("graphs_from_step") is not None:
            to_graphs += f" ({result['graphs_from_step']})"
        speedup = result.get("speedup")
        kernels = result.get("kernels") or {}
        cells = [
            _label(result["variant"]),
            _num(result["median_ms"], 2),
            _num(result.get("host_ms"), 2),
            f"{kernels['kernel_ms']:.2f} ({kernels['floor_ms']:.2f})" if kernels else "",
            "n/a" if speedup is None else f"{speedup:.2f}x",
            stage,
            compile_s,
            _num(result.get("first_step_s"), 2),
            to_graphs if result["variant"] in PACKAGE_VARIANTS else "",
            _num(result.get("to_step_s"), 2),
            _num(result.get("peak_mib"), 0),
            _num(result.get("final_loss"), 4),
            "" if result["variant"] == "eager" else _num(result.get("loss_max_abs_diff"), None),
            hf._cell(note(result, skip), 200),
            " / ".join(_num(ms, 2) for ms in result.get("round_ms", [])),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return header + "\n".join(rows) + "\n"


def note(result: dict[str, Any], skip: int | None = None) -> str:
    """A variant's note: its failure or skip, why graphs are off, recompiles, graphs reached inside the timing."""
    report = result.get("report") or {}
    parts = [result.get("note", ""), *(f"rolled back: {r}" for r in report.get("rollback_reasons") or [])]
    if not report.get("rollback_reasons") and report.get("reason"):
        parts.append(f"graphs off: {report['reason']}")
    if report.get("recompiles"):
        parts.append(f"{report['recompiles']} recompile(s)")
    if report.get("fallbacks"):
        parts.append(f"{report['fallbacks']} fallback(s)")
    graphs_from = result.get("graphs_from_step")
    if skip is not None and graphs_from is not None and graphs_from > skip:
        parts.append(f"on graphs only from step {graphs_from}: the timing (from step {skip + 1}) has eager steps")
    return "; ".join(filter(None, parts))


# =================================================================== chart
def draw_chart_or_note(record: dict[str, Any], out: Path) -> dict[str, str | None]:
    """Draw the record's chart into ``out``: ``chart`` (its file name) or ``chart_note`` (why there is none)."""
    name = f"{KIND}_{record['precision']}.png"
    try:
        draw_chart(record, out / name)
    except ImportError as err:
        return {"chart": None, "chart_note": f"matplotlib is not importable ({err})"}
    except Exception as err:  # a chart must never cost the figures
        return {"chart": None, "chart_note": f"drawing failed: {type(err).__name__}: {str(err)[:160]}"}
    return {"chart": name, "chart_note": None}


def draw_chart(record: dict[str, Any], path: Path) -> Path:
    """Horizontal bars of median ms/step per variant, one panel per model, labelled with the speedup over eager."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(record["models"].items())
    rows = max(len(measured["results"]) for _, measured in models)
    fig, axes = plt.subplots(len(models), 1, figsize=(8, (0.4 * rows + 1.2) * len(models)), squeeze=False)
    for ax, (model, measured) in zip(axes[:, 0], models, strict=True):
        results = measured["results"]
        names = [CHART_LABELS.get(r["variant"], r["variant"]) for r in results]
        values = [r["median_ms"] or 0.0 for r in results]
        positions = range(len(results))
        ax.barh(positions, values, color=[_bar_color(r["variant"]) for r in results])
        for position, result, value in zip(positions, results, values, strict=True):
            speedup = result.get("speedup")
            text = "  n/a" if result["median_ms"] is None else f"  {value:.2f} ms ({_num(speedup, 2)}x)"
            ax.text(value, position, text, va="center", fontsize=8)
        ax.set_yticks(list(positions), names)
        ax.invert_yaxis()
        ax.set_xlabel("median ms/step (label: ms and speedup over eager Lightning)")
        ax.set_title(f"GPT {model}, {record['precision']} - {record['environment'].get('gpu', '')}", fontsize=10)
        ax.margins(x=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bar_color(variant: str) -> str:
    if variant == "eager":
        return "tab:gray"
    if variant.endswith("+compile"):
        return "tab:green"
    if variant in PACKAGE_VARIANTS:
        return "tab:blue"
    return "tab:orange"


# =================================================================== helpers
def environment() -> dict[str, str]:
    """The benchmark suite's record of GPU, versions, date and command line, with Thunder's version."""
    return {**suite_environment(), "thunder": thunder_version()}


def thunder_version() -> str:
    """The installed lightning-thunder version, or ``not installed``."""
    try:
        return metadata.version("lightning-thunder")
    except metadata.PackageNotFoundError:
        return "not installed"


def _label(variant: str) -> str:
    return LABELS.get(variant, variant)


def _num(value: float | None, digits: int | None) -> str:
    return "n/a" if value is None else hf._fmt(value, digits)


if __name__ == "__main__":
    raise SystemExit(main())

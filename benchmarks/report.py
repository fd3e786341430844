"""Turn the JSON that ``benchmarks/run.py`` writes into Markdown tables and PNG charts.

Regenerate ``RESULTS.md`` and every chart from the JSON files of a results directory (no GPU needed)::

    python benchmarks/report.py benchmarks/results

Every ratio and verdict is computed from the measurements in the JSON; nothing here holds a figure of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_RESULTS = BENCH_DIR / "results"
RESULTS_FILE = "RESULTS.md"

#: The variant every "vs eager Lightning" ratio divides.
BASELINE = "eager"
#: Transformer Engine runs compare TE graphs with the same TE model trained eagerly.
TE_BASELINE = "te_eager"
#: Variants that capture part of the model, compared with the hand-written per-block capture.
SCOPED_VARIANTS = frozenset({"attn", "mlp", "attn+mlp", "layer", "te_layer", "moe_router+preprocess"})
#: Variants that run no CUDA graph at all (left out of "do graphs pay" verdicts).
NO_GRAPH_VARIANTS = frozenset({"eager", "te_eager", "pytorch_eager", "compile_default"})
#: A speedup below this is "graphs gain little" in the verdicts.
GAIN_THRESHOLD = 1.05

CONFIG_ORDER = ("small", "medium", "moe", "tiny")
PRECISION_ORDER = ("32-true", "bf16-mixed")
#: The Transformer Engine variants (measured only where TE is installed); their runs get their own files.
TE_VARIANTS = ("te_eager", "te_layer")
PRECISION_LABELS = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "transformer-engine": "FP8 (transformer-engine)"}
MISSING = "n/a"

LEGEND = (
    "*vs eager Lightning*: the median step time of eager Lightning over the variant's (above 1.00x: faster). "
    "*vs hand-written*: the same ratio against the hand-written capture of the same region without the package: "
    "`handwritten_layer` for scoped variants, `pytorch_full_graph` for `full_iteration`, `pytorch_eager` for "
    "`eager` (1.00x: the package matches the hand-written code). Step times are CUDA-event distances between "
    "consecutive batch starts, after the skipped warmup and capture steps."
)


def handwritten_reference(variant: str) -> str | None:
    """The hand-written variant a Lightning variant is compared with, or ``None``."""
    if variant in SCOPED_VARIANTS:
        return "handwritten_layer"
    return {"full_iteration": "pytorch_full_graph", "eager": "pytorch_eager"}.get(variant)


def ratio(reference_ms: float | None, ms: float | None) -> float | None:
    """``reference_ms / ms`` (a speedup over the reference), or ``None`` when either is missing."""
    if not (_finite(reference_ms) and _finite(ms)) or ms <= 0:
        return None
    return reference_ms / ms


def precision_label(precision: str) -> str:
    """``fp32`` for ``32-true``; other precisions as Lightning names them."""
    return PRECISION_LABELS.get(precision, precision)


def load_records(out: Path, kind: str, precisions: Sequence[str]) -> list[dict[str, Any]]:
    """The records of one benchmark script in ``out`` (``<kind>_*.json`` whose ``kind`` is ``kind``), by precision."""
    records = []
    for path in sorted(out.glob(f"{kind}_*.json")):
        with path.open() as handle:
            record = json.load(handle)
        if isinstance(record, dict) and record.get("kind") == kind:
            records.append(record)
    order = {precision: i for i, precision in enumerate(precisions)}
    return sorted(records, key=lambda record: order.get(record.get("precision"), len(order)))


def write_records_markdown(
    path: Path, kind: str, precisions: Sequence[str], title: str, section: Callable[[dict[str, Any]], str]
) -> Path:
    """Markdown at ``path`` from the records of ``benchmarks/<kind>.py`` beside it: a title, a section per record."""
    records = load_records(path.parent, kind, precisions)
    text = f"# {title}\n\nWritten by `benchmarks/{kind}.py` from the JSON beside this file.\n"
    path.write_text(text + "".join(f"\n{section(record)}" for record in records))
    return path


def load_runs(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The run records (JSON files of ``benchmarks/run.py``) in a directory, in report order; others are skipped."""
    runs = []
    for path in sorted(Path(results_dir).glob("*.json")):
        with path.open() as handle:
            record = json.load(handle)
        if isinstance(record, dict) and {"schema", "config", "precision", "results"} <= record.keys():
            runs.append({**record, "file": path.name})
        else:
            print(f"skipped {path}: not a results record of benchmarks/run.py", file=sys.stderr)
    return sorted(runs, key=_run_order)


def medians(run: dict[str, Any], batch_size: int | None = None) -> dict[str, float | None]:
    """Median ms/step per variant of a run (of one batch size when given)."""
    return {
        r["variant"]: r.get("median_ms")
        for r in run["results"]
        if batch_size is None or r.get("batch_size") == batch_size
    }


def is_handwritten(variant: str) -> bool:
    """Whether a variant is hand-written code that does not use the package (``pytorch_*``, ``handwritten_*``)."""
    return variant.startswith(("pytorch_", "handwritten_"))


def best_graph_speedup(run: dict[str, Any], handwritten: bool = True) -> tuple[str, float] | None:
    """The graph variant with the largest speedup over eager Lightning, and that speedup.

    Args:
        run: A run record.
        handwritten: Consider the hand-written variants too (``False``: Lightning variants only).
    """
    by_variant = medians(run)
    speedups = {
        variant: ratio(by_variant.get(baseline_of(by_variant)), ms)
        for variant, ms in by_variant.items()
        if variant not in NO_GRAPH_VARIANTS and (handwritten or not is_handwritten(variant))
    }
    measured = {variant: s for variant, s in speedups.items() if s is not None}
    if not measured:
        return None
    variant = max(measured, key=measured.__getitem__)
    return variant, measured[variant]


def verdict(run: dict[str, Any], threshold: float = GAIN_THRESHOLD) -> str:
    """One line on whether graphs pay for this config and precision, computed from its medians."""
    best = best_graph_speedup(run)
    if best is None:
        return "no verdict: eager Lightning or every graph variant is missing"
    speedup = best[1]
    gain = _gain(best, best_graph_speedup(run, handwritten=False))
    if speedup < 1.0:
        line = f"graphs do not pay here: every graph variant is slower than eager Lightning ({gain})"
    elif speedup < threshold:
        line = f"compute-bound: graphs gain <{(threshold - 1) * 100:.0f}% ({gain})"
    else:
        line = f"host-bound: graphs pay ({gain})"
    return line + _full_iteration_gap(run)


def _gain(best: tuple[str, float], best_lightning: tuple[str, float] | None) -> str:
    if best_lightning is None:
        return f"best `{best[0]}`: {best[1]:.2f}x eager Lightning"
    text = f"best Lightning variant `{best_lightning[0]}`: {best_lightning[1]:.2f}x eager Lightning"
    return text if best == best_lightning else f"{text}; hand-written `{best[0]}`: {best[1]:.2f}x"


def _full_iteration_gap(run: dict[str, Any]) -> str:
    by_variant = medians(run)
    reference = handwritten_reference("full_iteration")
    gap = ratio(by_variant.get(reference), by_variant.get("full_iteration"))
    return "" if gap is None else f"; `full_iteration` runs at {gap:.2f}x the hand-written `{reference}`"


def table_markdown(run: dict[str, Any]) -> str:
    """A Markdown table of one run: one row per variant, with the ratios to eager and to hand-written code."""
    by_variant = medians(run)
    header = (
        "| variant | median ms/step | p25-p75 ms | vs eager Lightning | vs hand-written | peak MiB"
        " | graph pool MiB | capture ms | replays | fallbacks | final loss | note |"
    )
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in run["results"]:
        reference = handwritten_reference(r["variant"])
        cells = [
            r["variant"],
            _number(r.get("median_ms"), 3),
            _spread(r.get("p25_ms"), r.get("p75_ms")),
            _times(ratio(by_variant.get(baseline_of(by_variant)), r.get("median_ms"))),
            _times(ratio(by_variant.get(reference), r.get("median_ms"))) if reference else MISSING,
            _number(r.get("peak_mib"), 0),
            _number(r.get("pool_mib"), 1),
            _number(r.get("capture_ms"), 0),
            str(r.get("replays", 0)),
            str(r.get("fallbacks", 0)),
            _number(r.get("final_loss"), 4),
            str(r.get("note", "")).replace("|", "/"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_title(run: dict[str, Any]) -> str:
    """``small, fp32, batch 8`` (``small, Transformer Engine GPT, ...`` for a TE run): what a run measured."""
    model = f"{run['config']}, Transformer Engine GPT" if record_stem(run).endswith("_te") else run["config"]
    return f"{model}, {precision_label(run['precision'])}, batch {run.get('batch_size', MISSING)}"


def environment_line(run: dict[str, Any]) -> str:
    """Where and how a run was measured, from its ``environment``."""
    env = run.get("environment", {})
    versions = f"torch {env.get('torch', MISSING)}, lightning {env.get('lightning', MISSING)}"
    timed = f"{run.get('steps', MISSING)} steps per variant, the first {run.get('skip', MISSING)} not timed"
    return (
        f"{env.get('gpu', 'unknown GPU')}, {versions}, {env.get('date', MISSING)}; {timed};"
        f" measured by `{env.get('command', MISSING)}`"
    )


def run_section(run: dict[str, Any], chart: str | None = None) -> str:
    """The Markdown of one run: title, verdict, optional chart, table and environment."""
    parts = [f"### {run_title(run)}", "", f"**Verdict:** {verdict(run)}", ""]
    if chart:
        parts += [f"![ms/step per variant, {run_title(run)}]({chart})", ""]
    parts += [table_markdown(run), "", f"<sub>{environment_line(run)}</sub>", ""]
    return "\n".join(parts)


def sweep_batch_sizes(run: dict[str, Any]) -> list[int]:
    """The batch sizes a sweep measured, ascending."""
    return sorted({r["batch_size"] for r in run["results"] if r.get("batch_size") is not None})


def sweep_variants(run: dict[str, Any]) -> list[str]:
    """The variants of a sweep in the order they were run."""
    return list(dict.fromkeys(r["variant"] for r in run["results"]))


def sweep_speedups(run: dict[str, Any], variant: str) -> list[float | None]:
    """A variant's speedup over eager Lightning at each batch size of a sweep (``None`` where unmeasured)."""
    points = []
    for batch in sweep_batch_sizes(run):
        by_variant = medians(run, batch)
        points.append(ratio(by_variant.get(baseline_of(by_variant)), by_variant.get(variant)))
    return points


def pays_until(batch_sizes: Sequence[int], speedups: Sequence[float | None], threshold: float = GAIN_THRESHOLD) -> str:
    """Where a variant stops paying: the first batch size at which its speedup drops below ``threshold``."""
    measured = [(b, s) for b, s in zip(batch_sizes, speedups, strict=True) if s is not None]
    if not measured:
        return "not measured"
    below = [b for b, s in measured if s < threshold]
    if not below:
        return f"pays at every batch size measured (up to {measured[-1][0]})"
    if below[0] == measured[0][0]:
        return f"gains <{(threshold - 1) * 100:.0f}% from the smallest batch size ({below[0]}) on"
    return f"stops paying (<{threshold:.2f}x) at batch {below[0]}"


def sweep_verdict(run: dict[str, Any], threshold: float = GAIN_THRESHOLD) -> str:
    """One line per sweep: where each graph variant stops paying, computed from the medians."""
    batch_sizes = sweep_batch_sizes(run)
    graphed = [v for v in sweep_variants(run) if v not in NO_GRAPH_VARIANTS]
    if not graphed:
        return "no verdict: no graph variant in the sweep"
    parts = [f"`{v}` {pays_until(batch_sizes, sweep_speedups(run, v), threshold)}" for v in graphed]
    return "; ".join(parts)


def sweep_table(run: dict[str, Any]) -> str:
    """A Markdown table of a sweep: median ms/step of each variant and speedups over eager, per batch size."""
    variants = sweep_variants(run)
    graphed = [v for v in variants if v != BASELINE]
    header = ["batch", *(f"{v} ms" for v in variants), *(f"{v} vs eager" for v in graphed)]
    rows = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for batch in sweep_batch_sizes(run):
        by_variant = medians(run, batch)
        cells = [str(batch), *(_number(by_variant.get(v), 3) for v in variants)]
        cells += [_times(ratio(by_variant.get(baseline_of(by_variant)), by_variant.get(v))) for v in graphed]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def sweep_section(run: dict[str, Any], chart: str | None = None) -> str:
    """The Markdown of a batch-size sweep: verdict, chart, table and environment."""
    title = f"Batch-size sweep: {run['config']}, {precision_label(run['precision'])}"
    parts = [f"### {title}", "", f"**Verdict:** {sweep_verdict(run)}", ""]
    if chart:
        parts += [f"![speedup over eager Lightning vs batch size]({chart})", ""]
    parts += [sweep_table(run), "", f"<sub>{environment_line(run)}</sub>", ""]
    return "\n".join(parts)


def record_stem(run: dict[str, Any]) -> str:
    """The file stem of a run, shared by its JSON and its chart: ``small_32-true``, ``sweep_batch_small_32-true``.

    A Transformer Engine run gets ``_te`` so that it does not overwrite the plain run of the same precision.
    """
    stem = f"{run['config']}_{run['precision']}"
    if is_sweep(run):
        return f"sweep_{run.get('sweep', 'batch')}_{stem}"
    variants = [r["variant"] for r in run.get("results", [])]
    return f"{stem}_te" if variants and all(v in TE_VARIANTS for v in variants) else stem


def chart_name(run: dict[str, Any]) -> str:
    """The PNG file name of a run's chart."""
    stem = record_stem(run)
    return f"{stem}.png" if is_sweep(run) else f"bars_{stem}.png"


def is_sweep(run: dict[str, Any]) -> bool:
    """Whether a run record is a sweep (its results span several batch sizes)."""
    return run.get("kind") == "sweep"


def bar_chart(run: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Horizontal bars of median ms/step per variant with p25-p75 whiskers and the speedup over eager."""
    plt = _pyplot()
    rows = [r for r in run["results"] if _finite(r.get("median_ms"))]
    names = [r["variant"] for r in rows]
    values = [r["median_ms"] for r in rows]
    low = [max(0.0, r["median_ms"] - _or(r.get("p25_ms"), r["median_ms"])) for r in rows]
    high = [max(0.0, _or(r.get("p75_ms"), r["median_ms"]) - r["median_ms"]) for r in rows]
    eager = medians(run).get(baseline_of(medians(run)))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.6))
    positions = range(len(rows))
    ax.barh(positions, values, xerr=[low, high], color=[_bar_color(n) for n in names], capsize=3)
    for position, value, above in zip(positions, values, high, strict=True):
        speedup = ratio(eager, value)
        if speedup is not None:  # right of the whisker, so the two never overlap
            ax.text(value + above, position, f"  {speedup:.2f}x", va="center", fontsize=8)
    ax.set_yticks(list(positions), names)
    ax.invert_yaxis()
    ax.set_xlabel("median ms/step (whiskers: p25-p75; labels: speedup over eager Lightning)")
    ax.set_title(f"{run_title(run)} - {run.get('environment', {}).get('gpu', '')}", fontsize=10)
    ax.margins(x=0.15)
    return _save(fig, path)


def sweep_chart(run: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Speedup over eager Lightning vs batch size (log2 axis) for every graph variant of a sweep."""
    plt = _pyplot()
    batch_sizes = sweep_batch_sizes(run)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant in sweep_variants(run):
        if variant == BASELINE:
            continue
        points = [(b, s) for b, s in zip(batch_sizes, sweep_speedups(run, variant), strict=True) if s is not None]
        if points:
            style = "--" if is_handwritten(variant) else "-"
            ax.plot(*zip(*points, strict=True), style, marker="o", label=variant)
    ax.axhline(1.0, color="grey", linewidth=1, label=f"{BASELINE} (1.0)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over eager Lightning")
    ax.set_title(f"Where graphs stop paying: {run['config']}, {precision_label(run['precision'])}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def draw_charts(runs: Iterable[dict[str, Any]], out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Draw each run's chart into ``out_dir``; map run file name to chart file name."""
    charts = {}
    for run in runs:
        name = chart_name(run)
        (sweep_chart if is_sweep(run) else bar_chart)(run, Path(out_dir) / name)
        charts[run["file"]] = name
    return charts


def results_markdown(runs: Sequence[dict[str, Any]], charts: dict[str, str], results_dir: Path) -> str:
    """The whole of ``RESULTS.md``: how to reproduce it, the legend, every table and every sweep."""
    commands = list(dict.fromkeys(run.get("environment", {}).get("command", MISSING) for run in runs))
    parts = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/report.py` from the JSON files beside this file; do not edit by hand.",
        "",
        "Measure (needs a CUDA GPU): " + ", ".join(f"`{c}`" for c in commands) + ".",
        f"Regenerate this file and the charts (no GPU): `python benchmarks/report.py {_display_path(results_dir)}`.",
        "",
        LEGEND,
        "",
    ]
    for run in runs:
        section = sweep_section if is_sweep(run) else run_section
        parts.append(section(run, charts.get(run["file"])))
    return "\n".join(parts)


def write_report(results_dir: str | os.PathLike[str] = DEFAULT_RESULTS, charts: bool = True) -> list[Path]:
    """Write ``RESULTS.md`` and the PNG charts into ``results_dir`` from its JSON files; return the paths written.

    Args:
        results_dir: Directory of the JSON files ``benchmarks/run.py`` wrote; the report goes there too.
        charts: Draw the PNG charts (needs matplotlib; without it the Markdown is written alone).

    Raises:
        FileNotFoundError: When the directory holds no results JSON.
    """
    results_dir = Path(results_dir)
    runs = load_runs(results_dir)
    if not runs:
        raise FileNotFoundError(f"no results JSON in {results_dir}; run `python benchmarks/run.py --suite readme`")
    drawn: dict[str, str] = {}
    if charts:
        try:
            drawn = draw_charts(runs, results_dir)
        except ImportError as err:
            print(f"charts skipped ({err}); `pip install matplotlib` to draw them", file=sys.stderr)
    markdown = results_dir / RESULTS_FILE
    markdown.write_text(results_markdown(runs, drawn, results_dir))
    return [markdown, *(results_dir / name for name in drawn.values())]


def baseline_of(by_variant: dict[str, Any]) -> str:
    """The variant speedups divide: eager Lightning, or the eager TE model in a Transformer Engine run."""
    return TE_BASELINE if BASELINE not in by_variant and TE_BASELINE in by_variant else BASELINE


def main(argv: list[str] | None = None) -> int:
    """Regenerate ``RESULTS.md`` and the charts of a results directory."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", nargs="?", default=str(DEFAULT_RESULTS), help="default: benchmarks/results")
    parser.add_argument("--no-charts", action="store_true", help="write the Markdown only")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.results_dir, charts=not args.no_charts)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _bar_color(variant: str) -> str:
    if variant == BASELINE:
        return "tab:gray"
    if is_handwritten(variant):
        return "tab:orange"
    if variant.startswith("compile_"):
        return "tab:green"
    return "tab:blue"


def _run_order(run: dict[str, Any]) -> tuple[int, int, int, str]:
    config, precision = run.get("config", ""), run.get("precision", "")
    config_rank = CONFIG_ORDER.index(config) if config in CONFIG_ORDER else len(CONFIG_ORDER)
    precision_rank = PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)
    return int(is_sweep(run)), config_rank, precision_rank, run["file"]


def _display_path(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _or(value: float | None, default: float) -> float:
    return value if _finite(value) else default


def _number(value: float | None, digits: int) -> str:
    return f"{value:.{digits}f}" if _finite(value) else MISSING


def _spread(low: float | None, high: float | None) -> str:
    return f"{low:.2f}-{high:.2f}" if _finite(low) and _finite(high) else MISSING


def _times(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())

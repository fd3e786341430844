"""Write the benchmark docs and charts from committed JSON (no GPU needed).

    python benchmarks/report.py                      # docs/benchmarks.md and docs/charts/ from benchmarks/results/
    python benchmarks/report.py DIR                  # DIR/RESULTS.md and its charts, from the JSON under DIR
    python benchmarks/report.py --no-charts

Every figure and ratio is computed from the JSON; nothing here holds a figure of its own. A record names its kind
(``table``, ``sweep``, ``auto``, ``compile``, ``hf``, ``logging``, ``shapes``, ``audit``, ``zoo``); older records are
known by their file's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.core.figures import finite, max_abs_diff, ratio, round_ratios
from benchmarks.core.markdown import NA, by_variant, cell, env_line, num, rounds_ratio, table, times
from benchmarks.core.zoo_summary import zoo_section, zoo_summary

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS, CHARTS = REPO / "docs" / "benchmarks.md", REPO / "docs" / "charts"
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "transformer-engine": "FP8 (transformer-engine)"}
ORDER = ("small", "medium", "moe", "tiny")
LABELS = {
    "eager": "eager Lightning",
    "attn": '`scope=["attn"]`',
    "mlp": '`scope=["mlp"]`',
    "attn+mlp": '`scope=["attn", "mlp"]`',
    "attn+moe_router": '`scope=["attn", "moe_router"]`',
    "moe_router+preprocess": '`scope=["moe_router", "moe_preprocess"]`',
    "layer": '`scope=["layer"]`',
    "layer+compile": '`scope=["layer"]` + `compile={"regions": True}`',
    "layer-strategy": '`CUDAGraphStrategy(scope=["layer"])` (with the optimizer graph)',
    "layer-strategy+compile": (
        '`CUDAGraphStrategy(scope=["layer"], compile={"regions": True})` (with the optimizer graph)'
    ),
    "full_iteration": '`strategy="cudagraph_full"`',
    "full_iteration+compile": '`strategy="cudagraph_full"` + `compile=True`',
    "auto-callback": "`CUDAGraphCallback()` (auto)",
    "auto-strategy": '`strategy="cudagraph"` (auto)',
    "auto": '`strategy="cudagraph"` (auto)',
    "handwritten_layer": "hand-written `make_graphed_callables` on the blocks, in Lightning",
    "pytorch_eager": "plain PyTorch loop, eager",
    "pytorch_block_graphs": "hand-written per-block graphs, plain PyTorch loop",
    "pytorch_full_graph": "hand-written whole-step `torch.cuda.graph`, plain PyTorch loop",
    "compile_default": "default `torch.compile` in Lightning",
    "compile_reduce_overhead": '`torch.compile(mode="reduce-overhead")` in Lightning',
    "te_eager": "Transformer Engine GPT, eager",
    "te_layer": '`impl="transformer_engine"`, `scope=["layer"]`',
    "thunder": "Thunder (`CUDAGraphTransform`)",
}
#: The hand-written capture each package variant is compared with (the scoped ones: ``handwritten_layer``).
HANDWRITTEN = {"full_iteration": "pytorch_full_graph", "eager": "pytorch_eager"}
SCOPED = ("attn", "mlp", "attn+mlp", "layer", "te_layer", "moe_router+preprocess")
README_ROWS: tuple[str, ...] = ("eager", "attn", "attn+mlp", "layer", "full_iteration", "handwritten_layer")
README_ROWS += ("pytorch_block_graphs", "pytorch_full_graph")
Bar = tuple[str, float, float, float, float | None]  # variant, median, p25, p75, speedup over eager


# ---------------------------------------------------------------------------------------------------- loading
def load(results: Path) -> list[dict[str, Any]]:
    """Every record under ``results``, with ``kind`` and ``file`` (its path from ``results``'s parent)."""
    records = []
    for path in sorted(results.rglob("*.json")):
        record = json.loads(path.read_text())
        if isinstance(record, dict):
            inside = path.resolve().is_relative_to(REPO)
            name = path.resolve().relative_to(REPO) if inside else path.relative_to(results)
            records.append({**record, "kind": record.get("kind") or path.stem.split("_")[0], "file": str(name)})
            records[-1]["dir"] = path.parent
    return records


def of_kind(records: Sequence[dict[str, Any]], kind: str, top: Path | None = None) -> list[dict[str, Any]]:
    """The records of one kind (directly in ``top`` only, when given), small configs and fp32 first."""
    rank = {p: i for i, p in enumerate(PRECISIONS)}
    chosen = [r for r in records if r["kind"] == kind and (top is None or r["dir"] == top)]
    return sorted(
        chosen,
        key=lambda r: (ORDER.index(r["config"]) if r.get("config") in ORDER else 9, rank.get(r.get("precision", ""), 9),
                       r["file"]),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- cells
def label(variant: str) -> str:
    return LABELS.get(variant, f"`{variant}`")


def precision(record: dict[str, Any]) -> str:
    return PRECISIONS.get(record["precision"], record["precision"])


def ms(results: dict[str, dict[str, Any]], variant: str | None) -> float | None:
    return (results.get(variant or "") or {}).get("median_ms")


def baseline(results: dict[str, dict[str, Any]]) -> str:
    """The variant speedups divide: eager Lightning, or the eager TE model in a Transformer Engine run."""
    return "te_eager" if "eager" not in results and "te_eager" in results else "eager"


def report_note(result: dict[str, Any]) -> str:
    """A variant's note: its failure, rollbacks, why graphs are off, regions left eager."""
    report = result.get("report") or {}
    reasons = report.get("rollback_reasons") or []
    parts = [result.get("note", ""), *(f"rolled back: {r}" for r in reasons)]
    if not reasons and report.get("reason"):
        parts.append(f"graphs off: {report['reason']}")
    if report.get("exclusions"):
        parts.append("left eager: " + "; ".join(f"{k} ({v})" for k, v in report["exclusions"].items()))
    return cell("; ".join(filter(None, parts)))


def chart_line(alt: str, chart: str | None) -> str:
    return f"![{alt}]({chart})\n\n" if chart else ""


# ---------------------------------------------------------------------------------------------------- sections
def readme_section(records: Sequence[dict[str, Any]], top: Path) -> str:
    """The one results table of the README: the small GPT in fp32 and bf16-mixed, and the zoo's summary line."""
    runs = [r for r in of_kind(records, "table", top) if r["config"] == "small" and not r["file"].endswith("_te.json")]
    if not runs:
        return ""
    header = ["variant", *(h for run in runs for h in (f"{precision(run)} ms/step", "vs eager"))]
    found = [by_variant(run["results"]) for run in runs]
    rows = [
        [label(v), *(c for f in found for c in (num(ms(f, v)), times(ratio(ms(f, "eager"), ms(f, v)))))]
        for v in README_ROWS
    ]
    model, zoo = runs[0]["model"], of_kind(records, "zoo")
    return (
        f"## README table\n\nSmall GPT ({model['n_layer']} layers, width {model['width']}, sequence"
        f" {model['seq_len']}, batch {runs[0]['batch_size']}), median ms per step; n/a: not measured in that"
        f" precision. Sources: {', '.join('`' + r['file'] + '`' for r in runs)}.\n\n"
        + table(header, rows)
        + ("\n" + zoo_summary(zoo[0]) + "\n" if zoo else "")
    )


def scoped_readme_section(records: list[dict[str, Any]]) -> str:
    """The README's second table: the goals of scoped steps, each from its benchmark's committed JSON."""
    found = {kind: got[0] for kind in ("handwritten", "host_read", "optimizer_graph", "scoped_compile")
             if (got := of_kind(records, kind))}  # fmt: skip
    if len(found) < 4:
        return ""
    hand, reads = found["handwritten"]["shapes"].values(), found["host_read"]["cases"]
    graph, compiled = found["optimizer_graph"], found["scoped_compile"]["models"]
    layers = "/".join(str(got["layers"]) for got in hand)
    per_shape = lambda variant: " / ".join(rounds_ratio(got["ratios"][variant]) for got in hand)  # noqa: E731
    rows = [
        [f'`CUDAGraphStrategy(scope=["layer"])`, step time against a hand-written per-layer capture, GPT of {layers}'
         " layers", per_shape("layer-strategy"), "at most 1.00x"],
        ['`CUDAGraphCallback(scope=["layer"])`, the same (the same graphs, the optimizer step eager)',
         per_shape("layer"), ""],
        ['`strategy="cudagraph"` against the callback\'s `layer`: `loss.item()` in `training_step` / a boolean-mask'
         " loss", " / ".join(rounds_ratio(auto_vs_layer(got)) for got in reads.values()),
         f"at least {times(found['host_read']['goal'])}"],
        [f'The optimizer graph, `scope=["layer"]`, {graph["precision"]}', rounds_ratio(graph["speedup_per_round"]),
         f"at least {times(graph['goal'])}"],
        ['`compile={"regions": True}` on `scope=["layer"]`, medium GPT (GPU-paced), bf16-mixed',
         rounds_ratio(compiled["medium"]["speedup_per_round"]), f"at least {times(found['scoped_compile']['goal'])}"],
    ]  # fmt: skip
    sources = ", ".join(f"`{Path(found[k]['file']).parent}/`" for k in found)
    return (
        "## README table: steps that are not one graph\n\nSmall GPT unless named, on one GPU. Each figure is the"
        " median of the ratios of alternated rounds (each round's two fits compared), with their range in brackets."
        f" Sources: {sources}.\n\n" + table(["what", "measured", "goal"], rows, "lrl")
    )


def run_section(run: dict[str, Any], chart: str | None) -> str:
    """One config and precision of ``benchmarks/run.py``: chart and table."""
    results = by_variant(run["results"])
    base = ms(results, baseline(results))
    title = f"{run['config']}{', Transformer Engine GPT' if run['file'].endswith('_te.json') else ''}"
    rows = []
    for r in run["results"]:
        reference = "handwritten_layer" if r["variant"] in SCOPED else HANDWRITTEN.get(r["variant"])
        rows.append([
            label(r["variant"]), num(r.get("median_ms"), 3), f"{num(r.get('p25_ms'))}-{num(r.get('p75_ms'))}",
            times(ratio(base, r.get("median_ms"))),
            times(ratio(ms(results, reference), r.get("median_ms"))) if reference else "",
            num(r.get("peak_mib"), 0), num(r.get("pool_mib", (r.get("report") or {}).get("pool_mib")), 0),
            num(r.get("capture_ms"), 0), num(r.get("final_loss"), 4), report_note(r),
        ])  # fmt: skip
    header = ["variant", "ms/step", "p25-p75", "vs eager", "vs hand-written", "peak MiB", "pool MiB", "capture ms"]
    drawn = chart_line(f"ms/step per variant, {title}, {run['precision']}", chart)
    body = table([*header, "final loss", "note"], rows, "lrrrrrrrrl")
    return f"### {title}, {precision(run)}, batch {run.get('batch_size')}\n\n{drawn}{body}\n{env_line(run)}"


def sweep_section(run: dict[str, Any], chart: str | None) -> str:
    """A batch-size sweep: speedup over eager per batch size."""
    variants = list(dict.fromkeys(r["variant"] for r in run["results"]))
    graphs = [v for v in variants if v != "eager"]
    rows = []
    for batch in sorted({r["batch_size"] for r in run["results"]}):
        found = by_variant(run["results"], batch)
        speedups = (times(ratio(ms(found, "eager"), ms(found, v))) for v in graphs)
        rows.append([str(batch), *(num(ms(found, v), 3) for v in variants), *speedups])
    header = ["batch", *(f"{v} ms" for v in variants), *(f"{v} vs eager" for v in graphs)]
    drawn = chart_line("speedup over eager Lightning vs batch size", chart)
    return f"### Batch-size sweep: {run['config']}, {precision(run)}\n\n{drawn}{table(header, rows)}\n{env_line(run)}"


def variants_table(results: Sequence[dict[str, Any]]) -> str:
    """Every variant of one model: ms/step, speedup, loss parity, compile time, kernels, every round, the note."""
    rows = []
    for r in results:
        kernels, level = r.get("kernels") or {}, (r.get("report") or {}).get("level") or ""
        rows.append([
            label(r["variant"]), num(r.get("median_ms")), times(r.get("speedup")), level,
            num(r.get("loss_max_abs_diff"), None), num(r.get("compile_s"), 1),
            f"{num(kernels['kernel_ms'])} ({num(kernels['floor_ms'])})" if kernels else "",
            " / ".join(num(ms) for ms in r.get("round_ms", [])), report_note(r),
        ])  # fmt: skip
    head = ["variant", "ms/step", "vs eager", "level", "loss parity", "compile s", "kernel ms (floor)", "ms per round"]
    return table([*head, "note"], rows, "lrrlrrrll")


def auto_section(record: dict[str, Any]) -> str:
    """``benchmarks/auto.py``: the ladder against every fixed scope, its cost, and each model's ladder."""
    summary, ladders = [], []
    both = ("auto-strategy", "auto-callback")
    for model, measured in record["models"].items():
        results = by_variant(measured["results"])
        found = {(e["variant"], e["against"]): e for e in measured["ratios"]}
        best, scope = found.get((both[0], "best fixed"), {}), found.get((both[1], "best fixed scope"), {})
        climb, whole = (finite((measured.get("cost") or {}).get(key)) for key in ("climb_cost", "cost"))
        reports = [results.get(v, {}).get("report") or {} for v in both]
        summary.append([
            model, f"{times(best.get('ratio'))} (`{best.get('reference')}`)",
            f"{times(scope.get('ratio'))} (`{scope.get('reference')}`)",
            " / ".join(times(results.get(v, {}).get("speedup")) for v in both),
            " / ".join(r.get("level") or "eager" for r in reports),
            NA if climb is None or whole is None else f"{100 * climb:.1f}% (whole fits {100 * whole:.1f}%)",
        ])  # fmt: skip
        rows = [
            [row["level"], row["status"], num(row.get("step_ms")), num(row.get("capture_ms"), 0), str(row["steps"])]
            for row in reports[0].get("ladder", [])
        ]
        ladders.append(
            f"#### {model}\n\n{variants_table(measured['results'])}\nLadder of {label(both[0])}:\n\n"
            + table(["level", "status", "ms/step", "capture ms", "steps"], rows, "llrrr")
        )
    head = ["model", f"{label(both[0])} vs best fixed", f"{label(both[1])} vs best fixed scope"]
    head += [
        "auto vs eager (strategy / callback)",
        "level reached",
        f"ladder cost, {record.get('cost_steps')}-step fit",
    ]
    intro = (
        f"Every variant trained {record['rounds']} times, alternating round by round, each counted at its fastest"
        f" round's median over the last {record['timed']} of {record['steps']} steps. Speed ratios are ms of the"
        " reference over ms of the variant. The ladder cost is the climb's extra wall time to the start of step 100,"
        " as a share of the fit (the whole fits' difference in brackets).\n\n"
    )
    body = intro + table(head, summary, "lrrrlr") + "\n" + "\n".join(ladders)
    return f"### {precision(record)}\n\n{body}\n{env_line(record)}"


LIMITS = {
    "floor": "out of reach by compiling (needs {needed_ms:.2f} ms, floor {floor_ms:.2f})",
    "kernels": "bounded by the compiled kernels ({kernel_ms:.2f} ms; needs {needed_ms:.2f}, floor {floor_ms:.2f})",
    "host": "paced by the host ({host_ms:.2f} ms; kernels {kernel_ms:.2f})",
}


def compile_ratio(entry: dict[str, Any] | None) -> str:
    """A ratio of ``benchmarks/compile.py``, bold where it met its goal, else with what limits it."""
    if entry is None:
        return NA
    text, limit = times(entry.get("ratio")), entry.get("limit")
    if entry.get("met"):
        return f"**{text}**"
    return f"{text}, {LIMITS[limit].format(**entry)}" if limit in LIMITS else text


def compile_section(record: dict[str, Any], chart: str | None) -> str:
    """``benchmarks/compile.py``: compile= inside the graphs against the peers, per model."""
    rows = []
    for model, measured in record["models"].items():
        found = {(e["variant"], e["reference"]): e for e in measured["ratios"]}
        compiled = by_variant(measured["results"]).get("full_iteration+compile") or {}
        peers = ("full_iteration", "compile_reduce_overhead", "thunder")
        rows.append([
            f"{model} GPT", *(compile_ratio(found.get(("full_iteration+compile", peer))) for peer in peers),
            compile_ratio(found.get(("layer+compile", "layer"))),
            compile_ratio(found.get(("layer-strategy+compile", "layer-strategy"))), num(compiled.get("compile_s"), 1),
        ])  # fmt: skip
    head = ["model", "vs `cudagraph_full`", "vs reduce-overhead", "vs Thunder", "`layer` + compile vs `layer`",
            "the same through the strategy"]  # fmt: skip
    intro = (
        'Speed ratios of `cudagraph_full` + `compile=True` (and `layer` + `compile={"regions": True}`), each variant at'
        f" its fastest of {record['rounds']} alternated fits, median over the last {record['timed']} of"
        f" {record['steps']} steps;"
        " bold: the goal is met. The floor is the GEMM, attention and optimizer kernels, which `compile=` leaves as"
        " they are.\n\n"
    )
    details = "".join(f"\n#### {m} GPT\n\n" + variants_table(got["results"]) for m, got in record["models"].items())
    body = intro + table([*head, "compile s"], rows, "lrrrrrr") + "\n"
    body += chart_line(f"ms per step, {record['precision']}", chart) + details
    return f"### {precision(record)}\n\n{body}{env_line(record)}"


def hf_section(record: dict[str, Any]) -> str:
    """``benchmarks/hf.py``: the Hugging Face models per variant."""
    rows = []
    for model, measured in record["models"].items():
        results = measured["results"]
        cells = [
            "rolled back" if (r.get("report") or {}).get("rollback_reasons") else times(r.get("speedup"))
            for r in results
            if r["variant"] != "eager"
        ]
        parity = max((r.get("loss_max_abs_diff") or 0.0 for r in results), default=None)
        rows.append([f"`{model}`", num(ms(by_variant(results), "eager")), *cells, f"<= {num(parity, None)}"])
    variants = ("attn", "attn+mlp / moe_router", "layer", "full_iteration")
    return table(["model", "eager ms", *(f"`{v}`" for v in variants), "loss parity"], rows) + "\n" + env_line(record)


def logging_section(record: dict[str, Any]) -> str:
    """``benchmarks/logging_cost.py``: direct re-issue of logged values against ``self.log`` every step."""
    rows = [
        [row["case"], *(f"{num(row[way]['ms'], 3)} ({num(row[way]['host_ms'])})" for way in ("direct", "self.log")),
         times(row["ratio"])]
        for row in record["cases"]
    ]  # fmt: skip
    head = ["case", "direct ms (host ms)", "through `self.log` ms (host ms)", "speedup"]
    return table(head, rows) + "\n" + env_line(record)


def shapes_section(record: dict[str, Any]) -> str:
    """``benchmarks/shapes.py``: bucketed variable lengths against one fixed length."""
    rows = []
    for model, results in record["models"].items():
        for variant in ("layer", "full"):
            var, fix = results[f"{variant}/variable"], results[f"{variant}/fixed"]
            speed_var = ratio(results["eager/variable"]["total_ms"], var["total_ms"])
            speed_fix = ratio(results["eager/fixed"]["total_ms"], fix["total_ms"])
            pools = times(ratio(var["pool_mib"], fix["pool_mib"]))
            rows.append([
                model, "`layer`" if variant == "layer" else "`cudagraph_full`", times(speed_var), times(speed_fix),
                num(ratio(speed_var, speed_fix)), f"{num(var['pool_mib'], 0)} / {num(fix['pool_mib'], 0)} ({pools})",
                f"{100 * var['replayed_after_skip']:.1f}%",
                num(max_abs_diff(var["losses"][:20], results["eager/variable"]["losses"][:20]), None),
            ])  # fmt: skip
    head = ["model", "variant", "speedup, variable", "speedup, fixed", "ratio", "pool MiB, buckets / one"]
    head += ["steps replayed after every bucket's capture", "loss diff, 20 steps"]
    intro = f"Buckets {record['buckets']}; fixed length {record['fixed_length']}. Source: `{record['file']}`.\n\n"
    return intro + table(head, rows, "llrrrrrr")


def audit_section(record: dict[str, Any]) -> str:
    """``benchmarks/audit_cost.py``: what one audit costs, scaled to the default interval."""
    if "ratio" in record:
        return audits_share_section(record)
    rows = [
        [f"`{r['scope']}`", num(r["plain_s"], 3), f"{num(r['audited_s'], 3)} ({r['audits']})", num(r["per_audit_ms"]),
         num(r["step_ms"]), f"{100 * r['default_share']:.2f}%"]
        for r in record["scopes"]
    ]  # fmt: skip
    head = ["scope", "fit s, no audits", "fit s, audited (audits)", "ms per audit", "ms per step"]
    head.append(f"share of a 1000-step fit at every {record['default_every']} steps")
    return f"{record['steps']} steps, an audit every {record['every']}.\n\n{table(head, rows)}\n{env_line(record)}"


def audits_share_section(record: dict[str, Any]) -> str:
    """The dense early audits' share of a short fit against a hand-written whole-step capture (held-out ratios)."""
    cadence, env, steps = record["cadence"], record["environment"], record["steps"]
    every = cadence["audit_every_n_steps"]
    due, interval = [0], min(cadence["first_interval"], every)  # the schedule of ``GraphChecks.audit_due``
    while due[-1] + interval <= steps:
        due.append(due[-1] + interval)
        interval = min(2 * interval, every)
    due = due[1:]
    ratios = record["ratio"]
    rows = [[PRECISIONS.get(p, p), times(r["default"], 3), times(r["audits_off"], 3)] for p, r in ratios.items()]
    head = ["precision", f"default (`audit_every_n_steps={cadence['audit_every_n_steps']}`)", "`audit_every_n_steps=0`"]
    off = max(r["audits_off"] for r in ratios.values())
    return (
        f"### What the audits cost\n\nMeasured held-out on an {env['gpu']} with torch {env['torch']}: a {steps}-step"
        f" fit, {record['rounds']} alternated rounds. Each figure is the package's whole-step step time over that of"
        f" {record['against']}.\n\n"
        f"{table(head, rows)}\n"
        f"The dense early audits are the whole difference. With `audit_every_n_steps=0` the package is within"
        f" {100 * (off - 1):.1f}% of the hand-written capture.\n\n"
        "An audit is a shadow step. The graph replays from a copy of the training state. The copy is put back. The"
        " step then runs eagerly, and training keeps the eager step. The loss and the parameter update of the two must"
        " agree within the step's tolerance. An audit costs about one eager step on top of the replay, plus the copies"
        " and the comparison.\n\n"
        "A shadow step checks each whole-step graph on its capture step."
        f" The first audit comes {cadence['first_interval']} replayed steps later. Each later interval doubles, up to"
        f" `audit_every_n_steps` (default {cadence['audit_every_n_steps']}). A {steps}-step fit thus"
        f" holds up to {len(due)} audits, after {', '.join(map(str, due[:-1]))} and {due[-1]} replayed steps.\n\n"
        "`audit_every_n_steps` caps the interval. Any value above 0 keeps the dense early audits."
        " `audit_every_n_steps=0` (or `None`) turns the audits off and keeps the check on the capture step. No audit"
        " then catches a graph that goes wrong later.\n\n"
        "Since this measurement, an audit's copies, restore and comparison run as fused `torch._foreach_*` operations"
        " over all the tensors of one device and dtype, where they ran a few kernels per parameter. The verdict is"
        " still one number read back to the host per audit. Only a failed audit reads the per-parameter differences,"
        " to name the first parameter that is off. The audits' schedule and tolerances are unchanged. The new cost is"
        " not yet measured on a GPU.\n\n"
        f"<sub>{env['gpu']}, torch {env['torch']}; `{record['file']}`; {env['note']}</sub>\n"
    )


def per_model(
    record: dict[str, Any],
    row: Callable[[str, str, dict[str, Any]], list[str]],
    note: Callable[[str, dict[str, Any]], str],
) -> tuple[list[list[str]], str]:
    """The table rows of a per-model record (``models`` -> variant -> figures), and its parity notes as a list."""
    rows, notes = [], []
    for model, got in record["models"].items():
        for variant, r in got.items():
            if variant == "parity":
                notes.append(f"- {note(model, r)}\n")
            else:
                rows.append(row(model, variant, r))
    return rows, "".join(notes)


def against_eager(record: dict[str, Any], model: str, result: dict[str, Any]) -> list[float]:
    """A variant's speed ratio over eager in each alternated round of a per-model record (per sample)."""
    eager = record["models"][model]["eager"]
    scale = (result.get("batch_size") or 1) / (eager.get("batch_size") or 1)  # a step of a larger batch: per sample
    return [r * scale for r in round_ratios(eager.get("round_ms") or [], result.get("round_ms") or [])]


def auto_vs_layer(case: dict[str, Any], against: str = "layer") -> list[float]:
    """``strategy="cudagraph"`` against ``against`` in each alternated round of a ``host_read`` case."""
    return round_ratios(case["round_ms"][against], case["round_ms"]["auto"])


def accumulation_section(record: dict[str, Any]) -> str:
    """``benchmarks/accumulation.py``: the whole step with accumulation, per sample, against eager and a 4x batch."""
    head = ["model", "variant", "batch x accumulate", "ms per micro-batch", "ms per sample", "vs eager", "peak MiB"]
    rows, parity = per_model(
        record,
        lambda model, variant, r: [model, label(variant), f"{r['batch_size']} x {r['accumulate']}",
                                   num(r["median_ms"], 3), num(r["ms_per_sample"], 3),
                                   rounds_ratio(against_eager(record, model, r)),
                                   num(r["peak_mib"], 0)],
        lambda model, r: f"{model}: {r['steps']} optimizer steps, largest loss difference {num(r['max_loss_diff'], 7)},"
                         f" largest relative parameter difference {num(r['max_rel_param_diff'], 6)}"
                         f" ({r.get('worst_param', 'n/a')})",
    )  # fmt: skip
    intro = (
        "Each variant's ms is its fastest round's median; vs eager is the median of the ratios of the rounds"
        " (eager's round over the variant's, per sample), with their range in brackets.\n\n"
    )
    return f"{intro}{table(head, rows, 'llrrrlr')}\nParity, eager against `full_iteration` (accumulate 4):\n\n{parity}"


def cnn_section(record: dict[str, Any]) -> str:
    """``benchmarks/cnn.py``: torchvision CNNs through the callback, against eager, with BatchNorm parity."""
    head = ["model", "variant", "level", "ms per step", "vs eager"]

    def row(model: str, variant: str, r: dict[str, Any]) -> list[str]:
        level = (r.get("report") or {}).get("level")
        vs_eager = rounds_ratio(against_eager(record, model, r))
        return [model, label(variant), f"`{level}`" if level else "", num(r["median_ms"], 2), vs_eager]

    rows, parity = per_model(
        record,
        row,
        lambda model, r: f"{model}: {r['steps']} steps at level `{r.get('level')}`, largest loss difference"
                         f" {num(r['max_loss_diff'], 7)}, largest BatchNorm buffer difference"
                         f" {num(r['max_buffer_diff'], 7)} ({r.get('worst_buffer', 'n/a')})",
    )  # fmt: skip
    batch = (
        f"Batch {record['batch_size']}, {record['size']}x{record['size']} images. Each variant's ms is its fastest"
        " round's median; vs eager is the median of the ratios of the rounds, with their range in brackets"
    )
    return f"{batch}.\n\n{table(head, rows, 'lllrl')}\nParity, eager against `auto` (deterministic cuDNN):\n\n{parity}"


def optimizer_graph_section(record: dict[str, Any]) -> str:
    """``benchmarks/optimizer_graph.py``: a scoped step with its optimizer update as a graph of its own, and without."""
    names = {"layer": "`optimizer_graph=False`", "layer+optimizer_graph": "the optimizer graph (the default)"}
    head = ["variant", "ms per step (median of rounds)", "rounds"]
    rows = [
        [names.get(v, label(v)), num(median, 3), " / ".join(num(r, 3) for r in record["round_ms"][v])]
        for v, median in record["median_ms"].items()
    ]
    same, default = record["parity_same_arithmetic"], record["parity_default_optimizer"]
    parity = "".join(
        f"- eager against {names.get(v, v)}, the AdamW a user writes: largest loss difference"
        f" {num(f['max_loss_diff'], None)}, largest relative parameter difference"
        f" {num(f['max_rel_param_diff'], None)} ({f['worst_param']})\n"
        for v, f in default.items()
    )
    return (
        f'The {record["model"]} GPT, {record["precision"]}, `scope=["layer"]` through `CUDAGraphStrategy`,'
        f" {record['rounds']} alternated rounds. Eager Lightning: {num(record['eager_ms'], 3)} ms per step.\n\n"
        + table(head, rows, "lrl")
        + f"\nThe optimizer graph: {rounds_ratio(record['speedup_per_round'], 3, bold_from=record['goal'])} per step,"
        f" the median of the ratios of the rounds with their range (goal {times(record['goal'])}; per round"
        f" {', '.join(times(r, 3) for r in record['speedup_per_round'])}). The ratio of the two medians above is"
        f" {times(record['speedup'], 3)}; a round compares two fits that ran side by side, so its ratio is the"
        " figure to read.\n\n"
        f"Parity over {record['steps']} steps, fused AdamW with a learning rate a float32 tensor holds exactly (the"
        f" same arithmetic): largest loss difference {num(same['max_loss_diff'], None)}, largest relative parameter"
        f" difference {num(same['max_rel_param_diff'], None)}. With the AdamW a user writes (the `foreach` form), the"
        " graph's fused form rounds differently, and Adam turns that rounding of a gradient that is zero in exact"
        f" arithmetic (the key bias of attention) into steps of the learning rate:\n\n{parity}\n{env_line(record)}"
    )


def host_read_section(record: dict[str, Any]) -> str:
    """``benchmarks/host_read.py``: steps no whole-step graph can hold, ``strategy="cudagraph"`` against the rest."""
    titles = {"item": "`training_step` reads `loss.item()`", "mask": "the loss keeps labels `>= 0` by boolean indexing"}
    names = {"layer": '`CUDAGraphCallback(scope=["layer"])`'}
    head = ["variant", "level", "ms per step (median of rounds)", "vs eager", "rounds", "loss difference"]
    parts = [
        f"The {record['model']} GPT, fp32, {record['rounds']} alternated rounds, median over the last"
        f" {record['timed']} of {record['steps']} steps; vs eager is the median of the ratios of the rounds, with"
        " their range; the loss difference is the largest per step against eager.\n"
    ]
    for kind, got in record["cases"].items():
        rows = [
            [names.get(v, label(v)), f"`{level}`" if (level := got["report"][v]["level"]) else "",
             num(got["median_ms"][v], 3), rounds_ratio(round_ratios(got["round_ms"]["eager"], got["round_ms"][v])),
             " / ".join(num(r, 2) for r in got["round_ms"][v]),
             num(got["max_loss_diff"][v], None)]
            for v in got["median_ms"]
        ]  # fmt: skip
        parts.append(
            f'### {titles.get(kind, kind)}\n\n{table(head, rows, "llrllr")}\n`strategy="cudagraph"`:'
            f" {rounds_ratio(auto_vs_layer(got), 3)} the callback's `layer` (goal {times(record['goal'])}),"
            f" {rounds_ratio(auto_vs_layer(got, 'layer-strategy'), 3)} `layer` through the strategy; each the median"
            " of the ratios of the rounds, with their range.\n"
        )
    return "\n".join(parts) + "\n" + env_line(record)


def scoped_compile_section(record: dict[str, Any]) -> str:
    """``benchmarks/scoped_compile.py``: compiled ``layer`` regions through the strategy, per model."""
    head = ["model", "`compile=False` ms", '`compile={"regions": True}` ms', "compile speedup (median of rounds)",
            "per round"]  # fmt: skip
    rows = [
        [f"{model} GPT", *(num(got["median_ms"][v], 3) for v in got["median_ms"]),
         rounds_ratio(got["speedup_per_round"], 3, bold_from=record["goal"]),
         ", ".join(times(r, 3) for r in got["speedup_per_round"])]
        for model, got in record["models"].items()
    ]  # fmt: skip
    intro = (
        f'`CUDAGraphStrategy(scope=["layer"])` with the optimizer graph, {record["precision"]}, {record["rounds"]}'
        f" alternated rounds with nothing else in the process, median over the last {record['timed']} of"
        f" {record['steps']} steps; bold: at least {times(record['goal'])} (the goal). A model whose kernels outlast"
        " the host's work per step shows the compiled kernels; a host-paced one does not. The host's speed moves"
        " between fits and processes, so the same pair can be host-paced in another run (`docs/compile.md`,"
        ' "When it pays").\n\n'
    )
    return intro + table(head, rows, "lrrll") + "\n" + env_line(record)


def handwritten_section(record: dict[str, Any]) -> str:
    """``benchmarks/host_cost.py --handwritten``: ``layer`` against a hand-written per-layer capture, per shape."""
    head = ["shape", "package", "ms", "hand-written ms", "ratio (median of rounds)", "per round", "capture ms"]
    ways = {"layer": "`CUDAGraphCallback`", "layer-strategy": "`CUDAGraphStrategy`"}
    rows = [
        [f"GPT, {got['layers']} layers", way, num(got["median_ms"][variant], 3),
         num(got["median_ms"]["handwritten_layer"], 3),
         f"**{times(got['ratio'][variant], 3)}**" if got["ratio"][variant] <= 1.0 else times(got["ratio"][variant], 3),
         ", ".join(times(r, 3) for r in got["ratios"][variant]),
         f"{num(got['capture_ms'][variant], 0)} against {num(got['capture_ms']['handwritten_layer'], 0)}"]
        for got in record["shapes"].values()
        for variant, way in ways.items()
    ]  # fmt: skip
    intro = (
        '`scope=["layer"]` against `make_graphed_callables` on the same blocks in Lightning, fp32,'
        f" {record['rounds']} alternated rounds, median over the last {record['timed']} of {record['steps']} steps."
        " Through `CUDAGraphCallback` the package replays the same graphs as the hand-written capture, and the"
        " optimizer step stays eager. Through `CUDAGraphStrategy` it also replays the optimizer step as a graph."
        " A ratio under 1 means the package's step is shorter; bold: at most 1.00x (the goal).\n\n"
    )
    return intro + table(head, rows, "llrrrll") + "\n" + env_line(record)


# ---------------------------------------------------------------------------------------------------- charts
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: What each bar colour of a chart stands for (its legend).
LEGEND = {
    "tab:gray": "eager",
    "tab:blue": "lightning_cudagraph",
    "tab:green": "compiled kernels (torch.compile)",
    "tab:orange": "without the package (hand-written, Thunder)",
}


def chart_label(key: str) -> str:
    """A bar's label in the docs' names: ``small layer-strategy`` reads ``small GPT: CUDAGraphStrategy(...)``."""
    model, _, variant = key.partition(" ")
    if variant in LABELS:
        return f"{model} GPT: {chart_label(variant)}"
    return label(key).replace("`", "")


def color(variant: str) -> str:
    """Grey for eager, orange for code without the package, green for compiled, blue for the package."""
    if variant.endswith("eager"):
        return "tab:gray"
    if any(word in variant for word in ("pytorch", "hand", "thunder")):
        return "tab:orange"
    return "tab:green" if "compile" in variant else "tab:blue"


def bar_rows(results: Sequence[dict[str, Any]]) -> list[Bar]:
    """One bar per measured variant (missing quartiles: the median)."""
    found = by_variant(results)
    base, rows = ms(found, baseline(found)), []
    for r in results:
        if (median := finite(r.get("median_ms"))) is not None:
            rows.append(
                (r["variant"], median, r.get("p25_ms") or median, r.get("p75_ms") or median, ratio(base, median))
            )
    return rows


def bars(rows: Sequence[Bar], title: str, path: Path) -> Path:
    """Horizontal bars of ms/step with p25-p75 whiskers, labelled with the speedup over eager."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 2.0))
    positions = range(len(rows))
    high = [max(0.0, row[3] - row[1]) for row in rows]
    ax.barh(positions, [row[1] for row in rows], xerr=[[max(0.0, row[1] - row[2]) for row in rows], high],
            color=[color(row[0]) for row in rows], capsize=3)  # fmt: skip
    for position, row, above in zip(positions, rows, high, strict=True):
        if row[4] is not None:
            ax.text(row[1] + above, position, f"  {row[4]:.2f}x", va="center", fontsize=8)
    ax.set_yticks(list(positions), [chart_label(row[0]) for row in rows], fontsize=8)
    ax.invert_yaxis()
    colors = dict.fromkeys(color(row[0]) for row in rows)
    legend = [plt.Rectangle((0, 0), 1, 1, color=c, label=LEGEND[c]) for c in colors]
    ax.legend(handles=legend, loc="lower right", fontsize=8)
    ax.set_xlabel("median ms/step (whiskers: p25-p75; labels: speedup over eager Lightning)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.15)
    return save(fig, path)


def sweep_chart(run: dict[str, Any], title: str, path: Path) -> Path:
    """Speedup over eager Lightning vs batch size (log2 axis) for every graph variant of a sweep."""
    plt = _pyplot()
    batches = sorted({r["batch_size"] for r in run["results"]})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant in dict.fromkeys(r["variant"] for r in run["results"]):
        found = [(b, by_variant(run["results"], b)) for b in batches]
        points = [(b, s) for b, f in found if (s := ratio(ms(f, "eager"), ms(f, variant))) is not None]
        if variant != "eager" and points:
            style = "--" if variant.startswith("pytorch") else "-"
            ax.plot(*zip(*points, strict=True), style, marker="o", label=chart_label(variant))
    ax.axhline(1.0, color="grey", linewidth=1, label="eager (1.0)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over eager Lightning")
    ax.set_title(f"Where graphs stop paying: {title}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return save(fig, path)


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- the document
#: Kind: (heading, command, section). The compile section also draws a chart, so ``render`` writes it.
SECTIONS: dict[str, tuple[str, str, Callable[[dict[str, Any]], str]]] = {
    "auto": ('`scope="auto"`: the ladder against every fixed scope', "benchmarks/auto.py --steps 160 --timed 60",
             auto_section),
    "compile": ("Compiled kernels inside the graphs: `compile=True` against the peers", "benchmarks/compile.py",
                lambda r: ""),
    "logging": ("Logged values on replayed steps", "benchmarks/logging_cost.py", logging_section),
    "hf": ("Hugging Face models", "benchmarks/hf.py", hf_section),
    "shapes": ("Batches whose shape changes", "benchmarks/shapes.py", shapes_section),
    "audit": ("The numerics guard: what an audit costs", "benchmarks/audit_cost.py", audit_section),
    "zoo": ("Real training code: the model zoo", "zoo/run.py", zoo_section),
    "moe": ("Dropless MoE: the zoo's Hugging Face MoE entries", "zoo/run.py --only qwen3_moe_grouped_mm,..."
            " --variants cudagraph,full,moe", zoo_section),
    "accumulation": ("Gradient accumulation inside the whole step", "benchmarks/accumulation.py",
                     accumulation_section),
    "cnn": ("torchvision CNNs through `CUDAGraphCallback()`", "benchmarks/cnn.py", cnn_section),
    "optimizer_graph": ("The optimizer step as a graph under scoped capture", "benchmarks/optimizer_graph.py",
                        optimizer_graph_section),
    "host_read": ("Steps that no whole-step graph can hold", "benchmarks/host_read.py", host_read_section),
    "handwritten": ('`scope=["layer"]` against a hand-written per-layer capture', "benchmarks/host_cost.py"
                    " --device cuda --handwritten", handwritten_section),
    "scoped_compile": ("Compiled kernels inside scoped graphs, once the GPU paces the step",
                       "benchmarks/scoped_compile.py", scoped_compile_section),
}  # fmt: skip


def render(records: list[dict[str, Any]], top: Path, charts: Path | None, markdown: Path) -> tuple[str, list[Path]]:
    """The whole document and the charts drawn (``charts=None``: none)."""
    drawn: list[Path] = []

    def chart(name: str, draw: Callable[..., Path], *args: Any) -> str | None:
        if charts is None:
            return None
        try:
            drawn.append(draw(*args, charts / name))
        except ImportError as err:
            print(f"charts skipped ({err}); `pip install matplotlib` to draw them", file=sys.stderr)
            return None
        return os.path.relpath(charts / name, markdown.parent)

    parts = [
        "# Benchmarks\n",
        "Generated by `python benchmarks/report.py` from the JSON under `benchmarks/results/`; do not edit by hand."
        " Host-bound step times move with the host from run to run: compare variants within one run.\n",
        readme_section(records, top),
        scoped_readme_section(records),
        "## Every way of training the same GPT\n\n`PYTHONPATH=. python benchmarks/run.py --suite readme`"
        " (each config in one process). *vs hand-written*: against the same capture written without the package"
        " (`handwritten_layer` for scoped variants, `pytorch_full_graph` for the whole step).\n",
    ]
    for run in of_kind(records, "table", top):
        name, title = f"bars_{Path(run['file']).stem}.png", f"{run['config']}, {PRECISIONS.get(run['precision'])}"
        parts.append(run_section(run, chart(name, bars, bar_rows(run["results"]), title)))
    for run in of_kind(records, "sweep", top):
        title = f"{run['config']}, {PRECISIONS.get(run['precision'])}"
        parts.append(sweep_section(run, chart(f"{Path(run['file']).stem}.png", sweep_chart, run, title)))
    if later := [r for r in of_kind(records, "table") if r["dir"] != top]:
        parts += ["## Later runs of `benchmarks/run.py`\n", *(run_section(run, None) for run in later)]
    for kind, (heading, command, section) in SECTIONS.items():
        if found := of_kind(records, kind):
            parts.append(f"## {heading}\n\n`PYTHONPATH=. python {command} --out {Path(found[0]['file']).parent}`\n")
        for record in found:
            if kind != "compile":
                parts.append(section(record))
                continue
            # Each model's bars against its own eager run, then named after the model (labels need the baseline).
            rows = [(f"{m} {bar[0]}", *bar[1:]) for m, got in record["models"].items()
                    for bar in bar_rows(got["results"])]  # fmt: skip
            title = f"compile=, {PRECISIONS.get(record['precision'])}"
            parts.append(compile_section(record, chart(f"compile_{record['precision']}.png", bars, rows, title)))
    return "\n".join(part for part in parts if part), drawn


def write(results: Path = RESULTS, markdown: Path | None = None, charts: Path | None = None) -> list[Path]:
    """Write the document (and the charts, when ``charts`` is given) from the JSON under ``results``.

    Raises:
        FileNotFoundError: No JSON under ``results``.
    """
    records = load(results)
    if not records:
        raise FileNotFoundError(f"no results JSON under {results}; run a benchmark with --out {results}")
    markdown = markdown or results / "RESULTS.md"
    text, drawn = render(records, results, charts, markdown)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(text)
    return [markdown, *drawn]


def refresh(out: Path, charts: bool = True) -> list[Path]:
    """After a run into ``out``: the docs where ``out`` is the committed results, else ``out/RESULTS.md``."""
    committed = out.resolve() == RESULTS
    drawn_in = (CHARTS if committed else out) if charts else None
    return write(RESULTS if committed else out, DOCS if committed else None, drawn_in)


def publish(out: Path, *written: Path) -> None:
    """Say what a run wrote into ``out``, then refresh that report (see :func:`refresh`)."""
    print("\n".join(f"wrote {path}" for path in (*written, *refresh(out))))


def main(argv: list[str] | None = None) -> int:
    """Regenerate the docs (default) or a results directory's ``RESULTS.md``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results", nargs="?", type=Path, default=RESULTS, help="a results directory (default: the committed ones)"
    )
    parser.add_argument("--no-charts", action="store_true", help="write the Markdown only")
    args = parser.parse_args(argv)
    try:
        written = refresh(args.results, charts=not args.no_charts)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 1
    print("\n".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

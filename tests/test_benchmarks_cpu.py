"""The benchmark harness on a CPU: command lines, figures, alternated rounds, JSON records, the docs and charts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import (
    audit_cost,
    auto,
    compile,
    hf,
    host_read,
    logging_cost,
    multi_gpu,
    optimizer_graph,
    report,
    run,
    scoped_compile,
    shapes,
)
from benchmarks.core import figures, records, timing
from benchmarks.core.kernels import kernel_class, kernel_summary
from benchmarks.core.models import CONFIGS, KNOWN_VARIANTS, SCOPES, train
from benchmarks.core.models import setup as variant_setup  # not `setup`: pytest would call a module-level setup()
from lightning_cudagraph import CUDAGraphStrategy
from zoo import run as zoo

REPO = Path(__file__).resolve().parent.parent
ENV = {"gpu": "Synthetic GPU", "torch": "0", "lightning": "0", "date": "2000-01-01", "command": "run.py"}


def fit(variant: str, ms: list[float], batch: int = 8) -> dict:
    return {"variant": variant, "batch_size": batch, **figures.spread(ms), "peak_mib": 100.0, "final_loss": 1.5}


def write_run(out: Path, config: str, precision: str, results: list[dict], kind: str = "table") -> Path:
    record = {"kind": kind, "config": config, "precision": precision, "batch_size": 8, "environment": ENV}
    record.update(model={"n_layer": 6, "width": 256, "seq_len": 128}, results=results)
    stem = f"{'sweep_batch_' if kind == 'sweep' else ''}{config}_{precision}"
    return records.write(record, out / f"{stem}.json")


def cells(markdown: str, start: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {start} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


# ---------------------------------------------------------------------------------------------------- figures
def test_spread_quantiles_and_ratios():
    assert figures.spread([4.0, 1.0, 3.0, 2.0]) == {"median_ms": 2.5, "p25_ms": 1.75, "p75_ms": 3.25, "steps_timed": 4}
    assert figures.spread([])["median_ms"] is None, "no steps timed is no figure, not NaN in the JSON"
    assert figures.ratio(10.0, 4.0) == 2.5
    assert figures.ratio(None, 4.0) is None and figures.ratio(10.0, 0.0) is None


def test_relative_figures_against_eager():
    results = [{"variant": "eager", "median_ms": 10.0}, {"variant": "layer", "median_ms": 4.0}]
    figures.add_relative(results, {"eager": [2.0, 1.0], "layer": [2.0, 1.25]})
    assert results[1]["speedup"] == 2.5 and results[1]["loss_max_abs_diff"] == 0.25
    assert results[0]["speedup"] == 1.0


def test_variants_alternate_round_by_round_and_each_counts_its_fastest():
    order, lines = [], []
    times = iter([5.0, 9.0, 4.0, 8.0])

    def measure(variant: str) -> dict:
        order.append(variant)
        return {"variant": variant, "median_ms": next(times), "compile_s": len(order)}

    got = timing.alternate(["a", "b"], 2, measure, say=lines.append, cold=["compile_s"])
    assert order == ["a", "b", "b", "a"], "rounds alternate in turns, so a slow stretch of the host hits both"
    assert [(r["median_ms"], r["round_ms"]) for r in got] == [(5.0, [5.0, 8.0]), (4.0, [9.0, 4.0])]
    assert [r["compile_s"] for r in got] == [1, 2], "compile times come from the first, cold, round"
    assert len(lines) == 4 and "[2]" in lines[2]


def test_in_turns_reverses_the_order_every_other_round_and_takes_the_median_of_rounds(capsys):
    order = []
    times = iter([5.0, 9.0, 8.0, 4.0, 6.0, 7.0])

    def measure(variant: str) -> dict:
        order.append(variant)
        return {"variant": variant, "median_ms": next(times)}

    fits = timing.in_turns(["a", "b"], 3, measure, lambda index, fit: f"[{index}] {fit['variant']}")
    assert order == ["a", "b", "b", "a", "a", "b"], "neither variant always goes first"
    assert {v: [f["median_ms"] for f in got] for v, got in fits.items()} == {"a": [5.0, 4.0, 6.0], "b": [9.0, 8.0, 7.0]}
    assert timing.median_of_rounds(fits) == {"a": 5.0, "b": 8.0}
    assert timing.round_ms(fits) == {"a": [5.0, 4.0, 6.0], "b": [9.0, 8.0, 7.0]}
    assert timing.ratio_per_round(fits, "b", "a") == [9.0 / 5.0, 2.0, 7.0 / 6.0]
    assert capsys.readouterr().out.splitlines() == ["[1] a", "[1] b", "[2] b", "[2] a", "[3] a", "[3] b"]


def test_a_failing_variant_is_noted_and_the_others_still_measured():
    def measure(variant: str) -> dict:
        if variant == "bad":
            raise RuntimeError("boom")
        return {"variant": variant, "median_ms": 1.0}

    bad, good = timing.alternate(["bad", "good"], 1, measure, say=lambda line: None)
    assert bad["median_ms"] is None and bad["note"] == "failed: RuntimeError: boom"
    assert good["median_ms"] == 1.0


def test_kernels_are_classed_and_the_floor_is_what_compile_leaves():
    assert kernel_class("nvjet_sm90_tst_64x48") == "gemm" and kernel_class("multi_tensor_apply_kernel") == "optimizer"
    summary = kernel_summary([("nvjet_gemm", 300.0), ("fmha_fwd", 100.0), ("triton_poi_fused", 200.0)], steps=2)
    assert (summary["kernel_ms"], summary["floor_ms"], summary["kernels"]) == (0.3, 0.2, 1.5)
    with pytest.raises(ValueError, match="at least 1"):
        kernel_summary([], steps=0)


# ---------------------------------------------------------------------------------------------------- variants
@pytest.mark.parametrize(
    ("variant", "options", "strategy"),
    [
        ("eager", None, "auto"),
        ("attn+mlp", {"scope": ["attn", "mlp"], "warmup_steps": 3}, "auto"),
        ("layer+compile", {"scope": ["layer"], "warmup_steps": 3, "compile": {"regions": True}}, "auto"),
        ("auto-callback", {}, "auto"),
        ("auto-strategy", None, "cudagraph"),
    ],
)
def test_each_variant_trains_as_a_user_writes_it(variant, options, strategy):
    assert variant_setup(variant) == (options, strategy)


def test_the_whole_step_variant_is_a_cudagraph_strategy_and_unknown_ones_are_refused():
    options, strategy = variant_setup("full_iteration+compile")
    assert options is None and isinstance(strategy, CUDAGraphStrategy)
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        variant_setup("nope")
    with pytest.raises(ValueError, match="only a fixed scope or the whole step"):
        variant_setup("eager+compile")


def test_the_plain_loops_and_every_scope_are_known_variants():
    assert {"pytorch_full_graph", "handwritten_layer", *SCOPES} <= set(KNOWN_VARIANTS)
    assert "experts" in CONFIGS["moe"]


def test_a_te_variant_without_transformer_engine_is_skipped_with_its_note():
    pytest.importorskip("examples.gpt")
    if __import__("importlib").util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    assert train("small", "te_layer", "32-true", 4, 1)["note"] == "skipped: Transformer Engine not installed"


# ---------------------------------------------------------------------------------------------------- command lines
def test_run_plans_one_config_a_sweep_and_the_suite():
    _, (spec,) = run.parse_args(["--config", "small", "--out", "x"])
    assert spec.variants == run.DEFAULT and (spec.steps, spec.skip, spec.rounds) == (80, 20, 1)
    assert spec.stem == "small_32-true"
    _, (sweep,) = run.parse_args(["--sweep", "batch", "--batch-sizes", "1,8"])
    assert sweep.batch_sizes == (1, 8) and sweep.stem == "sweep_batch_small_32-true"
    _, (moe,) = run.parse_args(["--config", "moe"])
    assert moe.variants == run.MOE
    _, plan = run.parse_args(["--suite", "readme"])
    stems = [spec.stem for spec in plan]
    assert {"small_32-true", "small_bf16-mixed", "small_bf16-mixed_te", "sweep_batch_small_32-true"} <= set(stems)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--suite", "readme", "--config", "small"], "--suite fixes"),
        (["--batch-sizes", "1,2"], "goes with --sweep"),
        (["--sweep", "batch", "--batch-sizes", "1,x"], "positive integers"),
        (["--skip", "80"], "--skip must be"),
        (["--variants", "eager,nope"], "unknown nope"),
    ],
)
def test_run_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (auto, ["--out", "x", "--timed", "300"], "--timed must be"),
        (auto, ["--out", "x", "--models", "gpt,bert"], "unknown bert"),
        (compile, ["--out", "x", "--precisions", "fp8"], "unknown fp8"),
        (compile, ["--out", "x", "--rounds", "0"], "--rounds must be"),
        (hf, ["--out", "x", "--skip", "100"], "--skip must be"),
        (logging_cost, ["--out", "x", "--timed", "200"], "--timed must be"),
        (scoped_compile, ["--out", "x", "--models", "medium,huge"], "unknown huge"),
        (host_read, ["--out", "x", "--timed", "200"], "--timed must be"),
        (multi_gpu, ["--out", "x", "--models", "gpt,bert"], "unknown bert"),
    ],
)
def test_the_other_scripts_refuse_bad_arguments(module, argv, message, capsys):
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    [
        run,
        auto,
        compile,
        hf,
        logging_cost,
        shapes,
        audit_cost,
        zoo,
        optimizer_graph,
        host_read,
        scoped_compile,
        multi_gpu,
    ],
)
def test_each_gpu_script_says_it_needs_cuda_and_exits_2(module, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = [] if module in (run, zoo) else ["--out", str(tmp_path)]
    assert module.main(argv) == 2
    said = capsys.readouterr()
    assert "needs a CUDA GPU" in said.out or "no CUDA device" in said.err


# ---------------------------------------------------------------------------------------------------- the ratios
def test_auto_ratios_against_the_best_fixed_variants_eager_and_rollbacks():
    results = [
        {"variant": v, "median_ms": ms} for v, ms in [("eager", 30.0), ("attn", 20.0), ("attn+moe_router", 18.0)]
    ]
    results += [{"variant": "layer", "median_ms": 29.0, "report": {"rollbacks": 1}}, {"variant": "full_iteration"}]
    results += [{"variant": "auto-strategy", "median_ms": 20.0}, {"variant": "auto-callback", "median_ms": 18.0}]
    results[4]["median_ms"] = None
    found = {(e["variant"], e["against"], e["reference"]): e for e in auto.ratios("qwen3_moe", results)}
    assert found["auto-strategy", "best fixed", "attn+moe_router"]["ratio"] == pytest.approx(0.9)
    assert found["auto-callback", "eager", "eager"]["met"] is True
    assert ("auto-strategy", "rolled back", "layer") in found


def test_the_ladder_cost_is_measured_against_the_fixed_variant_at_its_level():
    narrowed = {"level": "layer", "exclusions": {"layers.0": f"experts: {auto.PARTS_INSTEAD}"}}
    assert auto.fixed_variant_for("qwen3_moe", narrowed) == "attn+moe_router"
    assert auto.fixed_variant_for("gpt", {"level": "full_iteration"}) == "full_iteration"
    assert auto.fixed_variant_for("gpt", {"level": None}) == "eager"


def test_a_missed_compile_goal_names_the_hardest_limit():
    assert compile.limit_of(needed=1.0, floor=1.2, kernel=1.5, host=2.0) == "floor"
    assert compile.limit_of(needed=1.0, floor=0.5, kernel=1.2, host=0.8) == "kernels"
    assert compile.limit_of(needed=1.0, floor=0.5, kernel=0.8, host=1.5) == "host"
    compiled = {"median_ms": 1.9, "host_ms": 1.0, "kernels": {"kernel_ms": 1.8, "floor_ms": 1.0}}
    results = [{"variant": "full_iteration", "median_ms": 2.0}, {"variant": "full_iteration+compile", **compiled}]
    (entry, *_) = compile.ratios(results, "32-true")
    assert (
        entry["met"] is False
        and entry["limit"] == "kernels"
        and entry["needed_ms"] == pytest.approx(2.0 / 1.3, abs=1e-4)
    )


def test_shapes_data_is_grouped_by_length_and_padded():
    variable, fixed = shapes.samples(16, None), shapes.samples(16, 256)
    assert len({len(x) for x, _ in variable}) > 1 and {len(x) for x, _ in fixed} == {256}
    assert all((y == -100).any() or len(y) == 256 for _, y in fixed)


def test_audit_cost_scales_one_audit_to_the_default_interval():
    assert audit_cost.DEFAULT_EVERY == 1000


# ---------------------------------------------------------------------------------------------------- the report
def test_records_are_strict_json(tmp_path):
    with pytest.raises(ValueError):
        records.write({"x": float("nan")}, tmp_path / "bad.json")
    path = records.write({"kind": "table", "x": None}, tmp_path / "ok.json")
    assert json.loads(path.read_text()) == {"schema": records.SCHEMA_VERSION, "kind": "table", "x": None}


def test_the_report_computes_every_ratio_from_the_json(tmp_path):
    small = [fit("eager", [10.0, 10.0]), fit("layer", [4.0, 4.0]), fit("handwritten_layer", [5.0, 5.0])]
    write_run(tmp_path, "small", "32-true", [*small, fit("full_iteration", [2.5]), fit("pytorch_full_graph", [2.0])])
    write_run(tmp_path, "small", "bf16-mixed", [fit("eager", [8.0]), fit("full_iteration", [1.0])])
    sweep = [fit(v, [ms], batch) for batch, ms in ((1, 2.0), (64, 9.0)) for v in ("layer",)]
    write_run(tmp_path, "small", "32-true", [fit("eager", [10.0], 1), fit("eager", [10.0], 64), *sweep], "sweep")
    written = report.write(tmp_path, tmp_path / "docs.md", tmp_path / "charts")
    text = (tmp_path / "docs.md").read_text()
    assert cells(text, '`scope=["layer"]`')[:5] == ['`scope=["layer"]`', "4.00", "2.50x", "n/a", "n/a"]
    assert cells(text, '`strategy="cudagraph_full"`')[1:5] == ["2.50", "4.00x", "1.00", "8.00x"]
    assert cells(text, '`scope=["layer"]`' + " | 4.000")[4] == "1.25x", "vs the hand-written block capture"
    assert "| 64 | 10.000 | 9.000 | 1.11x |" in text, "the sweep divides eager by the variant at each batch size"
    assert all(path.exists() for path in written) and len(list((tmp_path / "charts").glob("*.png"))) == 3
    assert re.search(r"!\[[^]]*\]\(charts/bars_small_32-true\.png\)", text), "chart links are relative to the doc"


def test_the_report_without_json_says_so(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 1
    assert "no results JSON" in capsys.readouterr().err


def test_the_committed_results_give_every_docs_section(tmp_path):
    text, drawn = report.render(report.load(report.RESULTS), report.RESULTS, None, tmp_path / "benchmarks.md")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## README table" and len(headings) == 18, headings
    assert "## Dropless MoE: the zoo's Hugging Face MoE entries" in headings
    assert "## Gradient accumulation inside the whole step" in headings
    reads = json.loads((report.RESULTS / "host_read" / "host_read.json").read_text())["cases"]["item"]["round_ms"]
    per_round = sorted(layer / auto for layer, auto in zip(reads["layer"], reads["auto"], strict=True))
    assert f"{per_round[1]:.3f}x ({per_round[0]:.3f}-{per_round[2]:.3f}x) the callback's `layer`" in text
    scoped = json.loads((report.RESULTS / "scoped_compile" / "scoped_compile.json").read_text())["models"]["medium"]
    plain, compiled = scoped["median_ms"].values()
    assert f"| medium GPT | {plain:.3f} | {compiled:.3f} |" in text
    hand = json.loads((report.RESULTS / "handwritten" / "handwritten.json").read_text())["shapes"]["gpt8"]
    assert f"| GPT, 8 layers | `CUDAGraphStrategy` | {hand['median_ms']['layer-strategy']:.3f} |" in text
    assert f"{hand['ratio']['layer']:.3f}x" in text
    zoo = json.loads((report.RESULTS / "zoo" / "zoo.json").read_text())
    runs = [run for entry in zoo["entries"] for run in entry["runs"]]
    ok = sum(run["class"] == "graphs-ok" for run in runs)
    assert f"{len(runs)} runs against eager Lightning: {ok} on graphs" in text
    small = json.loads((report.RESULTS / "small_32-true.json").read_text())
    eager, whole = (
        next(r["median_ms"] for r in small["results"] if r["variant"] == v) for v in ("eager", "full_iteration")
    )
    assert f"| {whole:.2f} | {eager / whole:.2f}x |" in text
    assert drawn == []


def test_the_committed_docs_are_up_to_date(tmp_path):
    report.write(report.RESULTS, tmp_path / "benchmarks.md", None)
    generated = (tmp_path / "benchmarks.md").read_text()
    committed = report.DOCS.read_text()
    strip = lambda text: re.sub(r"!\[[^]]*\]\([^)]*\)\n\n", "", text)  # noqa: E731 (charts are not drawn here)
    assert strip(generated) == strip(committed), "run `python benchmarks/report.py` and commit docs/benchmarks.md"


def test_run_writes_its_record_and_results_page(tmp_path, monkeypatch, capsys):
    """``run.py --config small`` end to end with the training replaced: each variant's fastest round goes to JSON."""
    seen = []

    def fake_train(model, variant, precision, steps, skip, batch_size=None):
        seen.append(variant)
        ms = {"eager": 10.0, "layer": 4.0}.get(variant, 2.0) + len(seen) / 100
        return {**fit(variant, [ms]), "losses": [1.0], "report": {"pool_mib": 3.0} if variant == "layer" else None}

    monkeypatch.setattr(run, "train", fake_train)
    monkeypatch.setattr(records, "needs_cuda", lambda script: None)
    assert run.main(["--variants", "eager,layer", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert seen == ["eager", "layer", "layer", "eager"]
    record = json.loads((tmp_path / "small_32-true.json").read_text())
    assert [(r["variant"], r["median_ms"], r["round_ms"]) for r in record["results"]] == [
        ("eager", 10.01, [10.01, 10.04]),
        ("layer", 4.02, [4.02, 4.03]),
    ]
    assert "losses" not in record["results"][0], "the first losses are for parity, not for the record"
    page = (tmp_path / "RESULTS.md").read_text()
    assert cells(page, '`scope=["layer"]`')[1:3] == ["4.02", "2.49x"], "the README table of the run"
    assert (tmp_path / "bars_small_32-true.png").exists()


def test_the_optimizer_arithmetic_figures_start_from_a_zero_noise_floor(capsys):
    from benchmarks import optimizer_arithmetic

    assert optimizer_arithmetic.main(["--steps", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {line.rsplit(": ", 1)[0].strip(): float(line.rsplit(": ", 1)[1]) for line in lines[1:]}
    assert list(figures) == [label for label, _, _ in optimizer_arithmetic.FORMS]
    assert figures["default AdamW (foreach), again"] == 0.0, "the same kernels twice train the same"
    assert figures["the package's form of the default AdamW (fused, tensor lr)"] > 0.0, "other kernels round otherwise"


def test_the_compile_chart_labels_each_bar_with_its_speedup_over_that_models_eager(tmp_path, monkeypatch):
    drawn: dict[str, list[report.Bar]] = {}

    def bars(rows: list[report.Bar], title: str, path: Path) -> Path:
        drawn[path.name] = list(rows)
        return path

    monkeypatch.setattr(report, "bars", bars)
    monkeypatch.setattr(report, "sweep_chart", lambda run, title, path: path)
    report.render(report.load(report.RESULTS), report.RESULTS, tmp_path, tmp_path / "benchmarks.md")
    record = json.loads((report.RESULTS / "compile" / "compile_bf16-mixed.json").read_text())
    expected = {
        f"{model} {r['variant']}": {x["variant"]: x for x in got["results"]}["eager"]["median_ms"] / r["median_ms"]
        for model, got in record["models"].items()
        for r in got["results"]
    }
    labels = {row[0]: row[4] for row in drawn["compile_bf16-mixed.png"]}
    assert labels == pytest.approx(expected)
    assert {"small thunder", "small compile_reduce_overhead", "medium thunder"} <= labels.keys()

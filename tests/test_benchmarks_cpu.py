"""The benchmark suite's CPU-side parts: plans, argument checks, JSON records, the report and its charts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, run
from benchmarks.variants import CONFIGS, MOE_VARIANTS, SCOPE_VARIANTS, TE_SKIPPED, Result, failure_note, module_class

REPO = Path(__file__).resolve().parent.parent
ENV = {
    "gpu": "Synthetic GPU",
    "torch": "0.0",
    "cuda": "0.0",
    "lightning": "0.0",
    "python": "3",
    "date": "2000-01-01",
    "command": "python benchmarks/run.py --suite readme",
}

# Per-variant step times (ms) of the synthetic runs: a host-bound small config and a compute-bound medium one.
SMALL_MS = {
    "eager": [9.8, 10.0, 10.2, 10.1],
    "layer": [4.9, 5.0, 5.1, 5.0],
    "handwritten_layer": [4.4, 4.5, 4.6, 4.5],
    "full_iteration": [2.4, 2.5, 2.6, 2.5],
    "pytorch_full_graph": [1.9, 2.0, 2.1, 2.0],
    "compile_default": [8.0, 8.1, 8.2, 8.1],
}
MEDIUM_MS = {
    "eager": [65.0, 65.2, 65.4],
    "layer": [64.6, 64.8, 65.0],
    "full_iteration": [63.8, 64.0, 64.2],
    "pytorch_full_graph": [63.6, 63.8, 64.0],
}
SWEEP_BATCHES = (1, 4, 16, 64)


def sweep_ms(variant: str, batch: int) -> list[float]:
    """Graphs pay at small batches and stop paying once the GPU work dominates."""
    floor = {"eager": 10.0, "layer": 5.0, "full_iteration": 2.5, "pytorch_full_graph": 2.0}[variant]
    compute = 0.5 * batch
    return [max(floor, compute) + jitter for jitter in (-0.01, 0.0, 0.01)]


def result(variant: str, step_ms: list[float], **fields) -> Result:
    return Result(variant, list(step_ms), peak_mib=100.0, final_loss=1.5, **fields)


def write_synthetic(out: Path) -> dict[str, dict]:
    """Write two runs and a sweep into ``out`` exactly as run.py does; return the records by config."""
    small = [run.as_dict(result(v, ms), 8) for v, ms in SMALL_MS.items()]
    small.append(run.as_dict(Result("te_layer", note=TE_SKIPPED), 8))
    medium = [run.as_dict(result(v, ms), 8) for v, ms in MEDIUM_MS.items()]
    sweep_spec = run.SweepSpec("small", "32-true", batch_sizes=SWEEP_BATCHES)
    sweep = [run.as_dict(result(v, sweep_ms(v, b)), b) for b in SWEEP_BATCHES for v in sweep_spec.variants]
    records = {
        "small": run.make_record(run.RunSpec("small", "32-true", tuple(SMALL_MS)), ENV, small, 1.0),
        "medium": run.make_record(run.RunSpec("medium", "32-true", tuple(MEDIUM_MS), 30, 10), ENV, medium, 1.0),
        "sweep": run.make_record(sweep_spec, ENV, sweep, 1.0),
    }
    for record in records.values():
        run.write_record(record, out)
    return records


def median(values: list[float]) -> float:
    return Result("x", values).median_ms


def row_of(markdown: str, variant: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {variant} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    write_synthetic(tmp_path)
    return tmp_path


def test_records_are_strict_json_with_environment(results_dir):
    small = json.loads((results_dir / "small_32-true.json").read_text())
    assert small["environment"]["command"] == ENV["command"]
    assert {"gpu", "torch", "lightning", "date"} <= small["environment"].keys()
    te = next(r for r in small["results"] if r["variant"] == "te_layer")
    assert te["median_ms"] is None  # a skipped variant's NaN figures are written as null
    assert (results_dir / "sweep_batch_small_32-true.json").exists()


def test_table_ratios_come_from_the_data(results_dir):
    runs = {r["file"]: r for r in report.load_runs(results_dir)}
    table = report.table_markdown(runs["small_32-true.json"])
    header = table.splitlines()[0]
    assert "vs eager Lightning" in header
    assert "vs hand-written" in header
    columns = [c.strip() for c in header.strip("|").split("|")]
    layer = dict(zip(columns, row_of(table, "layer"), strict=True))
    eager_ms, layer_ms = median(SMALL_MS["eager"]), median(SMALL_MS["layer"])
    assert layer["vs eager Lightning"] == f"{eager_ms / layer_ms:.2f}x"
    assert layer["vs hand-written"] == f"{median(SMALL_MS['handwritten_layer']) / layer_ms:.2f}x"
    full = dict(zip(columns, row_of(table, "full_iteration"), strict=True))
    expected = median(SMALL_MS["pytorch_full_graph"]) / median(SMALL_MS["full_iteration"])
    assert full["vs hand-written"] == f"{expected:.2f}x"
    te = dict(zip(columns, row_of(table, "te_layer"), strict=True))
    assert te["median ms/step"] == report.MISSING
    assert te["note"] == TE_SKIPPED


def test_verdicts_follow_the_data(results_dir):
    runs = {r["file"]: r for r in report.load_runs(results_dir)}
    small, medium = runs["small_32-true.json"], runs["medium_32-true.json"]
    best = median(SMALL_MS["eager"]) / median(SMALL_MS["pytorch_full_graph"])
    assert report.verdict(small).startswith("host-bound")
    assert f"`pytorch_full_graph`: {best:.2f}x" in report.verdict(small)
    assert report.verdict(medium).startswith("compute-bound: graphs gain <5%")
    # the same table judged against a lower bar is no longer compute-bound: the verdict is computed, not fixed
    assert report.verdict(medium, threshold=1.01).startswith("host-bound")


def test_sweep_verdict_finds_where_graphs_stop_paying(results_dir):
    sweep = next(r for r in report.load_runs(results_dir) if report.is_sweep(r))
    assert report.sweep_batch_sizes(sweep) == list(SWEEP_BATCHES)
    speedups = [median(sweep_ms("eager", b)) / median(sweep_ms("layer", b)) for b in SWEEP_BATCHES]
    first_below = next(b for b, s in zip(SWEEP_BATCHES, speedups, strict=True) if s < report.GAIN_THRESHOLD)
    assert f"`layer` stops paying (<{report.GAIN_THRESHOLD:.2f}x) at batch {first_below}" in report.sweep_verdict(sweep)
    assert report.pays_until([1, 2], [2.0, 1.5]) == "pays at every batch size measured (up to 2)"


def test_report_cli_writes_markdown_and_charts(results_dir, capsys):
    assert report.main([str(results_dir)]) == 0
    markdown = (results_dir / report.RESULTS_FILE).read_text()
    assert "vs eager Lightning" in markdown
    assert "vs hand-written" in markdown
    assert markdown.count("**Verdict:**") == 3
    assert "compute-bound" in markdown
    assert f"python benchmarks/report.py {results_dir}" in markdown
    assert ENV["command"] in markdown
    charts = sorted(results_dir.glob("*.png"))
    assert [c.name for c in charts] == [
        "bars_medium_32-true.png",
        "bars_small_32-true.png",
        "sweep_batch_small_32-true.png",
    ]
    for chart in charts:
        assert chart.read_bytes().startswith(b"\x89PNG")
        assert f"]({chart.name})" in markdown
    assert str(results_dir / report.RESULTS_FILE) in capsys.readouterr().out


def test_report_cli_without_results(tmp_path):
    assert report.main([str(tmp_path)]) == 1


def test_run_says_it_needs_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--suite", "readme"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--variants", "eager,nope"],
        ["--suite", "readme", "--steps", "5"],
        ["--batch-sizes", "1,2"],
        ["--sweep", "batch", "--batch-sizes", "1,x"],
        ["--steps", "10", "--skip", "10"],
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        run.parse_args(argv)
    assert exit_info.value.code == 2


def test_plans():
    assert run.build_plan(run.parse_args(["--config", "moe"]))[0].variants == MOE_VARIANTS
    sweep = run.build_plan(run.parse_args(["--sweep", "batch", "--batch-sizes", "2,8", "--steps", "30"]))[0]
    assert (sweep.batch_sizes, sweep.steps, sweep.variants) == ((2, 8), 30, run.SWEEP_VARIANTS)
    plan = run.readme_plan(te=False)
    assert all(set(spec.variants) <= run.KNOWN_VARIANTS for spec in plan)
    assert "te_layer" not in plan[0].variants
    te_plan = run.readme_plan(te=True)
    assert [(s.precision, s.variants) for s in te_plan[:2]] == [
        ("bf16-mixed", run.TE_VARIANTS),
        ("transformer-engine", run.TE_VARIANTS),
    ]
    assert plan[0].variants[-2:] == run.COMPILE_VARIANTS
    assert [(s.config, s.precision) for s in plan[:6]] == [
        ("small", "32-true"),
        ("small", "bf16-mixed"),
        ("medium", "32-true"),
        ("medium", "bf16-mixed"),
        ("moe", "32-true"),
        ("moe", "bf16-mixed"),
    ]
    assert plan[0].repeat > 1  # the small-config comparisons are measured round robin
    assert isinstance(plan[-1], run.SweepSpec)


def test_every_scoped_variant_has_a_handwritten_reference():
    for variant in SCOPE_VARIANTS:
        assert report.handwritten_reference(variant) == "handwritten_layer"
    assert report.handwritten_reference("full_iteration") == "pytorch_full_graph"


def test_moe_config_builds_the_moe_model_and_its_scopes_resolve():
    from benchmarks import variants
    from lightning_cudagraph.scopes import resolve_scopes

    config = {**CONFIGS["moe"], "n_layer": 2, "width": 32, "heads": 2, "vocab_size": 64, "seq_len": 16}
    cls = module_class(config)
    assert cls is variants.MoEGPTModule
    from benchmarks.variants import model_args

    model = cls(**model_args(config))
    assert model.hparams.experts == CONFIGS["moe"]["experts"]
    resolution = resolve_scopes(model, SCOPE_VARIANTS["moe_router+preprocess"])
    assert len(resolution.targets) == 2 * config["n_layer"]


def test_te_layer_is_skipped_without_transformer_engine():
    from benchmarks.variants import te_available

    if te_available():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ImportError) as err:
        module_class(CONFIGS["small"], "te_layer")
    assert failure_note("te_layer", err.value) == TE_SKIPPED
    assert failure_note("layer", RuntimeError("boom")).startswith("failed: RuntimeError")


def test_transformer_engine_runs_get_their_own_file():
    from benchmarks.run import record_name

    plain = {"kind": "run", "config": "small", "precision": "bf16-mixed", "results": [{"variant": "eager"}]}
    te = {**plain, "results": [{"variant": "te_eager"}, {"variant": "te_layer"}]}
    assert record_name(plain) == "small_bf16-mixed.json"
    assert record_name(te) == "small_bf16-mixed_te.json"


def test_rounds_of_one_variant_are_pooled():
    from benchmarks.variants import Result

    merged = run.merge_rounds(Result("layer", [5.0, 6.0], peak_mib=300.0), Result("layer", [7.0], peak_mib=280.0))
    assert merged.step_ms == [5.0, 6.0, 7.0]
    assert merged.peak_mib == 300.0
    assert merged.median_ms == 6.0


def test_transformer_engine_runs_get_their_own_chart():
    from benchmarks.report import chart_name

    plain = {"kind": "run", "config": "small", "precision": "bf16-mixed", "results": [{"variant": "eager"}]}
    te = {**plain, "results": [{"variant": "te_eager"}, {"variant": "te_layer"}]}
    assert chart_name(plain) != chart_name(te)

"""benchmarks/compile.py without a GPU: its argument checks, its exit where CUDA is missing, and its pure figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import pytest

from benchmarks import compile as bench
from benchmarks.variants import Result
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphReport, CUDAGraphStrategy, Stage

REPO = Path(__file__).resolve().parent.parent


def test_says_it_needs_cuda_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(REPO / "benchmarks" / "compile.py"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert bench.NEEDS_CUDA in done.stdout
    assert not (tmp_path / "out").exists()


# =================================================================== command line
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x", "--steps", "60", "--timed", "60"], "--timed must be"),
        (["--out", "x", "--timed", "0"], "--timed must be"),
        (["--out", "x", "--steps", "4", "--timed", "1"], "--steps must be at least 5"),
        (["--out", "x", "--models", "small,large"], "--models: unknown model(s) large; known: small, medium, tiny"),
        (["--out", "x", "--models", " , "], "--models: unknown model(s) (none given)"),
        (["--out", "x", "--models", "moe"], "unknown model(s) moe"),
        (["--out", "x", "--precisions", "32-true,16-mixed"], "--precisions: unknown precision(s) 16-mixed"),
        (["--out", "x", "--precisions", ""], "--precisions: unknown precision(s) (none given)"),
        (["--steps", "20"], "--out"),
        (["--out", "x", "--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_time_the_last_60_of_160_steps(capsys):
    args = bench.parse_args(["--out", "x"])
    assert (args.steps, args.timed, args.rounds, args.out) == (160, 60, 2, "x")
    assert args.models == ["small", "medium"]
    assert args.precisions == ["32-true", "bf16-mixed"]
    assert "note:" not in capsys.readouterr().out


def test_lists_keep_their_order_without_repeats_and_short_runs_get_a_note(capsys):
    args = bench.parse_args(
        ["--out", "x", "--models", "medium, small,medium", "--precisions", "bf16-mixed", "--steps", "8", "--timed", "4"]
    )
    assert args.models == ["medium", "small"]
    assert args.precisions == ["bf16-mixed"]
    assert "timing starts at step 4" in capsys.readouterr().out


# =================================================================== variants
def test_every_variant_is_named_labelled_and_compared():
    assert bench.VARIANTS == (
        "eager",
        "compile_reduce_overhead",
        "full_iteration",
        "full_iteration+compile",
        "layer",
        "layer+compile",
        "pytorch_full_graph",
        "thunder",
    )
    assert set(bench.LABELS) == set(bench.VARIANTS) == set(bench.CHART_LABELS)
    compared = {name for variant, reference, _ in bench.COMPARISONS for name in (variant, reference)}
    assert compared <= set(bench.VARIANTS)


@pytest.mark.parametrize(
    ("variant", "callback", "strategy"),
    [
        ("eager", None, None),
        ("compile_reduce_overhead", None, None),
        ("layer", {"scope": ["layer"], "warmup_steps": 3}, None),
        ("layer+compile", {"scope": ["layer"], "warmup_steps": 3, "compile": True}, None),
        ("full_iteration", None, {"scope": ["full_iteration"], "warmup_steps": 3}),
        ("full_iteration+compile", None, {"scope": ["full_iteration"], "warmup_steps": 3, "compile": True}),
    ],
)
def test_variant_setup(variant, callback, strategy):
    assert bench.variant_setup(variant) == (callback, strategy)


@pytest.mark.parametrize("variant", ["thunder", "pytorch_full_graph", "attn", "full_iteration+thunder"])
def test_variant_setup_refuses_what_is_not_a_lightning_variant(variant):
    with pytest.raises(ValueError, match="unknown Lightning variant"):
        bench.variant_setup(variant)


def test_the_full_iteration_variant_is_what_strategy_cudagraph_full_trains():
    def config(strategy):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False)
        return trainer.strategy.cudagraph_config

    _, options = bench.variant_setup("full_iteration")
    assert config(CUDAGraphStrategy(**options)) == config("cudagraph_full")


@pytest.mark.parametrize("variant", bench.PACKAGE_VARIANTS)
def test_the_package_takes_every_variants_options(variant):
    callback, strategy = bench.variant_setup(variant)
    built = CUDAGraphCallback(**callback) if callback is not None else CUDAGraphStrategy(**strategy)
    config = built.config if callback is not None else built.cudagraph_config
    assert config.scope == (variant.partition("+")[0],)
    assert config.warmup_steps == bench.WARMUP_STEPS


# =================================================================== milestones
class FakeClock:
    def __init__(self):
        self.t = 100.0
        self.syncs = 0

    def sync(self):
        self.syncs += 1

    def now(self):
        return self.t


def _milestones(latency_steps=5):
    clock = FakeClock()
    return bench.Milestones(latency_steps, sync=clock.sync, now=clock.now), clock


def test_milestones_of_a_package_variant_sync_only_where_they_are_taken():
    milestones, clock = _milestones()
    milestones.fit_starts()  # t = 100
    replayed = [0, 0, 0, 0, 1, 2, 3, 4]  # after step 5, one step ran on graphs
    for done, count in enumerate(replayed):
        clock.t = 100.0 + {0: 2.0, 1: 5.0}.get(done, 5.0 + done)
        milestones.steps_done(done, count)
    assert milestones.first_step_s == pytest.approx(3.0)  # 105 - 102
    assert milestones.to_step_s == pytest.approx(10.0)  # end of step 5
    assert milestones.graphs_from_step == 4
    assert milestones.to_graphs_s == pytest.approx(9.0)
    # fit start, start and end of step 1, end of step 4 (first on graphs), end of step 5: nothing after
    assert clock.syncs == 5
    assert milestones.as_dict() == {"first_step_s": 3.0, "to_step_s": 10.0, "to_graphs_s": 9.0, "graphs_from_step": 4}


def test_milestones_without_the_package_or_before_the_latency_step():
    milestones, clock = _milestones()
    milestones.fit_starts()
    for done in range(4):  # the fit ended after 3 steps
        clock.t += 1.0
        milestones.steps_done(done, None)
    assert milestones.first_step_s == pytest.approx(1.0)
    figures = milestones.as_dict()
    assert (figures["to_step_s"], figures["to_graphs_s"], figures["graphs_from_step"]) == (None, None, None)
    assert clock.syncs == 3
    json.dumps(figures, allow_nan=False)


def test_milestones_when_graphs_start_at_the_latency_step_take_one_sync():
    milestones, clock = _milestones(latency_steps=2)
    milestones.fit_starts()
    for done, count in enumerate([0, 0, 1]):
        clock.t += 1.0
        milestones.steps_done(done, count)
    assert (milestones.graphs_from_step, milestones.to_graphs_s, milestones.to_step_s) == (2, 3.0, 3.0)
    assert clock.syncs == 4


# =================================================================== figures
def _report(**fields):
    report = {
        "stage": "REPLAYING",
        "level": None,
        "reason": None,
        "compile_s": None,
        "recompiles": None,
        "captures": 1,
        "replays": 150,
        "fallbacks": 0,
        "steps_replayed": 150,
        "rollbacks": 0,
        "rollback_reasons": [],
        "pool_mib": 20.0,
        "capture_ms": 30.0,
    }
    return {**report, **fields}


def _result(variant, ms, report=None, note="", **milestones):
    step_ms = [] if ms is None else [ms - 0.1, ms, ms + 0.1]
    return bench.figures(
        Result(variant, step_ms, peak_mib=100.0, final_loss=2.5, note=note), report, milestones or None
    )


def test_report_figures_read_compile_fields_where_the_report_has_them():
    report = CUDAGraphReport(stage=Stage.REPLAYING, replays=40, captures=1, pool_mib=12.0, capture_ms=30.0)
    figures = bench.report_figures(report)
    if not hasattr(report, "compile_s"):
        assert (figures["compile_s"], figures["recompiles"]) == (None, None)
    report.compile_s, report.recompiles = 12.5, 1
    figures = bench.report_figures(report)
    assert (figures["stage"], figures["compile_s"], figures["recompiles"]) == ("REPLAYING", 12.5, 1)
    assert figures["capture_ms"] == 30.0
    json.dumps(figures, allow_nan=False)


@pytest.mark.parametrize(
    ("variant", "report", "first_step_s", "expected"),
    [
        ("full_iteration+compile", {"compile_s": 20.0}, 21.0, (20.0, "report")),
        ("layer", {"compile_s": 0.0}, 0.5, (0.0, "report")),
        ("layer", {"compile_s": None}, 0.5, (None, None)),
        ("compile_reduce_overhead", None, 30.0, (30.0, "first step")),
        ("compile_reduce_overhead", None, None, (None, None)),
        ("eager", None, 0.4, (None, None)),
        ("thunder", None, None, (None, None)),
        ("thunder", None, 12.0, (12.0, "first step")),
    ],
)
def test_compile_figure(variant, report, first_step_s, expected):
    assert bench.compile_figure(variant, report, first_step_s) == expected


def test_figures_of_a_variant_without_milestones_are_json_ready():
    figures = _result("pytorch_full_graph", 5.0)
    assert figures["median_ms"] == pytest.approx(5.0)
    assert figures["report"] is None
    assert (figures["first_step_s"], figures["compile_s"], figures["compile_source"]) == (None, None, None)
    json.dumps(_result("thunder", None, note="skipped: Thunder is not installed"), allow_nan=False)


@dataclass
class ThunderLikeResult(Result):
    losses: list[float] = field(default_factory=list)
    first_step_s: float = float("nan")


def test_thunder_figures_take_its_first_step_and_losses_where_it_has_them():
    result = ThunderLikeResult("thunder", [4.9, 5.0, 5.1], final_loss=2.0, losses=[3.0, 2.9], first_step_s=30.0)
    figures, losses = bench.thunder_figures(result)
    assert losses == [3.0, 2.9]
    assert (figures["first_step_s"], figures["compile_s"], figures["compile_source"]) == (30.0, 30.0, "first step")
    assert (figures["to_step_s"], figures["to_graphs_s"], figures["report"]) == (None, None, None)
    skipped, none = bench.thunder_figures(Result("thunder", note="skipped: no thunder"))
    assert (skipped["median_ms"], skipped["first_step_s"], skipped["compile_s"], none) == (None, None, None, [])
    json.dumps(figures, allow_nan=False)


def test_thunder_is_skipped_with_the_peers_note_where_it_is_not_installed(monkeypatch):
    def must_not_run(*args):
        raise AssertionError("thunder_variant ran without thunder")

    peer = types.SimpleNamespace(
        THUNDER_SKIPPED="skipped: no thunder here", thunder_available=lambda: False, thunder_variant=must_not_run
    )
    monkeypatch.setitem(sys.modules, "benchmarks.thunder_peer", peer)
    result = bench.thunder_result(bench.CONFIGS["small"], "32-true", 10, 5)
    assert (result.variant, result.note, result.step_ms) == ("thunder", "skipped: no thunder here", [])
    peer.thunder_available = lambda: True
    peer.thunder_variant = lambda config, precision, steps, skip: Result("thunder", [float(steps), float(skip)])
    assert bench.thunder_result(bench.CONFIGS["small"], "bf16-mixed", 10, 5).step_ms == [10.0, 5.0]


def test_relative_figures_against_eager():
    results = [_result("eager", 20.0), _result("layer", 10.0, _report()), _result("thunder", None)]
    bench.add_relative_figures(results, {"eager": [3.0, 2.0], "layer": [3.0, 2.5, 1.0], "thunder": []})
    assert [r["speedup"] for r in results] == [1.0, 2.0, None]
    assert [r["loss_max_abs_diff"] for r in results] == [0.0, 0.5, None]


def _results():
    return [
        _result("eager", 30.0, first_step_s=1.0, to_step_s=2.0),
        _result("compile_reduce_overhead", 15.0, first_step_s=40.0, to_step_s=45.0),
        _result("full_iteration", 9.0, _report(compile_s=0.0), first_step_s=1.0, to_graphs_s=3.0, graphs_from_step=4),
        _result(
            "full_iteration+compile",
            6.0,
            _report(compile_s=25.0, recompiles=1),
            first_step_s=1.0,
            to_step_s=30.0,
            to_graphs_s=29.0,
            graphs_from_step=4,
            host_ms=2.0,
            kernels={"kernel_ms": 5.5, "floor_ms": 5.2},
        ),
        _result("layer", 12.0, _report(compile_s=0.0)),
        _result(
            "layer+compile",
            11.0,
            _report(stage="DISABLED", rollbacks=1, rollback_reasons=["capture_failed: RuntimeError: x | y"]),
        ),
        _result("pytorch_full_graph", 5.5),
        _result("thunder", None, note="skipped: Thunder is not installed"),
    ]


def test_ratios_with_goals_at_each_precision():
    fp32 = {(e["variant"], e["reference"]): e for e in bench.ratios(_results(), "32-true")}
    assert len(fp32) == len(bench.COMPARISONS)
    full = fp32["full_iteration+compile", "full_iteration"]
    assert (full["ratio"], full["goal"], full["met"], full["why"]) == (pytest.approx(1.5), 1.3, True, [])
    bf16 = {(e["variant"], e["reference"]): e for e in bench.ratios(_results(), "bf16-mixed")}
    assert (
        bf16["full_iteration+compile", "full_iteration"]["goal"],
        bf16["full_iteration+compile", "full_iteration"]["met"],
    ) == (1.8, False)
    assert fp32["full_iteration+compile", "compile_reduce_overhead"]["ratio"] == pytest.approx(2.5)
    assert fp32["full_iteration+compile", "compile_reduce_overhead"]["met"] is True  # the goal is "at least"
    hand = fp32["full_iteration+compile", "pytorch_full_graph"]
    assert (hand["ratio"], hand["goal"], hand["met"]) == (pytest.approx(5.5 / 6.0), None, None)


def test_ratios_say_why_a_side_is_missing_or_off_graphs():
    entries = {(e["variant"], e["reference"]): e for e in bench.ratios(_results(), "32-true")}
    thunder = entries["full_iteration+compile", "thunder"]
    assert (thunder["ratio"], thunder["goal"], thunder["met"]) == (None, 1.25, None)
    assert thunder["why"] == ["thunder: skipped: Thunder is not installed"]
    layer = entries["layer+compile", "layer"]
    assert layer["ratio"] == pytest.approx(12.0 / 11.0)
    assert layer["met"] is False
    assert layer["why"] == ["layer+compile: rolled back: capture_failed: RuntimeError: x | y"]
    # A variant that is not in the results at all (or failed) has no ratio and says so.
    failed = _result("full_iteration+compile", None, note="failed: RuntimeError: boom")
    alone = bench.ratios([failed], "bf16-mixed")
    assert all(e["ratio"] is None and e["met"] is None for e in alone)
    assert alone[0]["why"] == ["full_iteration+compile: failed: RuntimeError: boom", "full_iteration: not measured"]


def test_a_goal_below_the_kernels_compile_leaves_is_out_of_reach():
    bf16 = {(e["variant"], e["reference"]): e for e in bench.ratios(_results(), "bf16-mixed")}
    full = bf16["full_iteration+compile", "full_iteration"]  # 1.8x of 9 ms needs 5 ms: below the 5.2 ms floor
    assert (full["needed_ms"], full["floor_ms"], full["reachable"], full["met"]) == (5.0, 5.2, False, False)
    assert full["limit"] == "floor"
    assert bench.ratio_line(full).endswith(
        "goal missed); out of reach by compiling: the goal needs at most 5.00 ms/step, and the variant's GEMM,"
        " attention and optimizer kernels alone take 5.20 ms"
    )
    reduce_overhead = bf16["full_iteration+compile", "compile_reduce_overhead"]  # 15 / 2.5 = 6 ms: above the floor
    assert (reduce_overhead["needed_ms"], reduce_overhead["reachable"]) == (6.0, True)
    assert "out of reach" not in bench.ratio_line(reduce_overhead)
    layer = bf16["layer+compile", "layer"]  # not profiled
    assert (layer["floor_ms"], layer["reachable"]) == (None, None)
    hand = bf16["full_iteration+compile", "pytorch_full_graph"]  # no goal
    assert (hand["needed_ms"], hand["reachable"]) == (None, None)


def test_a_missed_goal_names_what_alone_takes_longer_than_the_step_it_needs():
    results = _results()
    by_name = {r["variant"]: r for r in results}
    by_name["full_iteration+compile"]["kernels"] = {"kernel_ms": 5.5, "floor_ms": 4.0}
    by_name["layer+compile"].update(report=_report(), host_ms=10.9, kernels={"kernel_ms": 3.0, "floor_ms": 2.0})
    bf16 = {(e["variant"], e["reference"]): e for e in bench.ratios(results, "bf16-mixed")}
    full = bf16["full_iteration+compile", "full_iteration"]  # 1.8x of 9 ms needs 5 ms: the floor fits, the kernels not
    assert (full["met"], full["limit"]) == (False, "kernels")
    assert bench.ratio_line(full).endswith(
        "goal missed); bounded by the compiled kernels: the goal needs at most 5.00 ms/step, and the variant's kernels"
        " take 5.50 ms (its GEMM, attention and optimizer kernels 4.00 ms)"
    )
    layer = bf16["layer+compile", "layer"]  # 1.2x of 12 ms needs 10 ms; 3 ms of kernels, 10.9 ms of host work
    assert (layer["met"], layer["limit"]) == (False, "host")
    assert bench.ratio_line(layer).endswith(
        "paced by the host: the goal needs at most 10.00 ms/step, and the variant's host takes 10.90 ms a step (its"
        " kernels 3.00 ms), which compiling does not shorten"
    )
    assert bf16["full_iteration+compile", "compile_reduce_overhead"]["limit"] is None  # met: nothing to name
    by_name["layer+compile"]["host_ms"] = 9.0  # nothing measured takes longer than 10 ms: no limit is named
    layer = {(e["variant"], e["reference"]): e for e in bench.ratios(results, "bf16-mixed")}["layer+compile", "layer"]
    assert (layer["met"], layer["limit"]) == (False, None)
    assert bench.ratio_line(layer).endswith("goal missed)")


def test_the_hardest_limit_is_named_first():
    assert bench.limit_of(needed_ms=5.0, floor_ms=5.2, kernel_ms=6.0, host_ms=7.0) == "floor"
    assert bench.limit_of(needed_ms=5.0, floor_ms=4.0, kernel_ms=6.0, host_ms=7.0) == "kernels"
    assert bench.limit_of(needed_ms=5.0, floor_ms=None, kernel_ms=4.0, host_ms=7.0) == "host"
    assert bench.limit_of(needed_ms=5.0, floor_ms=None, kernel_ms=None, host_ms=7.0) is None  # GPU time unknown
    assert bench.limit_of(needed_ms=None, floor_ms=5.2, kernel_ms=6.0, host_ms=7.0) is None


def test_variants_alternate_round_by_round_and_the_fastest_fit_counts(monkeypatch):
    order, host_speed = [], iter([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])

    def run_variant(variant, config, precision, steps, skip):  # the second round's first half ran on a fast host
        order.append(variant)
        ms = {"eager": 30.0, "full_iteration": 9.0}.get(variant, 12.0) * next(host_speed)
        fit = len([v for v in order if v == variant])
        result = _result(variant, ms, first_step_s=10.0 / fit, to_step_s=20.0 / fit)
        return result, [3.0, 2.0 + fit]  # the losses of a round: the first round's are kept

    monkeypatch.setattr(bench, "run_variant", run_variant)
    measured = bench.measure_model("small", "bf16-mixed", steps=20, skip=10, rounds=2)
    assert order == [*bench.VARIANTS, *bench.VARIANTS]
    by_name = {r["variant"]: r for r in measured["results"]}
    eager, full = by_name["eager"], by_name["full_iteration"]
    assert (eager["median_ms"], eager["round_ms"]) == (15.0, [30.0, 15.0])
    assert (full["median_ms"], full["round_ms"]) == (4.5, [9.0, 4.5])
    assert by_name["thunder"]["round_ms"] == [12.0, 24.0] and by_name["thunder"]["median_ms"] == 12.0
    # Time to steady state is the first fit's (inductor's caches cold), whichever fit was fastest.
    assert (full["first_step_s"], full["to_step_s"]) == (10.0, 20.0)
    assert full["loss_max_abs_diff"] == 0.0  # both sides' first-round losses
    full_vs = {(e["variant"], e["reference"]): e for e in measured["ratios"]}[
        "full_iteration+compile", "full_iteration"
    ]
    assert full_vs["ratio"] == pytest.approx(4.5 / 6.0)  # fastest against fastest


def test_the_rounds_column_lists_every_fit():
    results = _results()
    results[0]["round_ms"] = [30.0, 29.5]
    rows = bench.table(results, latency_steps=5, skip=10).splitlines()
    assert rows[0].endswith("| note | rounds ms |")
    assert rows[2].endswith("| 30.00 / 29.50 |")
    assert rows[3].endswith("|  |")  # a record from before rounds: the cell stays empty


def test_host_time_between_batch_starts_and_the_kernel_window_of_a_variant():
    clock = bench.CompileClock(parity_steps=2, latency_steps=5)
    clock.host_starts = [0.0, 0.001, 0.003, 0.004, 0.006]
    assert clock.host_median_ms(0) == pytest.approx(1.5)  # gaps of 1, 2, 1, 2 ms
    assert clock.host_median_ms(1) == pytest.approx(2.0)  # from step 1 on: 2, 1, 2 ms
    assert clock.host_median_ms(4) is None
    window = bench.kernel_window("full_iteration+compile", skip=100)
    assert (window.start, window.steps) == (100 - bench.KERNEL_GAP - bench.KERNEL_STEPS, bench.KERNEL_STEPS)
    assert bench.kernel_window("eager", skip=100) is None  # only the package's variants are profiled
    assert bench.kernel_window("layer", skip=bench.LATENCY_STEPS + bench.KERNEL_GAP) is None  # no room before timing


def test_ratio_lines():
    entries = bench.ratios(_results(), "bf16-mixed")
    lines = [bench.ratio_line(e) for e in entries]
    assert lines[0].startswith(
        '`strategy="cudagraph_full"` + `compile=True` vs `strategy="cudagraph_full"`: 1.50x'
        " (goal >= 1.80x: goal missed); out of reach by compiling"
    )
    assert lines[1].endswith('vs `torch.compile(mode="reduce-overhead")`: 2.50x (goal >= 2.50x: goal met)')
    assert lines[2].endswith("vs Thunder: n/a (goal >= 1.25x: n/a); thunder: skipped: Thunder is not installed")
    assert lines[3].startswith('`scope=["layer"]` + `compile=True` vs `scope=["layer"]`: 1.09x (goal >= 1.20x: goal')
    assert lines[4].endswith("vs hand-written whole-step capture: 0.92x")


def test_note_says_when_graphs_started_inside_the_timing():
    late = _result("layer", 12.0, _report(recompiles=2, fallbacks=3), graphs_from_step=120)
    text = bench.note(late, skip=100)
    assert "2 recompile(s)" in text
    assert "3 fallback(s)" in text
    assert "on graphs only from step 120: the timing (from step 101) has eager steps" in text
    assert "on graphs only" not in bench.note(late, skip=130)
    off = _result("layer", 30.0, _report(stage="DISABLED", reason="no_targets"))
    assert bench.note(off) == "graphs off: no_targets"


# =================================================================== Markdown, chart, main
ENV = {"gpu": "Synthetic GPU", "torch": "0", "lightning": "0", "thunder": "not installed", "date": "2000-01-01"}


def _record(precision, chart=None):
    results = _results()
    bench.add_relative_figures(results, {"eager": [3.0], **{r["variant"]: [3.0 + 1e-6] for r in results[1:5]}})
    measured = {"config": dict(bench.CONFIGS["small"]), "results": results, "ratios": bench.ratios(results, precision)}
    return {
        "kind": "compile",
        "precision": precision,
        "steps": 160,
        "timed": 60,
        "warmup_steps": 3,
        "latency_steps": 5,
        "parity_steps": 100,
        "environment": ENV,
        "models": {"small": measured},
        "chart": chart,
        "chart_note": None if chart else "matplotlib is not importable (no module)",
    }


def test_markdown_has_tables_ratios_environment_and_charts(tmp_path):
    (tmp_path / "compile_bf16-mixed.json").write_text(json.dumps(_record("bf16-mixed", "compile_bf16-mixed.png")))
    (tmp_path / "compile_32-true.json").write_text(json.dumps(_record("32-true"), allow_nan=False))
    (tmp_path / "compile_other.json").write_text(json.dumps({"kind": "auto"}))  # not ours

    text = bench.write_markdown(tmp_path).read_text()
    assert (tmp_path / bench.MARKDOWN).exists()
    assert text.index("## GPT small, 32-true") < text.index("## GPT small, bf16-mixed")
    assert text.count("Median ms per step over the last 60 of 160 steps") == 2
    assert "Synthetic GPU, torch 0, lightning 0, thunder not installed, 2000-01-01." in text
    assert "6 layers, width 256, 4 heads, sequence 128, batch 8, vocabulary 1024" in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert "| 5 steps s |" in rows["| variant"]
    assert "| host ms | kernel ms (floor) |" in rows["| variant"]
    assert text.count("GEMM, attention and optimizer kernels, which `compile=` leaves as they are") == 2
    assert rows["| eager Lightning"].startswith(
        "| eager Lightning | 30.00 | n/a |  | 1.00x |  | n/a | 1.00 |  | 2.00 | 100 |"
    )
    assert rows['| `strategy="cudagraph_full"` + `compile=True`'].startswith(
        '| `strategy="cudagraph_full"` + `compile=True` | 6.00 | 2.00 | 5.50 (5.20) | 5.00x | replaying | 25.0 | 1.00 |'
        " 29.00 (4) | 30.00 |"
    )
    assert "1 recompile(s)" in rows['| `strategy="cudagraph_full"` + `compile=True`']
    assert '| `torch.compile(mode="reduce-overhead")` | 15.00 | n/a |  | 2.00x |  | 40.0 *1st* |' in text
    assert "rolled back: capture_failed: RuntimeError: x \\| y" in rows['| `scope=["layer"]` + `compile=True`']
    assert rows["| Thunder"].startswith("| Thunder | n/a | n/a |  | n/a |  | n/a |")
    assert rows["| Thunder"].endswith("| skipped: Thunder is not installed |  |")
    assert text.count("(goal >= 1.30x: goal met)") == 1  # 32-true
    assert text.count("(goal >= 1.80x: goal missed)") == 1  # bf16-mixed
    assert "- Thunder" not in text
    assert "vs Thunder: n/a (goal >= 1.25x: n/a); thunder: skipped: Thunder is not installed" in text
    assert "![median ms/step per variant, bf16-mixed](compile_bf16-mixed.png)" in text
    assert "No chart for 32-true: matplotlib is not importable (no module)." in text


def test_chart_is_a_png_or_a_note(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    record = _record("32-true")
    drawn = bench.draw_chart_or_note(record, tmp_path)
    assert drawn == {"chart": "compile_32-true.png", "chart_note": None}
    assert (tmp_path / "compile_32-true.png").read_bytes().startswith(b"\x89PNG")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    missing = bench.draw_chart_or_note(record, tmp_path / "elsewhere")
    assert missing["chart"] is None
    assert missing["chart_note"].startswith("matplotlib is not importable")


def test_main_writes_a_record_per_precision_and_the_markdown(tmp_path, monkeypatch, capsys):
    calls = []

    def measure_model(model, precision, steps, skip, rounds):
        calls.append((model, precision, steps, skip, rounds))
        return _record(precision)["models"]["small"]

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: ENV)
    monkeypatch.setattr(bench, "measure_model", measure_model)
    monkeypatch.setattr(bench, "draw_chart_or_note", lambda record, out: {"chart": None, "chart_note": "off"})
    out = tmp_path / "out"
    argv = ["--out", str(out), "--models", "small", "--steps", "20", "--timed", "10", "--rounds", "3"]
    assert bench.main(argv) == 0
    assert calls == [("small", "32-true", 20, 10, 3), ("small", "bf16-mixed", 20, 10, 3)]
    record = json.loads((out / "compile_bf16-mixed.json").read_text())
    assert (record["kind"], record["steps"], record["timed"], record["parity_steps"]) == ("compile", 20, 10, 20)
    assert record["rounds"] == 3
    assert record["models"]["small"]["ratios"][0]["goal"] == 1.8
    assert (out / "compile_32-true.json").exists()
    assert "## GPT small, bf16-mixed" in (out / bench.MARKDOWN).read_text()
    assert "goal missed" in capsys.readouterr().out

"""benchmarks/auto.py without a GPU: its argument checks, its exit where CUDA is missing, and its pure figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

from benchmarks import auto
from benchmarks.variants import Result
from lightning_cudagraph import CUDAGraphReport, Stage
from lightning_cudagraph.health import LevelRecord

REPO = Path(__file__).resolve().parent.parent


def test_says_it_needs_cuda_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(REPO / "benchmarks" / "auto.py"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert auto.NEEDS_CUDA in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x", "--steps", "60", "--timed", "60"], "--timed must be"),
        (["--out", "x", "--timed", "0"], "--timed must be"),
        (["--out", "x", "--cost-steps", "-1"], "--cost-steps must be"),
        (["--out", "x", "--rounds", "0"], "--rounds must be"),
        (["--out", "x", "--models", "gpt,gpt2"], "unknown model"),
        (["--steps", "20"], "--out"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        auto.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_time_the_steady_state_after_the_ladder(capsys):
    args = auto.parse_args(["--out", "x"])
    assert (args.steps, args.timed, args.cost_steps, args.precision, args.rounds) == (200, 60, 1000, "32-true", 3)
    assert args.models == ["gpt", "llama", "qwen3_moe"]
    assert args.steps - args.timed >= auto.WARMUP_STEPS + auto.LADDER_STEPS
    assert "note:" not in capsys.readouterr().out
    auto.parse_args(["--out", "x", "--steps", "50", "--timed", "20"])
    assert "the ladder takes about" in capsys.readouterr().out


def test_hf_models_are_skipped_without_transformers():
    assert auto.runnable_models(["gpt", "qwen3_moe"], True) == (["gpt", "qwen3_moe"], {})
    models, skipped = auto.runnable_models(["llama", "gpt", "qwen3_moe"], False)
    assert models == ["gpt"]
    assert sorted(skipped) == ["llama", "qwen3_moe"]
    assert "transformers" in skipped["llama"]


def test_variants_per_model():
    assert auto.MODELS["gpt"] == auto.MODELS["llama"]
    assert auto.MODELS["qwen3_moe"] == (
        "eager",
        "attn",
        "attn+moe_router",
        "layer",
        "full_iteration",
        "auto-callback",
        "auto-strategy",
    )


@pytest.mark.parametrize(
    ("variant", "options", "strategy"),
    [
        ("eager", None, "auto"),
        ("attn", {"scope": ["attn"], "warmup_steps": 3}, "auto"),
        ("attn+mlp", {"scope": ["attn", "mlp"], "warmup_steps": 3}, "auto"),
        ("attn+moe_router", {"scope": ["attn", "moe_router"], "warmup_steps": 3}, "auto"),
        ("layer", {"scope": ["layer"], "warmup_steps": 3}, "auto"),
        ("full_iteration", None, "cudagraph_full"),
        ("auto-callback", {}, "auto"),
        ("auto-strategy", None, "cudagraph"),
    ],
)
def test_variant_setup(variant, options, strategy):
    assert auto.variant_setup(variant) == (options, strategy)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        auto.variant_setup("attn+moe")


@pytest.mark.parametrize(("name", "scope"), [("cudagraph", ("auto",)), ("cudagraph_full", ("full_iteration",))])
def test_strategy_names_train_the_scopes_the_variants_claim(name, scope):
    trainer = pl.Trainer(strategy=name, accelerator="cpu", logger=False, enable_progress_bar=False)
    assert trainer.strategy.cudagraph_config.scope == scope
    assert trainer.strategy.cudagraph_config.warmup_steps == auto.WARMUP_STEPS


@pytest.mark.parametrize(
    ("model", "level", "variant"),
    [
        ("gpt", "attn+mlp", "attn+mlp"),
        ("llama", "attn+mlp", "attn+mlp"),
        ("qwen3_moe", "attn+mlp", "attn+moe_router"),
        ("qwen3_moe", "attn", "attn"),
        ("llama", "layer", "layer"),
        ("gpt", "full_iteration", "full_iteration"),
        ("gpt", None, "eager"),
    ],
)
def test_fixed_variant_for_the_level_reached(model, level, variant):
    assert auto.fixed_variant_for(model, level) == variant
    assert variant in auto.MODELS[model]


def test_a_layer_level_narrowed_to_dense_parts_is_costed_against_the_dense_parts_pair():
    report = {"level": "layer", "exclusions": {"model.model.layers.0": f"capture_failed: ...; {auto.PARTS_INSTEAD}: a"}}
    assert auto.narrowed(report) and not auto.narrowed({"exclusions": {"model.x": "capture_failed: a host sync"}})
    assert auto.fixed_variant_for("qwen3_moe", "layer", auto.narrowed(report)) == "attn+moe_router"
    assert auto.fixed_variant_for("qwen3_moe", "layer") == "layer"


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown level"):
        auto.fixed_variant_for("gpt", "moe")


def _result(variant: str, ms: float | None, report: dict | None = None) -> dict:
    step_ms = [] if ms is None else [ms - 0.1, ms, ms + 0.1]
    figures = auto.as_dict(Result(variant, step_ms, peak_mib=100.0, final_loss=2.5))
    if report is not None:
        figures["report"] = {
            "stage": "REPLAYING",
            "reason": None,
            "rollbacks": 0,
            "rollback_reasons": [],
            "level": None,
            "ladder": [],
            "exclusions": {},
            **report,
        }
    return figures


ROLLED_BACK = {"stage": "DISABLED", "rollbacks": 1, "rollback_reasons": ["capture_failed: RuntimeError: host sync"]}
LADDER = [
    {"level": "attn", "status": "kept", "step_ms": 16.0, "capture_ms": 120.0, "steps": 9, "reason": None},
    {"level": "attn+mlp", "status": "slower", "step_ms": 15.8, "capture_ms": 80.0, "steps": 8, "reason": None},
    {"level": "layer", "status": "failed", "step_ms": None, "capture_ms": 40.0, "steps": 2, "reason": "a | b"},
    {"level": "full_iteration", "status": "skipped", "step_ms": None, "capture_ms": 0.0, "steps": 0, "reason": "x"},
]


def _moe_results() -> list[dict]:
    auto_report = {"level": "attn", "ladder": LADDER, "exclusions": {"model.layers.0.mlp": "capture failed"}}
    return [
        _result("eager", 20.0),
        _result("attn", 16.0, {}),
        _result("attn+moe_router", 15.0, {}),
        _result("layer", 20.5, ROLLED_BACK),
        _result("full_iteration", None, ROLLED_BACK),
        _result("auto-callback", 15.5, {**auto_report, "ladder": LADDER[:3]}),
        _result("auto-strategy", 16.0, auto_report),
    ]


def test_each_variant_counts_its_fastest_of_alternated_rounds(monkeypatch):
    # Round by round, the GPT's variants get slower and faster; a failed fit never counts over a timed one.
    medians = {"eager": [20.0, 19.0, 21.0], "layer": [6.3, None, 5.4], "full_iteration": [None, None, None]}
    order = []

    def fit(model, variant, precision, steps, skip):
        ms = medians.get(variant, [10.0] * 3)[sum(v == variant for v in order)]
        order.append(variant)
        report = None if variant == "eager" else {}
        return _result(variant, ms, report), [3.0, 2.0 + len(order)]

    monkeypatch.setattr(auto, "run_variant", fit)
    measured = auto.measure_model("gpt", "32-true", 200, 140, cost_steps=0, rounds=3)

    assert order == list(auto.MODELS["gpt"]) * 3
    by_name = {r["variant"]: r for r in measured["results"]}
    assert [r["variant"] for r in measured["results"]] == list(auto.MODELS["gpt"])
    assert (by_name["eager"]["median_ms"], by_name["eager"]["round_ms"]) == (19.0, [20.0, 19.0, 21.0])
    assert (by_name["layer"]["median_ms"], by_name["layer"]["round_ms"]) == (5.4, [6.3, None, 5.4])
    assert by_name["layer"]["round_levels"] == ["layer"] * 3
    assert by_name["full_iteration"]["median_ms"] is None
    assert by_name["layer"]["speedup"] == pytest.approx(19.0 / 5.4)
    # Loss parity reads the first round's losses (the same seed and batches every round): eager's second loss was
    # written at the first fit, layer's at the fourth; later rounds' would differ more.
    assert by_name["layer"]["loss_max_abs_diff"] == pytest.approx((2.0 + 4) - (2.0 + 1))
    assert measured["cost"] is None


def test_relative_figures_against_eager():
    results = [_result("eager", 20.0), _result("layer", 10.0, {}), _result("full_iteration", None, {})]
    losses = {"eager": [3.0, 2.0], "layer": [3.0, 2.5, 1.0], "full_iteration": []}
    auto.add_relative_figures(results, losses)
    assert [r["speedup"] for r in results] == [1.0, 2.0, None]
    assert [r["loss_max_abs_diff"] for r in results] == [0.0, 0.5, None]


def test_ratios_against_the_best_fixed_variants_eager_and_rollbacks():
    entries = auto.ratios("qwen3_moe", _moe_results())
    by_key = {(e["variant"], e["against"], e["reference"]): e for e in entries}
    best = by_key["auto-strategy", "best fixed", "attn+moe_router"]
    assert best["ratio"] == pytest.approx(15.0 / 16.0)
    assert (best["goal"], best["met"]) == (0.9, True)
    scoped = by_key["auto-callback", "best fixed scope", "attn+moe_router"]
    assert scoped["ratio"] == pytest.approx(15.0 / 15.5)
    assert by_key["auto-strategy", "eager", "eager"]["ratio"] == pytest.approx(1.25)
    assert by_key["auto-strategy", "eager", "eager"]["met"] is True
    assert by_key["auto-callback", "eager", "eager"]["ratio"] == pytest.approx(20.0 / 15.5)
    layer = by_key["auto-strategy", "rolled back", "layer"]
    assert layer["ratio"] == pytest.approx(20.5 / 16.0)
    assert (layer["goal"], layer["met"]) == (None, None)
    # A rolled-back variant without a median still gets its line, without a ratio.
    assert by_key["auto-callback", "rolled back", "full_iteration"]["ratio"] is None
    assert len(entries) == 8


def test_ratios_of_a_dense_model_have_no_eager_goal_and_can_miss():
    results = [
        _result("eager", 10.0),
        _result("attn", 8.0, {}),
        _result("attn+mlp", 7.0, {}),
        _result("layer", 6.0, {}),
        _result("full_iteration", 3.0, {}),
        _result("auto-callback", 6.2, {}),
        _result("auto-strategy", 4.0, {}),
    ]
    entries = auto.ratios("llama", results)
    assert [(e["variant"], e["reference"]) for e in entries] == [
        ("auto-strategy", "full_iteration"),
        ("auto-callback", "layer"),
    ]
    assert entries[0]["ratio"] == pytest.approx(0.75)
    assert entries[0]["met"] is False
    assert entries[1]["met"] is True
    assert auto.ratio_line(entries[0]) == (
        '`strategy="cudagraph"` (auto) vs best fixed (`strategy="cudagraph_full"`): 0.75x (goal >= 0.90x: missed)'
    )


def test_ratios_skip_variants_that_failed():
    results = [_result("eager", 10.0), _result("attn", None, {}), _result("auto-strategy", 8.0, {})]
    assert auto.ratios("gpt", results) == []


def test_cost_of_the_ladder_over_a_long_fit():
    auto_fit = {
        "variant": "auto-strategy",
        "wall_s": 10.4,
        "report": {"level": "attn", "capture_ms_total": 240.0, "ladder": LADDER},
        "note": "",
    }
    fixed_fit = {"variant": "attn", "wall_s": 10.0, "report": {"capture_ms_total": 120.0}, "note": ""}
    cost = auto.cost_record(1000, auto_fit, fixed_fit)
    assert cost["cost"] == pytest.approx(0.4 / 10.4)
    assert cost["met"] is True
    assert cost["ladder_steps"] == {"attn": 9, "attn+mlp": 8, "layer": 2, "full_iteration": 0}
    line = auto.cost_line(cost)
    assert "over a fit of 1000 steps" in line
    assert "10.40 s (settled on attn)" in line
    assert '`scope=["attn"]` 10.00 s: 3.8% (goal <= 5%: met)' in line
    assert "captures 240 ms in all (the fixed variant's: 120 ms)" in line
    assert "steps per rung: attn 9, attn+mlp 8, layer 2, full_iteration 0." in line
    json.dumps(cost, allow_nan=False)

    slow = auto.cost_record(1000, {**auto_fit, "wall_s": 12.0}, fixed_fit)
    assert slow["met"] is False
    assert "(goal <= 5%: missed)" in auto.cost_line(slow)


def test_the_cost_is_the_climbs_extra_time_where_it_was_timed():
    # After the climb both fits run the same graphs: the whole fits differ also by the host's scatter over those steps.
    auto_fit = {
        "variant": "auto-strategy",
        "wall_s": 10.6,
        "climb_s": 1.3,
        "report": {"level": "attn", "capture_ms_total": 240.0, "ladder": LADDER},
        "note": "",
    }
    fixed_fit = {"variant": "attn", "wall_s": 10.0, "climb_s": 1.1, "report": None, "note": ""}
    cost = auto.cost_record(1000, auto_fit, fixed_fit)
    assert cost["climb_cost"] == pytest.approx(0.2 / 10.2)
    assert cost["cost"] == pytest.approx(0.6 / 10.6)
    assert cost["met"] is True, "the climb decides"
    line = auto.cost_line(cost)
    assert f"the first {auto.CLIMB_STEPS} steps took 1.30 s" in line and 'vs 1.10 s with `scope=["attn"]`' in line
    assert "2.0% of the fit (goal <= 5%: met); whole fits:" in line and "10.00 s: 5.7%" in line

    walking = {**auto_fit, "report": {**auto_fit["report"], "ladder": [{"level": "attn", "steps": auto.CLIMB_STEPS}]}}
    unsettled = auto.cost_record(1000, walking, fixed_fit)
    assert unsettled["climb_cost"] is None and unsettled["met"] is False, "a climb still walking is not timed"
    assert "(the climb was not timed)" in auto.cost_line(unsettled)


def test_the_fastest_fit_takes_the_shortest_climb_of_all_rounds():
    fits = [
        {"variant": "attn", "wall_s": 10.0, "climb_s": 1.4, "report": None, "note": ""},
        {"variant": "attn", "wall_s": 10.5, "climb_s": 1.2, "report": None, "note": ""},
        {"variant": "attn", "wall_s": None, "climb_s": None, "report": None, "note": "failed"},
    ]
    fastest = auto.fastest_fit(fits)
    assert (fastest["wall_s"], fastest["climb_s"]) == (10.0, 1.2)


def test_a_ratio_just_short_of_its_goal_is_not_printed_as_the_goal():
    entry = {"variant": "auto-callback", "against": "eager", "reference": "eager", "goal": 1.25}
    assert "1.248x (goal >= 1.25x: missed)" in auto.ratio_line({**entry, "ratio": 1.2483, "met": False})
    assert "1.30x (goal >= 1.25x: met)" in auto.ratio_line({**entry, "ratio": 1.3, "met": True})
    assert "1.10x (goal >= 1.25x: missed)" in auto.ratio_line({**entry, "ratio": 1.1, "met": False})


def test_cost_that_could_not_be_measured():
    failed = {"variant": "auto-strategy", "wall_s": None, "report": None, "note": "failed: RuntimeError: boom"}
    fixed = {"variant": "eager", "wall_s": 9.0, "report": None, "note": ""}
    cost = auto.cost_record(1000, failed, fixed)
    assert (cost["cost"], cost["met"], cost["level"]) == (None, None, None)
    assert "not measured (auto-strategy: failed: RuntimeError: boom)" in auto.cost_line(cost)
    assert "not measured" in auto.cost_line(None)


def test_report_figures_keep_the_ladder_and_are_json_ready():
    report = CUDAGraphReport(stage=Stage.REPLAYING, replays=40, captures=3, pool_mib=12.0, capture_ms=30.0)
    report.level = "attn+mlp"
    report.ladder = [
        LevelRecord("attn", status="slower", step_ms=9.0, capture_ms=50.0, steps=8),
        LevelRecord("attn+mlp", status="kept", step_ms=8.0, capture_ms=60.0, steps=8),
        LevelRecord("layer", status="failed", capture_ms=20.0, steps=1, reason="capture_failed: x"),
        LevelRecord("full_iteration", status="skipped", reason="needs the strategy"),
    ]
    report.exclusions = {"model.layers.1.mlp": "parity"}
    report.capture_ms_total = 130.0
    figures = auto.report_figures(report)
    assert figures["stage"] == "REPLAYING"
    assert figures["level"] == "attn+mlp"
    assert [row["status"] for row in figures["ladder"]] == ["slower", "kept", "failed", "skipped"]
    assert figures["ladder"][2]["step_ms"] is None  # nan in the report
    assert figures["exclusions"] == {"model.layers.1.mlp": "parity"}
    assert figures["capture_ms_total"] == 130.0
    json.dumps(figures, allow_nan=False)


def test_level_reached():
    results = {r["variant"]: r for r in _moe_results()}
    assert auto.level_reached(results["eager"]) == ""
    assert auto.level_reached(results["attn"]) == "attn"
    assert auto.level_reached(results["layer"]) == "eager"  # rolled back
    assert auto.level_reached(results["auto-strategy"]) == "attn"
    settled_eager = _result("auto-callback", 20.0, {"stage": "DISABLED", "ladder": LADDER[:1]})
    assert auto.level_reached(settled_eager) == "eager"


def test_note_says_when_the_ladder_walked_into_the_timing():
    report = {"ladder": LADDER}  # 3 warmup steps and 19 on the rungs
    assert auto.ladder_settle_step(report) == 22
    walking = auto.note({"note": "", "report": report}, skip=20)
    assert "ladder walked until about step 22" in walking
    assert auto.note({"note": "", "report": report}, skip=140) == ""


def _record(precision: str) -> dict:
    results = [auto.fastest_round([result]) for result in _moe_results()]
    results[3] = auto.fastest_round([_result("layer", 21.0, ROLLED_BACK), results[3]])
    auto.add_relative_figures(results, {"eager": [3.0], **{r["variant"]: [3.0 + 1e-6] for r in results[1:]}})
    cost = auto.cost_record(
        1000,
        {"variant": "auto-strategy", "wall_s": 10.4, "report": results[-1]["report"], "note": ""},
        {"variant": "attn", "wall_s": 10.0, "report": None, "note": ""},
    )
    measured = {"config": auto.model_config("qwen3_moe"), "results": results, "cost": cost}
    measured["ratios"] = auto.ratios("qwen3_moe", results)
    return {
        "kind": "auto",
        "precision": precision,
        "steps": 200,
        "timed": 60,
        "cost_steps": 1000,
        "rounds": 3,
        "warmup_steps": 3,
        "parity_steps": 20,
        "environment": {"gpu": "Synthetic GPU", "torch": "0", "lightning": "0", "transformers": "5", "date": "2000"},
        "skipped": {"llama": "skipped: transformers>=5 is not installed"},
        "models": {"qwen3_moe": measured},
    }


def test_markdown_has_tables_ratios_ladder_and_cost(tmp_path):
    for precision in ("bf16-mixed", "32-true"):
        (tmp_path / f"auto_{precision}.json").write_text(json.dumps(_record(precision), allow_nan=False))
    (tmp_path / "auto_other.json").write_text(json.dumps({"kind": "hf"}))  # not ours

    text = auto.write_markdown(tmp_path).read_text()
    assert (tmp_path / auto.MARKDOWN).exists()
    assert text.index("## Qwen3-MoE, 32-true") < text.index("## Qwen3-MoE, bf16-mixed")
    assert "## Llama (dense), 32-true\n\nskipped: transformers>=5 is not installed" in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows['| `strategy="cudagraph"` (auto)'].startswith(
        '| `strategy="cudagraph"` (auto) | 16.00 | 1.25x | attn | replaying | 1e-06 | left eager: model.layers.0.mlp'
    )
    assert '| `scope=["layer"]` | 20.50 | 0.98x | eager | disabled |' in rows['| `scope=["layer"]`']
    assert "rolled back: capture_failed: RuntimeError: host sync" in rows['| `scope=["layer"]`']
    assert rows['| `scope=["layer"]`'].endswith("| 21.00 / 20.50 |"), "every round's median, the fastest counted"
    assert rows['| `strategy="cudagraph_full"`'].endswith("| n/a |"), "a round that was not timed"
    assert rows['| `strategy="cudagraph"` (auto)'].endswith("| 16.00 (attn) |"), "the level each round settled on"
    assert rows["| eager Lightning"].startswith("| eager Lightning | 20.00 | 1.00x |  |  |  |")
    assert "| layer | failed |  | 40 | 2 | a \\| b |" in text
    assert "| attn | kept | 16.00 | 120 | 9 |  |" in text
    assert "- `CUDAGraphCallback()` (auto) vs eager Lightning: 1.29x (goal >= 1.25x: met)" in text
    assert '- `strategy="cudagraph"` (auto) vs rolled back (`scope=["layer"]`): 1.28x' in text
    assert "3.8% (goal <= 5%: met)" in text
    assert text.count("Median ms per step over the last 60 of 200 steps") == 2
    assert text.count("in the fastest of 3 alternated fit(s) per variant; fixed scopes with `warmup_steps=3`") == 2


def test_config_of_each_model():
    gpt = auto.model_config("gpt")
    assert (gpt["n_layer"], gpt["width"], gpt["batch_size"], gpt["kind"]) == (6, 256, 8, "gpt")
    moe = auto.model_config("qwen3_moe")
    assert (moe["kind"], moe["num_experts"], moe["seq_len"], moe["batch_size"]) == ("qwen3_moe", 4, 128, 8)

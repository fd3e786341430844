"""benchmarks/hf.py without a GPU: its argument checks, its exit where CUDA is missing, and its Markdown tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import hf
from benchmarks.variants import Result

REPO = Path(__file__).resolve().parent.parent


def test_says_it_needs_cuda_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(REPO / "benchmarks" / "hf.py"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert hf.NEEDS_CUDA in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x", "--steps", "20", "--skip", "20"], "--skip must be"),
        (["--out", "x", "--models", "llama,gpt2"], "unknown model"),
        (["--steps", "20"], "--out"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        hf.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _result(variant: str, ms: float, report: dict | None = None) -> dict:
    figures = hf.as_dict(Result(variant, [ms - 0.1, ms, ms + 0.1], peak_mib=100.0, final_loss=2.5))
    if report is not None:
        figures["report"] = {"stage": "REPLAYING", "replays": 17, "fallbacks": 0, "pool_mib": 64.0, **report}
    return figures


def test_markdown_has_one_table_per_model_and_precision(tmp_path):
    config = hf.model_config("qwen3_moe")
    moe = [
        _result("eager", 20.0),
        _result("attn", 16.0, {}),
        _result(
            "layer",
            20.2,
            {"stage": "DISABLED", "replays": 0, "rollback_reasons": ["capture_failed: RuntimeError: a | b"]},
        ),
    ]
    for result in moe:
        result["speedup"] = 20.0 / result["median_ms"]
        result["loss_max_abs_diff"] = 0.0 if result["variant"] == "eager" else 3e-6
    env = {"gpu": "Synthetic GPU", "torch": "0", "lightning": "0", "transformers": "5", "date": "2000-01-01"}
    for precision in ("bf16-mixed", "32-true"):
        record = {
            "kind": "hf",
            "precision": precision,
            "steps": 80,
            "skip": 20,
            "warmup_steps": 3,
            "parity_steps": 20,
            "batch_size": 8,
            "seq_len": 128,
            "environment": env,
            "models": {"qwen3_moe": {"config": config, "results": moe}},
        }
        (tmp_path / f"hf_{precision}.json").write_text(json.dumps(record))
    (tmp_path / "small_32-true.json").write_text("{}")  # another benchmark's record: not ours

    text = hf.write_markdown(tmp_path).read_text()
    assert text.index("## Qwen3-MoE, 32-true") < text.index("## Qwen3-MoE, bf16-mixed")
    rows = [line for line in text.splitlines() if line.startswith("| `scope=")]
    assert rows[0].startswith('| `scope=["attn"]` | 16.00 | 1.25x | 100 | 64 |')
    assert "| disabled | 0 | 0 | 2.5000 | 3e-06 | rolled back: capture_failed: RuntimeError: a \\| b |" in rows[1]
    assert "4 experts, top-2" in text

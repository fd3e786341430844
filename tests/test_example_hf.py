"""examples/hf_causal_lm.py through LightningCLI on a CPU: the documented commands train eagerly and say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jsonargparse")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "hf_causal_lm.py"
CONFIG = REPO / "examples" / "hf_small.yaml"
#: Sizes that keep a two-step fit to seconds (the rest of the yaml stays as a user runs it).
TINY = [
    "--model.vocab_size=64",
    "--model.hidden_size=32",
    "--model.num_hidden_layers=2",
    "--model.num_attention_heads=2",
    "--model.num_key_value_heads=2",
    "--model.intermediate_size=64",
    "--model.moe_intermediate_size=32",
    "--model.max_position_embeddings=32",
    "--data.seq_len=16",
    "--data.batch_size=4",
    "--data.train_samples=256",  # 64 batches: the yaml's val_check_interval (50) fits in an epoch
]
MOE_STRATEGY = [
    "--trainer.strategy=lightning_cudagraph.CUDAGraphStrategy",
    "--trainer.strategy.scope=[attn,moe_router]",
]


@pytest.mark.parametrize(
    ("flags", "found"),
    [
        pytest.param([], "layer: 2 (model.model.layers.0, model.model.layers.1)", id="llama-layer"),
        pytest.param(
            ["--model.kind=qwen3_moe", *MOE_STRATEGY],
            "attn: 2 (model.model.layers.0.self_attn, model.model.layers.1.self_attn);"
            " moe_router: 2 (model.model.layers.0.mlp.gate, model.model.layers.1.mlp.gate)",
            id="qwen3_moe-attn+moe_router",
        ),
    ],
)
def test_example_trains_eagerly_on_cpu_and_says_why(tmp_path, flags, found):
    command = [
        sys.executable,
        str(EXAMPLE),
        "fit",
        f"--config={CONFIG}",
        "--trainer.max_steps=2",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        *TINY,
        *flags,
    ]
    env = {**os.environ, "PL_DISABLE_FORK": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert found in output, output[-4000:]  # the scopes found on the transformers model
    assert "CUDA graphs off (no_cuda)" in output, output[-4000:]
    assert "`max_steps=2` reached" in output, output[-4000:]

"""``benchmarks/logging_cost.py`` on a CPU: its options, the reference's ``log``, the fastest round and the table."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from benchmarks import logging_cost as bench
from examples.gpt import GPTModule


def test_says_it_needs_cuda_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timed", "0"], "--timed must be at least 1"),
        (["--steps", "10", "--timed", "8"], "--timed"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--out", "x", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_reference_overrides_log_and_still_runs_lightnings(monkeypatch):
    calls = []
    monkeypatch.setattr(pl.LightningModule, "log", lambda self, *args, **kwargs: calls.append((args, kwargs)))
    cls = bench.through_log(GPTModule)
    assert issubclass(cls, GPTModule)
    assert cls.log is not pl.LightningModule.log  # the package re-issues through an override every time
    model = cls(vocab_size=8, seq_len=4, n_layer=1, width=8, heads=2)
    model.log("train_loss", 1.0, prog_bar=True)
    assert calls == [(("train_loss", 1.0), {"prog_bar": True})]


def test_the_fastest_round_counts_and_every_round_is_kept():
    best = bench.fastest([{"ms": 2.0, "host_ms": 1.0}, {"ms": 1.5, "host_ms": 1.4}, {"ms": 1.7, "host_ms": 0.9}])
    assert best == {"ms": 1.5, "host_ms": 1.4, "round_ms": [2.0, 1.5, 1.7]}


def test_markdown_has_a_row_per_case_with_the_speedup():
    record = {
        "steps": 160,
        "timed": 60,
        "rounds": 2,
        "environment": {"gpu": "Synthetic GPU", "torch": "0", "lightning": "0", "date": "2000-01-01"},
        "cases": [
            {
                "case": bench.case_name(("small", "bf16-mixed", True)),
                "direct": {"ms": 1.1, "host_ms": 0.9},
                "self.log": {"ms": 2.2, "host_ms": 2.2},
                "ratio": 2.0,
            }
        ],
    }
    text = bench.markdown(record)
    assert "last 60 of 160 steps" in text and "fastest of 2 alternated rounds" in text
    assert "Synthetic GPU, torch 0, lightning 0, 2000-01-01." in text
    assert "| small bf16-mixed + compile | 1.100 | 0.900 | 2.200 | 2.200 | 2.00x |" in text

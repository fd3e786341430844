"""zoo/run.py on a CPU: its comparisons and classes, and one entry end to end through the fake backend."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils import _pytree as pytree

from benchmarks.core.zoo_summary import zoo_section, zoo_summary
from tests.fake_backend import FakeBackend, FakeRegion
from zoo import run as zoo
from zoo.models import ENTRIES, batch_tensors, checksum, entries_named

CPU_FAKE = zoo.Settings(device="cpu", capture_backend="fake", steps=6, timed=4, window=2)


class _TrainsWrong(FakeRegion):
    """A region that passes the parity check but trains on outputs 1% off (like a replay on stale buffers)."""

    def __call__(self, args, kwargs):
        output = super().__call__(args, kwargs)
        return pytree.tree_map(lambda v: v * 1.01 if isinstance(v, torch.Tensor) else v, output)


class _WrongBackend(FakeBackend):
    def capture_regions(self, calls, warmup_iters, capture=None):
        captured = super().capture_regions(calls, warmup_iters, capture)
        for region in captured.regions:
            region.__class__ = _TrainsWrong
        return captured


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ({"error": "RuntimeError: boom", "refused": False}, "error"),
        ({"error": "ValueError: scope", "refused": True}, "refused"),
        ({"ended_on_graphs": True, "off": []}, "graphs-ok"),
        ({"ended_on_graphs": True, "off": ["loss"]}, "graphs-WRONG"),
        ({"reason": "rollback: capture failed", "off": ["metrics"]}, "state-WRONG"),
        ({"reason": "shape_unstable", "off": []}, "eager-with-reason"),
        ({"reason": None, "off": []}, "eager-SILENT"),
    ],
)
def test_each_outcome_gets_its_class(inputs, expected):
    arguments = {"error": None, "refused": False, "ended_on_graphs": False, "reason": None, "off": [], **inputs}
    assert zoo.classify(**arguments) == expected


def test_off_eager_means_beyond_ten_times_the_noise_or_the_floor():
    tolerance = zoo.Tolerance.from_noise(zoo.Diff(loss=1e-4, params=0.0), floor=1e-5)
    assert (tolerance.loss, tolerance.params) == (pytest.approx(1e-3), 1e-5)
    assert tolerance.off(zoo.Diff(loss=9e-4, params=9e-6), dataset_changed=False) == []
    assert tolerance.off(zoo.Diff(loss=2e-3, params=2e-5), dataset_changed=True) == ["loss", "params", "dataset"]
    assert tolerance.off(zoo.Diff(loss=math.nan), dataset_changed=None) == ["loss"], "a NaN must not pass"
    assert tolerance.off(zoo.Diff(batch_mismatches=1), dataset_changed=None) == ["batches"]


def test_a_final_state_is_compared_tensor_by_tensor_relative_to_eager():
    eager = {"w": torch.tensor([1.0, -4.0]), "bn.num_batches_tracked": torch.tensor(8)}
    assert zoo.relative_error(eager, eager) == (0.0, None)
    error, name = zoo.relative_error({**eager, "bn.num_batches_tracked": torch.tensor(7)}, eager)
    assert (error, name) == (pytest.approx(1 / 8), "bn.num_batches_tracked")
    assert zoo.relative_error({"w": torch.zeros(3)}, {"w": torch.zeros(2)}) == (math.inf, "w")
    assert zoo.loss_error([1.0, 2.0], [1.0]) == math.inf, "a fit that ran fewer steps is off"


def test_the_batch_checksum_sees_every_tensor_of_a_hugging_face_batch_encoding():
    transformers = pytest.importorskip("transformers")
    ids = torch.arange(12).view(2, 6)
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert len(batch_tensors(batch)) == 2, "a BatchEncoding is a UserDict: its tensors must be found"
    same = checksum(
        batch_tensors(transformers.BatchEncoding({"input_ids": ids.clone(), "attention_mask": ids * 0 + 1}))
    )
    assert checksum(batch_tensors(batch)) == same
    assert checksum([ids.flip(0)]) != checksum([ids]), "a batch in another order must sum differently"


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="llama_clm_collator"):
        entries_named(["no_such_model"])
    with pytest.raises(ValueError, match="allowed"):
        zoo.parse_variants("fast")
    assert len(ENTRIES) >= 16


def test_one_entry_end_to_end_flags_a_wrong_graph_and_passes_a_right_one(monkeypatch):
    """The on-device MLP through ``scope=["layer"]`` on the fake backend, once right and once with a wrong graph."""
    (entry,) = entries_named(["device_tensordataset"])
    right = zoo.run_entry(entry, ["layer"], CPU_FAKE, say=lambda line: None)
    assert "skipped" not in right, right.get("skipped")
    (run,) = right["runs"]
    assert run["class"] == "graphs-ok", run
    assert right["noise"]["loss"] < 1e-6, "eager twice from the same seed trains the same (to CPU rounding)"
    assert run["report"]["replays"] > 0 and run["dataset_changed"] is False

    monkeypatch.setattr(zoo, "_fake_backend", _WrongBackend)
    wrong = zoo.run_entry(entry, ["layer"], CPU_FAKE, say=lambda line: None)
    (run,) = wrong["runs"]
    assert run["class"] == "graphs-WRONG", run
    assert "loss" in run["off"] and "params" in run["off"]
    record = {**zoo.header_for(CPU_FAKE, "test"), "entries": [right, wrong], "file": "zoo.json"}
    markdown = zoo_section(record)
    assert "**graphs-WRONG**" in markdown and "graphs-ok" in markdown
    assert "off eager: device_tensordataset" in zoo_summary(record)


def test_the_whole_step_keeps_a_constant_step_and_leaves_out_steps_whose_python_varies():
    """``strategy="cudagraph_full"`` on the zoo's device MLP (no false alarm) and its entries with per-step Python."""
    settings = zoo.Settings(device="cpu", capture_backend="fake", steps=12, timed=4, window=2)
    names = ["device_tensordataset", "python_skip", "python_annealed", "python_epoch_branch", "python_outputs_counter"]
    quiet = lambda line: None  # noqa: E731
    runs = {entry.name: zoo.run_entry(entry, ["full"], settings, say=quiet) for entry in entries_named(names)}
    classes = {name: record["runs"][0]["class"] for name, record in runs.items()}
    assert classes == {"device_tensordataset": "graphs-ok", **dict.fromkeys(names[1:], "eager-with-reason")}, classes
    for name in names[1:]:
        assert "step_python" in runs[name]["runs"][0]["reason"], runs[name]["runs"][0]["reason"]


def test_a_manual_gan_trains_on_the_whole_step_equal_to_eager():
    """The zoo's GAN (manual optimization, two optimizers, clipping) through the whole step and ``scope="auto"``."""
    settings = zoo.Settings(device="cpu", capture_backend="fake", steps=24, timed=4, window=2)
    (entry,) = entries_named(["manual_gan"])
    record = zoo.run_entry(entry, ["cudagraph", "full"], settings, say=lambda line: None)
    runs = {run["variant"]: run for run in record["runs"]}
    for variant, run in runs.items():
        assert run["class"] == "graphs-ok", (variant, run.get("reason"), run.get("off"))
        assert run["report"]["replays"] > 0, (variant, run["report"])
    assert runs["cudagraph"]["report"]["level"] == "full_iteration", runs["cudagraph"]["report"]


def test_the_moe_variant_runs_only_for_moe_entries():
    (entry,) = entries_named(["device_tensordataset"])
    record = zoo.run_entry(entry, ["moe"], CPU_FAKE, say=lambda line: None)
    assert record["runs"] == [], "Megatron's MoE scopes find nothing to capture in a dense model: not run"


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.moe], ids=lambda e: e.name)
def test_each_moe_entry_builds_a_dropless_model_whose_loss_holds_the_router_loss(entry):
    pytest.importorskip("transformers")
    built = entry.build(zoo.BuildContext(torch.device("cpu"), steps=2, batches=2))
    (ids,) = next(iter(built.loader))
    net = built.module.net
    output = net(input_ids=ids[:, :32], labels=ids[:, :32])
    assert output.aux_loss is not None and output.aux_loss.item() > 0, "the router's auxiliary loss is computed"
    asked = entry.name.split("_")[-2] + "_mm" if entry.name.endswith("_mm") else "eager"
    assert net.config._experts_implementation == asked

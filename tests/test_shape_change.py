"""``on_shape_change``: one decision for both drivers (eager, recapture, error, evict), with one error text."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from lightning_cudagraph._options.batches import batch_key
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.shape_change import ShapeAction, ShapeChange, ShapeDecision
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import CUDAGraphReport
from tests.fake_backend import FakeBackend
from tests.helpers import fit, graph_callback
from tests.models import TINY, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
SHAPE_4, SHAPE_3, SHAPE_2 = (batch_key(torch.zeros(rows, 16, dtype=torch.int64)) for rows in (4, 3, 2))


# =================================================================== the decision itself
def decision(policy: str, limit: int = 1) -> tuple[ShapeDecision, ShapeCache[str], StageMachine]:
    report = CUDAGraphReport()
    machine = StageMachine(report, FailurePolicy("CUDAGraphCallback", "eager"), release=lambda: None)
    cache: ShapeCache[str] = ShapeCache(limit, report, "CUDAGraphCallback", reset=lambda item: None)
    return ShapeDecision(policy, cache, machine, "CUDAGraphCallback"), cache, machine


def in_use(machine: StageMachine) -> None:
    """Graphs of one shape exist: the fit is past its warmup steps."""
    machine.begin_confirmation()


def test_the_option_is_parsed_once_into_its_enum_and_a_wrong_value_is_refused():
    assert decision("recapture")[0].policy is ShapeChange.RECAPTURE
    assert [policy.value for policy in ShapeChange] == ["eager", "recapture", "error"]
    with pytest.raises(ValueError, match="'ignore'"):
        decision("ignore")


@pytest.mark.parametrize("policy", ["eager", "recapture", "error"])
def test_during_warmup_every_policy_runs_the_eager_steps_then_captures(policy):
    shapes, _, _ = decision(policy)
    assert shapes.decide(SHAPE_4, seen=0, needed=WARMUP).action is ShapeAction.EAGER
    assert shapes.decide(SHAPE_4, seen=WARMUP - 1, needed=WARMUP).action is ShapeAction.EAGER
    outcome = shapes.decide(SHAPE_4, seen=WARMUP, needed=WARMUP)
    assert (outcome.action, outcome.reason, outcome.evicts) == (ShapeAction.CAPTURE, None, None)


def test_a_captured_shape_replays_its_graph_set():
    shapes, cache, _ = decision("eager")
    cache.add(SHAPE_4, "graphs of 4")
    outcome = shapes.decide(SHAPE_4, seen=0, needed=WARMUP)
    assert (outcome.action, outcome.held) == (ShapeAction.REPLAY, "graphs of 4")


def test_eager_falls_back_for_another_shape_naming_both():
    shapes, cache, machine = decision("eager")
    cache.add(SHAPE_4, "graphs of 4")
    in_use(machine)
    outcome = shapes.decide(SHAPE_3, seen=5, needed=1)
    assert outcome.action is ShapeAction.FALLBACK
    assert outcome.reason == "batch shape int64[3, 16] differs from the captured int64[4, 16]"


def test_recapture_runs_one_eager_step_of_the_new_shape_then_captures_it_evicting_the_least_recently_used():
    shapes, cache, machine = decision("recapture", limit=2)
    cache.add(SHAPE_4, "graphs of 4")
    cache.add(SHAPE_3, "graphs of 3")
    cache.get(SHAPE_4)  # 3 is now the least recently used
    in_use(machine)
    first = shapes.decide(SHAPE_2, seen=0, needed=1)
    assert first.action is ShapeAction.EAGER
    assert first.reason == "batch shape int64[2, 16] differs from the captured int64[3, 16], int64[4, 16]"
    outcome = shapes.decide(SHAPE_2, seen=1, needed=1)
    assert (outcome.action, outcome.evicts) == (ShapeAction.CAPTURE, SHAPE_3)
    cache.add(SHAPE_2, "graphs of 2")
    assert cache.shapes() == [SHAPE_4, SHAPE_2], "the cache evicted another shape than the decision named"


def test_recapture_with_room_left_evicts_nothing():
    shapes, cache, machine = decision("recapture", limit=2)
    cache.add(SHAPE_4, "graphs of 4")
    in_use(machine)
    assert shapes.decide(SHAPE_3, seen=1, needed=1).evicts is None


def test_error_raises_naming_both_shapes_and_the_fix():
    shapes, cache, machine = decision("error")
    cache.add(SHAPE_4, "graphs of 4")
    in_use(machine)
    with pytest.raises(RuntimeError) as raised:
        shapes.decide(SHAPE_3, seen=5, needed=1)
    assert str(raised.value) == (
        "CUDAGraphCallback(on_shape_change='error'): batch shape int64[3, 16] differs from the captured"
        " int64[4, 16]. Fix: keep batch shapes fixed (e.g. DataLoader(drop_last=True)), or pass"
        " on_shape_change='eager' or 'recapture'."
    )


def test_a_region_call_of_another_shape_falls_back_or_raises_with_the_same_text():
    eager, _, _ = decision("eager")
    assert eager.region_mismatch("model.blocks.0", "input 0: float32[4] -> float32[3]") == (
        "model.blocks.0: input 0: float32[4] -> float32[3]"
    )
    strict, _, _ = decision("error")
    with pytest.raises(RuntimeError, match=r"^CUDAGraphCallback\(on_shape_change='error'\): model.blocks.0 was"):
        strict.region_mismatch("model.blocks.0", "input 0: float32[4] -> float32[3]")


def test_a_shape_that_cannot_be_captured_falls_back_saying_so():
    shapes, cache, machine = decision("recapture", limit=2)
    cache.add(SHAPE_4, "graphs of 4")
    in_use(machine)
    outcome = shapes.decide(SHAPE_3, seen=9, needed=1, uncapturable=True)
    assert outcome.action is ShapeAction.FALLBACK and outcome.reason.endswith("; it cannot be captured")


def test_a_sealed_set_raises_for_a_shape_outside_it_under_any_policy():
    shapes, cache, machine = decision("recapture", limit=2)
    cache.add(SHAPE_4, "graphs of 4")
    cache.seal()
    in_use(machine)
    with pytest.raises(RuntimeError, match=r"int64\[3, 16\]\] has no graph and the set of shapes is sealed"):
        shapes.decide(SHAPE_3, seen=1, needed=1)


def test_non_finite_warmup_losses_capture_nothing_and_turn_graphs_off():
    shapes, _, machine = decision("eager")
    machine.warmup_losses.observe(torch.tensor(float("nan")))
    with pytest.warns(UserWarning, match="not finite"):
        assert shapes.decide(SHAPE_4, seen=WARMUP, needed=WARMUP).action is ShapeAction.WAIT
    assert not machine.graphs_allowed and machine.report.reason.startswith("nonfinite_warmup")


# =================================================================== both drivers, for real (fake backend)
def batches_of_sizes(sizes: list[int]) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(TINY["vocab_size"], (max(sizes), TINY["seq_len"] + 1), generator=generator)
    return DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)


def scoped(**options) -> dict:
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, **options)
    callback.capture_backend = FakeBackend()
    return {"callbacks": [callback]}


def whole_step(**options) -> dict:
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP, **options)
    strategy.capture_backend = FakeBackend()
    return {"strategy": strategy}


def run(sizes: list[int], graphs: dict):
    callbacks = graphs.pop("callbacks", [])
    return fit(decoder(TINY)[0], batches_of_sizes(sizes), len(sizes), callbacks, **graphs, **CPU)


def test_on_shape_change_error_has_one_text_under_both_drivers():
    sizes = [4] * (WARMUP + 2) + [3]
    texts = []
    for graphs in (scoped(on_shape_change="error"), whole_step(on_shape_change="error")):
        with pytest.raises(RuntimeError, match="on_shape_change='error'") as raised:
            run(sizes, graphs)
        texts.append(re.sub(r"^\w+\(", "(", str(raised.value)))  # the component differs: callback or strategy
    assert texts[0] == texts[1]
    assert re.search(r"batch shape int64\[3, 16\].* differs from the captured int64\[4, 16\]", texts[0]), texts[0]


@pytest.mark.parametrize("graphs", [scoped, whole_step], ids=["scoped", "whole-step"])
def test_on_shape_change_eager_falls_back_with_the_same_reason_under_both_drivers(graphs):
    sizes = [4] * (WARMUP + 2) + [3, 4]
    report = graph_callback(run(sizes, graphs(on_shape_change="eager")).trainer).report
    assert (report.stage, report.captures) == (Stage.REPLAYING, 1)
    changed = r"batch shape int64\[3, 16\].* differs from the captured int64\[4, 16\]"
    assert any(re.match(changed, reason) for reason in report.fallback_reasons), report.fallback_reasons


@pytest.mark.parametrize("graphs", [scoped, whole_step], ids=["scoped", "whole-step"])
def test_recapture_says_which_shape_a_capture_evicted_under_both_drivers(graphs, caplog, monkeypatch):
    sizes = [4] * (WARMUP + 1) + [3, 3, 3]  # max_graphs=2 holds 4 and 3; then 2 evicts 4, the least recent
    sizes += [2, 2, 2]
    # Lightning 2.4 (the floor) keeps its info messages off the root logger, where caplog listens.
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO):
        report = graph_callback(run(sizes, graphs(on_shape_change="recapture", max_graphs=2)).trainer).report
    assert (report.captures, report.evictions) == (3, 1), report.reason
    captured_2 = [r.getMessage() for r in caplog.records if "for batch int64[2, 16]" in r.getMessage()]
    assert captured_2 and captured_2[0].endswith("; evicted batch int64[4, 16], int64[4, 16]"), captured_2

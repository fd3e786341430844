"""No silently wrong step: the training patterns that once trained wrong, each against eager Lightning on a CPU.

Every test drives the real lifecycle through the fake capture backend and compares with an eager fit from the same
weights on the same batches: collator batches (``UserDict``), a dataset whose batches are views of one tensor,
``OneCycleLR`` with momentum cycling, a torchmetrics metric in a failed capture, gradient accumulation under scoped
graphs, a fit that never reaches replay, and a whole-step graph that is wrong (the shadow step and the audit).
"""

from __future__ import annotations

import re
from collections import UserDict

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics import SumMetric

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import dense_audits, fit, graph_callback, max_param_diff, parameters_of
from tests.models import TINY, DecoderModule, decoder, markov_tokens

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2


def whole_step(backend: FakeBackend | None = None, **options) -> CUDAGraphStrategy:
    strategy = CUDAGraphStrategy(**{"scope": ["full_iteration"], "warmup_steps": WARMUP, **options})
    strategy.capture_backend = backend or FakeBackend()
    return strategy


# ------------------------------------------------------------------ batches
class Encoding(UserDict):
    """What Hugging Face collators return: a ``UserDict`` (``BatchEncoding``)."""


class DictModule(DecoderModule):
    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        self.log("train_loss", loss)
        return loss


def padded_batches(lengths: list[int], batch: int = 4) -> list[Encoding]:
    """Collator-like batches padded to a few lengths (each sequence padded with its own last token)."""
    tokens = markov_tokens(TINY["vocab_size"], max(lengths), batch * len(lengths), seed=3)
    out = []
    for i, length in enumerate(lengths):
        rows = tokens[i * batch : (i + 1) * batch, : length + 1]
        out.append(Encoding(input_ids=rows[:, :-1].clone(), labels=rows[:, 1:].clone()))
    return out


class Listed(Dataset):
    """Ready-made batches; with ``batch_size=None`` the loader hands them over as they are."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def small_model(module=DictModule, **options):
    size = {**TINY, "seq_len": 32}
    model, _ = decoder(size, module=module, **options)
    return model


def test_collator_batches_of_several_lengths_each_get_their_own_graph_and_train_as_eager():
    lengths = [8, 16, 8, 16, 32, 8, 16, 32] * 2
    batches = padded_batches(lengths)
    eager = fit(small_model(), DataLoader(Listed(batches), batch_size=None), len(lengths), **CPU)
    backend = FakeBackend()
    run = fit(
        small_model(),
        DataLoader(Listed(batches), batch_size=None),
        len(lengths),
        strategy=whole_step(backend, on_shape_change="recapture", max_graphs=4),
        **CPU,
    )
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.captures == 3, "one graph per padded length"
    assert run.losses == pytest.approx(eager.losses, abs=1e-5)
    assert max_param_diff(eager.params, run.params) < 1e-4


def test_collator_batches_get_per_shape_graphs_under_scoped_capture_too():
    lengths = [8, 16] * 8
    batches = padded_batches(lengths)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, on_shape_change="recapture", max_graphs=4)
    callback.capture_backend = FakeBackend()
    fit(small_model(), DataLoader(Listed(batches), batch_size=None), len(lengths), [callback], **CPU)
    assert callback.report.stage == Stage.REPLAYING, callback.report.reason
    assert callback.report.captures == 2, "one graph set per padded length"


def test_a_dataset_of_batch_views_is_never_overwritten_by_the_static_buffers():
    tokens = markov_tokens(TINY["vocab_size"], 32, 4 * 8, seed=5)
    kept = tokens.clone()
    views = [(tokens[i * 4 : (i + 1) * 4, :-1], tokens[i * 4 : (i + 1) * 4, 1:]) for i in range(8)]
    model, _ = decoder({**TINY, "seq_len": 32})
    eager_model, _ = decoder({**TINY, "seq_len": 32})
    eager = fit(eager_model, DataLoader(Listed(views), batch_size=None), 16, **CPU)
    run = fit(model, DataLoader(Listed(views), batch_size=None), 16, strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.stage == Stage.REPLAYING
    assert torch.equal(tokens, kept), "the user's dataset was written to"
    assert run.losses == pytest.approx(eager.losses, abs=1e-5), "the second epoch trained on other data"


# ------------------------------------------------------------------ optimizer settings
class OneCycle(DecoderModule):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=64)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OneCycleFixedMomentum(DecoderModule):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=64, cycle_momentum=False)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WeightDecayAt(DecoderModule):
    """Sets the weight decay by hand once graphs exist (a setting the graph bakes in)."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == WARMUP + 3:
            self.trainer.optimizers[0].param_groups[0]["weight_decay"] = 0.5


def test_momentum_cycling_is_refused_loudly_and_training_stays_eager():
    eager = fit(*decoder(TINY, module=OneCycle), 12, gradient_clip_val=1.0, **CPU)
    with pytest.warns(UserWarning, match="optimizer_setting_changed.*betas.*cycle_momentum=False"):
        run = fit(*decoder(TINY, module=OneCycle), 12, strategy=whole_step(), gradient_clip_val=1.0, **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.rollbacks == 1
    assert run.losses == pytest.approx(eager.losses, abs=1e-6)
    assert max_param_diff(eager.params, run.params) < 1e-4


def test_a_schedule_that_moves_only_the_learning_rate_keeps_its_graph():
    eager = fit(*decoder(TINY, module=OneCycleFixedMomentum), 12, gradient_clip_val=1.0, **CPU)
    run = fit(*decoder(TINY, module=OneCycleFixedMomentum), 12, strategy=whole_step(), gradient_clip_val=1.0, **CPU)
    assert graph_callback(run.trainer).report.stage == Stage.REPLAYING
    assert run.losses == pytest.approx(eager.losses, abs=1e-5)


def test_a_setting_changed_by_hand_after_capture_rolls_back_before_the_graph_runs_with_the_old_one():
    eager = fit(*decoder(TINY, module=WeightDecayAt), 10, **CPU)
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['weight_decay'\] moved from 0.0 to 0.5"):
        run = fit(*decoder(TINY, module=WeightDecayAt), 10, strategy=whole_step(), **CPU)
    assert graph_callback(run.trainer).report.rollbacks == 1
    assert max_param_diff(eager.params, run.params) < 1e-4


# ------------------------------------------------------------------ captures without side effects
class MetricInStep(DecoderModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = SumMetric()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.seen.update(batch[0].float().sum())
        self.calls += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("backend", [FakeBackend(), FakeBackend(fail_step=RuntimeError("not permitted"))])
def test_a_dropped_capture_leaves_metrics_and_module_state_as_eager(backend):
    eager = fit(*decoder(TINY, module=MetricInStep), 8, **CPU)
    with pytest.warns(UserWarning, match="rolled back"):
        run = fit(*decoder(TINY, module=MetricInStep), 8, strategy=whole_step(backend), **CPU)
    assert graph_callback(run.trainer).report.rollbacks == 1
    assert float(run.model.seen.compute()) == float(eager.model.seen.compute())
    assert run.model.seen.update_count == eager.model.seen.update_count == 8
    assert run.model.calls == eager.model.calls == 8
    assert max_param_diff(eager.params, run.params) < 1e-4


# ------------------------------------------------------------------ graphs that never engage
def test_gradient_accumulation_reaches_scoped_graphs_with_warmup_in_optimizer_steps():
    size = {**TINY, "train_samples": 4 * 4 * 12}
    eager = fit(*decoder(size), 10, accumulate_grad_batches=4, **CPU)
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=3)
    callback.capture_backend = FakeBackend()
    run = fit(*decoder(size), 10, [callback], accumulate_grad_batches=4, **CPU)
    report = callback.report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays > 0
    assert max_param_diff(eager.params, run.params) < 1e-4


def test_a_fit_that_never_replays_ends_with_a_reason_and_a_warning():
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=5)
    callback.capture_backend = FakeBackend()
    with pytest.warns(UserWarning, match="not_engaged.*within the 5 eager warmup step"):
        fit(*decoder(TINY), 3, [callback], **CPU)
    assert callback.report.stage == Stage.DISABLED
    assert callback.report.reason.startswith("not_engaged: the fit ended after 3 optimizer step(s)")


# ------------------------------------------------------------------ the shadow step and the audit
class WrongAfter(FakeBackend):
    """Whole steps whose replays, from the ``after``-th on, also nudge a weight: a graph reading stale storage."""

    def __init__(self, after: int = 0) -> None:
        super().__init__()
        self.after = after

    def capture_step(self, body):
        return _Nudged(super().capture_step(body), self)


class _Nudged:
    def __init__(self, graph, backend: WrongAfter) -> None:
        self.graph, self.backend = graph, backend

    def replay(self) -> None:
        self.graph.replay()
        if self.graph.replays > self.backend.after:
            with torch.no_grad():
                self.backend.model.model.blocks[0].mlp.fc.weight.add_(1e-2)

    def reset(self) -> None:
        self.graph.reset()


def test_a_wrong_whole_step_graph_fails_its_shadow_step_and_never_touches_the_weights():
    eager = fit(*decoder(TINY), 8, **CPU)
    model, data = decoder(TINY)
    backend = WrongAfter()
    backend.model = model
    with pytest.warns(UserWarning, match="rolled back to eager training: parity: the whole-step graph is off"):
        run = fit(model, data, 8, strategy=whole_step(backend), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.parity_err > 1e-3
    # The graph's optimizer runs fused, eager's foreach: rounding apart (1e-5), far below the nudge (1e-2).
    assert max_param_diff(eager.params, run.params) < 1e-4, "the wrong graph's update was kept"


def test_a_right_graph_passes_its_shadow_step_and_the_audit_runs_at_its_interval():
    eager = fit(*decoder(TINY), 14, **CPU)
    run = fit(*decoder(TINY), 14, strategy=whole_step(audit_every_n_steps=4), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING
    # The capture step's shadow step, then audits dense after capture (2 steps, then 4 = audit_every_n_steps).
    assert report.audits == 1 + dense_audits(14 - WARMUP - 1, 4) == 4
    assert report.parity_err < 1e-6
    assert run.losses == pytest.approx(eager.losses, abs=1e-5)


def test_the_audit_catches_a_graph_that_goes_wrong_in_the_steady_state():
    eager = fit(*decoder(TINY), 16, **CPU)
    model, data = decoder(TINY)
    backend = WrongAfter(after=5)
    backend.model = model
    with pytest.warns(UserWarning, match="parity: the whole-step graph is off"):
        run = fit(model, data, 16, strategy=whole_step(backend, audit_every_n_steps=4), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.DISABLED and report.audits >= 2
    assert report.steps_replayed > 0
    # The audit's one-number verdict failed; it then names the parameter the graph got wrong, and by how much.
    reason = report.rollback_reasons[0]
    assert re.search(r"; first off: model\.blocks\.0\.mlp\.fc\.weight, by \d", reason), reason
    wrong_steps = max_param_diff(eager.params, parameters_of(run.model))
    assert wrong_steps < 0.1, "at most the steps between two audits trained on the wrong graph"


def test_scoped_graphs_are_audited_round_robin_and_a_region_gone_wrong_is_caught():
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, audit_every_n_steps=3)
    callback.capture_backend = FakeBackend()
    fit(*decoder(TINY), 16, [callback], **CPU)
    assert callback.report.stage == Stage.REPLAYING
    assert callback.report.audits >= 3 and callback.report.parity_err < 1e-6

    class GoesWrong(FakeBackend):
        def capture_regions(self, calls, warmup_iters, capture=None):
            captured = super().capture_regions(calls, warmup_iters, capture)
            for region in captured.regions:
                region._distort = 1.0  # right during confirmation ...
            self.later = captured.regions
            return captured

    backend = GoesWrong()
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, audit_every_n_steps=3)
    callback.capture_backend = backend

    class Corrupt(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == WARMUP + 4:
                for region in backend.later:
                    region._distort = 1.5  # ... and wrong in the steady state

    with pytest.warns(UserWarning, match="parity"):
        fit(*decoder(TINY), 20, [callback, Corrupt()], **CPU)
    assert callback.report.exclusions or callback.report.rollbacks, "the audit did not notice"


def test_every_region_takes_its_turn_in_the_audits_so_the_last_one_gone_wrong_is_caught():
    backend = FakeBackend()
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, audit_every_n_steps=2)
    callback.capture_backend = backend

    class CorruptLast(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == WARMUP + 3:  # confirmed by now: only the audits can see it
                backend.regions[-1]._distort = 1.5

    with pytest.warns(UserWarning, match="parity"):
        fit(*decoder(TINY), 16, [callback, CorruptLast()], **CPU)
    last = backend.regions[-1].name
    assert list(callback.report.exclusions) == [last], "the audits never checked the last region"
    assert callback.report.stage == Stage.REPLAYING, "the other region keeps its graph"


def test_audits_start_dense_after_a_capture_and_thin_out_to_the_interval():
    steps, every = 40, 16
    run = fit(*decoder(TINY), steps, strategy=whole_step(audit_every_n_steps=every), **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    # The capture step's shadow step, then audits after 2, 4, 8 and 16 more replayed steps: at 2, 6, 14 and 30.
    replayed = steps - WARMUP - 1
    assert report.audits == 1 + dense_audits(replayed, every) == 1 + 4

"""``scope="auto"`` 's ladder on a CPU: levels found per layout, the walk's decisions, narrowing, the memory budget.

The fake backend reports a step time per level (from the regions or step graph alive at the end of each step), so
every decision of the climb is exercised with times the test chooses; capture and replay run through the package's
real lifecycle. Capture on a GPU is in ``tests/test_gpu_ladder.py``.
"""

from __future__ import annotations

import csv
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from lightning_cudagraph._options.levels import Level, build_levels
from lightning_cudagraph._rollout.ladder import (
    CHECK_STEPS,
    EAGER,
    FAR,
    MARGIN,
    MAX_MEASURE_STEPS,
    MEASURE_STEPS,
    REFERENCE_STEPS,
    Ladder,
)
from lightning_cudagraph.health import CUDAGraphReport
from tests.fake_backend import FakeBackend
from tests.helpers import (
    LEVEL_MS,
    assert_losses_close,
    fit,
    graph_callback,
    max_param_diff,
    parameters_of,
    patched_forwards,
    timed_by_level,
    trainer,
)
from tests.models import TINY, TINY_DATA, Decoder, DecoderModule, MoEDecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: Steps the climb spends per scoped level: capture and parity checks, the rest of confirmation, then the timed ones.
STEPS_PER_LEVEL = 2 + MEASURE_STEPS
#: Enough for the eager reference, every level timed as long as a close call takes, and the steady-state check.
STEPS = WARMUP + REFERENCE_STEPS + 5 * (1 + MAX_MEASURE_STEPS) + CHECK_STEPS + 4
#: A level's time when a test is about the levels below it: not faster than eager training by the margin.
NOT_FASTER = LEVEL_MS["eager"] * (1 - MARGIN / 2)
#: Why the walk skips the levels narrower than the one it kept.
HOLDS_ITS_WORK = "{!r} was confirmed faster and holds its work"


def timed(**ms: float) -> FakeBackend:
    """A fake backend whose steps take ``ms[level]`` milliseconds (:data:`~tests.helpers.LEVEL_MS` otherwise)."""
    return FakeBackend(step_ms=timed_by_level({**LEVEL_MS, **ms}))


def auto_callback(backend: FakeBackend, **options) -> CUDAGraphCallback:
    callback = CUDAGraphCallback(warmup_steps=WARMUP, **options)
    callback.capture_backend = backend
    return callback


def auto_strategy(backend: FakeBackend, **options) -> CUDAGraphStrategy:
    strategy = CUDAGraphStrategy(warmup_steps=WARMUP, **options)
    strategy.capture_backend = backend
    return strategy


def rows_of(report) -> list[tuple[str, str]]:
    """The report's ladder rows as ``(level, status)``."""
    return [(row.level, row.status) for row in report.ladder]


# ---------------------------------------------------------------------------------------------- the levels per model
def test_levels_of_a_dense_decoder_widen_from_attention_to_layers():
    model, _ = decoder(TINY)
    levels = build_levels(model, {}, whole_step_problem=None)
    assert [level.name for level in levels] == ["attn", "attn+mlp", "layer", "model", "full_iteration"]
    assert [t.name for t in levels[3].targets] == ["model"], "the module's one submodule holds every parameter"
    assert [t.name for t in levels[1].targets] == [
        f"model.blocks.{i}.{part}" for i in range(TINY["n_layer"]) for part in ("attn", "mlp")
    ]
    assert all(level.unavailable is None for level in levels)


def test_levels_of_an_moe_decoder_take_the_router_with_the_dense_parts():
    model, _ = decoder(TINY, MoEDecoderModule)
    levels = {level.name: level for level in build_levels(model, {}, whole_step_problem="needs the strategy")}
    assert [t.name for t in levels["attn+mlp"].targets] == [
        f"model.blocks.{i}.{part}" for i in range(TINY["n_layer"]) for part in ("attn", "moe.router")
    ]
    assert levels["full_iteration"].unavailable == "needs the strategy"


def test_a_level_that_finds_the_same_modules_as_the_one_before_is_skipped():
    model, _ = decoder(TINY)
    levels = build_levels(model, {"mlp": ("nowhere.*",)}, whole_step_problem=None)
    assert levels[1].unavailable == "the same modules as 'attn'"


def test_custom_scopes_join_every_scoped_level():
    model, _ = decoder(TINY)
    levels = build_levels(model, {"head": ("model.head",)}, whole_step_problem=None)
    assert all("model.head" in [t.name for t in level.targets] for level in levels[:3])


# ---------------------------------------------------------------------------------------------- the walk
def test_through_the_strategy_the_walk_tries_the_whole_step_first_and_settles_on_it():
    backend = timed()
    eager = fit(*decoder(TINY), STEPS, **CPU)
    run = fit(*decoder(TINY), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "skipped"),
        ("full_iteration", "kept"),
    ]
    assert all(row.reason == HOLDS_ITS_WORK.format("full_iteration") for row in report.ladder[:4])
    assert [row.level for row in report.ladder if row.steps or row.capture_ms] == ["full_iteration"]
    assert backend.regions == [] and backend.pools == 1, "no scoped level was ever captured"
    assert (report.stage, report.level) == (Stage.REPLAYING, "full_iteration")
    assert backend.step_graphs and backend.step_graphs[-1].replays > 0
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert all(optimizer.restored for optimizer in backend.optimizers)


class _HookedModel(DecoderModule):
    """A forward hook on the network: preflight refuses the whole step (it would run the hook once, at capture)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.model.register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.calls += 1


def test_a_whole_step_refused_by_preflight_starts_the_walk_at_the_widest_level_left():
    backend = timed()
    eager = fit(*decoder(TINY, _HookedModel), STEPS, **CPU)
    run = fit(*decoder(TINY, _HookedModel), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "skipped"),
    ]
    assert "carry hooks" in report.ladder[-1].reason, report.ladder[-1].reason
    assert [region.name for region in backend.regions] == ["model"], "the model level was the first captured"
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "model", 0)
    assert run.model.calls == eager.model.calls == STEPS, "the region's own hook fires around every replay"
    assert_losses_close(eager.losses, run.losses, 1e-5)


def test_the_callback_tries_the_models_submodules_first_with_the_loss_and_optimizer_eager():
    backend = timed()
    eager = fit(*decoder(TINY), STEPS, **CPU)
    callback = auto_callback(backend)
    run = fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "skipped"),
    ]
    assert report.ladder[2].reason == HOLDS_ITS_WORK.format("model")
    assert "Trainer(strategy='cudagraph')" in report.ladder[-1].reason
    assert (report.stage, report.level, report.scopes["model"]) == (Stage.REPLAYING, "model", ["model"])
    assert [region.name for region in backend.regions] == ["model"], "one level captured: the model's submodule"
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert max_param_diff(parameters_of(eager.model), parameters_of(run.model)) < 1e-5
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0


def test_a_level_not_faster_than_eager_by_the_margin_hands_over_to_the_next_narrower_one(tmp_path):
    # The model level is a near tie with eager training: timed as a close call, then layers go next, and pay.
    backend = timed(model=NOT_FASTER)
    eager = fit(*decoder(TINY), STEPS, **CPU)
    callback = auto_callback(backend)
    run = fit(*decoder(TINY), STEPS, [callback], logger=CSVLogger(tmp_path), log_every_n_steps=1, **CPU)

    report = callback.report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "kept"),
        ("model", "slower"),
        ("full_iteration", "skipped"),
    ]
    assert report.ladder[1].reason == HOLDS_ITS_WORK.format("layer")
    assert report.ladder[1].steps == 0 and report.ladder[1].capture_ms == 0, "a narrower level was never tried"
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "layer", 0)
    assert [report.ladder[i].step_ms for i in (3, 2)] == [NOT_FASTER, LEVEL_MS["layer"]]
    assert report.ladder[3].steps >= 1 + MAX_MEASURE_STEPS, "a call within the margin is timed longer"
    assert report.ladder[2].steps <= STEPS_PER_LEVEL, "a clear call is decided on its first window"
    assert report.capture_ms_total >= sum(row.capture_ms for row in report.ladder) > 0
    assert backend.pools == 2, "each level tried captures into a pool of its own"
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0
    with open(f"{run.trainer.logger.log_dir}/metrics.csv") as handle:
        levels = [float(row["cudagraph/level"]) for row in csv.DictReader(handle) if row.get("cudagraph/level")]
    assert levels[0] == 3.5 and levels[-1] == 3.0 and set(levels) == {3.5, 3.0}, "cudagraph/level follows the walk"


@pytest.mark.parametrize("narrower", ["faster_within_the_margin", "slower"])
def test_a_near_tie_settles_on_the_wider_level(narrower):
    # The model level within the margin of the whole step, either way: the wider level stays, the narrower is not tried.
    whole = LEVEL_MS["full_iteration"]
    near = whole * (1 - MARGIN / 2) if narrower == "faster_within_the_margin" else whole * (1 + MARGIN / 2)
    backend = timed(model=near)
    run = fit(*decoder(TINY), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert (report.stage, report.level) == (Stage.REPLAYING, "full_iteration"), report.ladder
    assert dict(rows_of(report))["model"] == "skipped" and backend.regions == []


class StageAtStart(pl.Callback):
    """The rollout's stage as each step starts (after the graph callback has begun the step)."""

    stage: Stage | None = None

    def on_train_batch_start(self, trainer, *args) -> None:
        self.stage = graph_callback(trainer).report.stage


@pytest.mark.parametrize("confirm_steps", [2, 2 + MEASURE_STEPS])
def test_confirming_steps_do_not_count_towards_a_levels_time(confirm_steps):
    # A confirming step also runs the parity checks' eager forwards (and the first replays upload the graphs): on a
    # GPU it is slower than the level's steady state; here it takes far longer, and must not move the level's time.
    # With more confirming steps than a level times, a level's median would be a confirming step's time.
    probe = StageAtStart()
    clock = timed_by_level({**LEVEL_MS, "model": NOT_FASTER})
    backend = FakeBackend(step_ms=lambda b: 100.0 if probe.stage == Stage.CONFIRMING else clock(b))
    callback = auto_callback(backend, confirm_steps=confirm_steps)
    fit(*decoder(TINY), STEPS + 5 * confirm_steps, [callback, probe], **CPU)

    report = callback.report
    assert [report.ladder[i].step_ms for i in (3, 2)] == [NOT_FASTER, LEVEL_MS["layer"]]
    assert report.level == "layer"
    # Each timed level spent its confirming steps (its capture step the first of them), then the steps it timed.
    timed_levels = [row for row in report.ladder if row.status in ("kept", "slower")]
    assert [row.level for row in timed_levels] == ["layer", "model"]
    assert all(row.steps >= confirm_steps + MEASURE_STEPS for row in timed_levels), report.ladder


class StagesAtEnd(pl.Callback):
    """The rollout's stage after every training step."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.stages.append(graph_callback(trainer).report.stage)


@pytest.mark.parametrize("short", [True, False])
def test_a_short_fit_captures_right_after_warmup_and_a_long_one_times_eager_steps_first(short):
    # A fit with no room for the eager reference steps and the first level's confirmation and timing captures after
    # its warmup steps (their median is the eager baseline): a short fit still trains on graphs.
    steps = WARMUP + REFERENCE_STEPS if short else STEPS
    probe, callback = StagesAtEnd(), auto_callback(timed())
    fit(*decoder(TINY), steps, [callback, probe], **CPU)

    eager = WARMUP if short else WARMUP + REFERENCE_STEPS
    assert probe.stages[:eager] == [Stage.WARMUP] * eager
    assert probe.stages[eager] != Stage.WARMUP, "the first capture comes right after the eager steps"
    assert callback.report.stage == Stage.REPLAYING and callback.report.captures >= 1, callback.report.reason
    assert callback.report.eager_step_ms > 0


class SettledAt(pl.Callback):
    """The number of training steps that ran before ``scope="auto"`` settled (``None`` while it has not)."""

    settled_at: int | None = None

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.settled_at is None and graph_callback(trainer).rollout.climb.ladder.settled:
            self.settled_at = trainer.global_step


@pytest.mark.parametrize("through", ["strategy", "callback"])
def test_a_fit_settles_on_its_first_level_within_the_steps_that_level_needs(through):
    # The widest level, far faster than eager training: its warmup steps (and a scoped level's eager reference steps,
    # as its warmup steps record every call), its confirming steps and one window of timed steps; nothing more.
    backend, probe = timed(), SettledAt()
    if through == "strategy":
        strategy = auto_strategy(backend)
        config, reference = strategy.cudagraph_config, 0
        run = fit(*decoder(TINY), STEPS, [probe], strategy=strategy, **CPU)
    else:
        callback = auto_callback(backend)
        config, reference = callback.config, REFERENCE_STEPS
        run = fit(*decoder(TINY), STEPS, [callback, probe], **CPU)

    report = graph_callback(run.trainer).report
    first = "full_iteration" if through == "strategy" else "model"
    assert (report.stage, report.level) == (Stage.REPLAYING, first), report.ladder
    needed = config.warmup_steps + reference + config.confirm_steps + MEASURE_STEPS
    assert probe.settled_at is not None and probe.settled_at <= needed, (probe.settled_at, needed)
    assert report.eager_step_ms == LEVEL_MS["eager"]


def level_of_last_capture(backend: FakeBackend) -> str:
    last = backend.regions[-1].name
    if last == "model":
        return "model"
    return "layer" if re.fullmatch(r"model\.blocks\.\d+", last) else "attn+mlp" if last.endswith(".mlp") else "attn"


def test_when_the_widest_level_fails_the_walk_goes_down_to_the_next_narrower_one():
    backend = timed()
    backend.fail_step = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    with pytest.warns(UserWarning, match="level 'full_iteration' of scope='auto' failed .*tries 'model' next"):
        run = fit(*decoder(TINY), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "failed"),
    ]
    assert report.ladder[2].reason == HOLDS_ITS_WORK.format("model")
    assert report.eager_step_ms == LEVEL_MS["eager"], "the whole step's warmup steps gave the eager baseline"
    assert report.ladder[-1].reason.startswith("capture_failed: RuntimeError: Cannot copy")
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "model", 0)
    assert level_of_last_capture(backend) == "model"
    assert all(optimizer.restored for optimizer in backend.optimizers)


def test_a_settled_whole_step_that_steps_down_times_the_level_below_it_instead_of_assuming_it():
    # The walk settled on the whole step at once, so the model level was never timed. When an epoch changes the
    # step's Python, the whole step steps down to it: it is tried and timed, does not pay, and layers are kept instead.
    from tests.test_step_python import Flagged, FlipFlagAtEpochFour

    steps = 8 * TINY_DATA["train_samples"] // TINY_DATA["batch_size"]  # eight epochs: the flip comes at the fifth
    with pytest.warns(UserWarning, match="whole step of scope='auto' can no longer hold .* goes down to 'model'"):
        run = fit(
            *decoder(TINY, Flagged, **TINY_DATA),
            steps,
            [FlipFlagAtEpochFour()],
            strategy=auto_strategy(timed(model=NOT_FASTER)),
            **CPU,
        )

    report = graph_callback(run.trainer).report
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "skipped"),
        ("layer", "kept"),
        ("model", "slower"),
        ("full_iteration", "failed"),
    ]
    assert report.ladder[-1].reason.startswith("step_python"), report.ladder[-1].reason
    assert report.ladder[3].step_ms == NOT_FASTER, "timed after the step down, not taken as kept"
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "layer", 0)


def test_no_level_faster_than_eager_turns_graphs_off_and_training_goes_on():
    backend = timed(attn=9.9, model=9.6, **{"attn+mlp": 9.8, "layer": 9.7})
    eager = fit(*decoder(TINY), STEPS, **CPU)
    callback = auto_callback(backend)
    with pytest.warns(UserWarning, match="not_faster"):
        run = fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert (report.stage, report.reason, report.level) == (Stage.DISABLED, "not_faster", None)
    assert [row.status for row in report.ladder[:4]] == ["slower"] * 4
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0


def test_a_level_over_the_memory_budget_hands_over_to_the_next_narrower_one():
    # A MiB per region: attn 2, attn+mlp 4, layer 2, model 1. The model and layer levels do not pay.
    backend = timed(layer=NOT_FASTER, model=NOT_FASTER)
    callback = auto_callback(backend, max_pool_mib=3)
    with pytest.warns(UserWarning, match="level 'attn\\+mlp' of scope='auto' failed .*tries 'attn' next"):
        fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert rows_of(report)[:4] == [("attn", "kept"), ("attn+mlp", "failed"), ("layer", "slower"), ("model", "slower")]
    assert report.ladder[1].reason.startswith("memory_budget")
    assert (report.stage, report.level) == (Stage.REPLAYING, "attn")
    assert level_of_last_capture(backend) == "attn"


# ---------------------------------------------------------------------------------------------- narrowing
def test_a_layer_that_cannot_be_captured_gives_way_to_its_dense_parts():
    # As Hugging Face MoE experts do: their capture fails, so every layer holding them does too.
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    layers = [f"model.blocks.{i}" for i in range(TINY["n_layer"])]
    backend = timed(layer=3.0)
    backend.fail_regions = dict.fromkeys(layers, error)
    eager = fit(*decoder(TINY, MoEDecoderModule), STEPS, **CPU)
    callback = auto_callback(backend)
    run = fit(*decoder(TINY, MoEDecoderModule), STEPS, [callback], **CPU)

    report = callback.report
    assert set(report.exclusions) == {*layers, "model"}, "the model level failed first: the experts read the host"
    assert "a host sync" in report.exclusions["model"]
    assert all("its parts are captured instead" in report.exclusions[layer] for layer in layers)
    assert all("Cannot copy" in report.exclusions[layer] for layer in layers)
    assert report.rollbacks == 0 and report.stage == Stage.REPLAYING
    parts = {f"{layer}.{part}" for layer in layers for part in ("attn", "moe.router")}
    assert parts <= {region.name for region in backend.regions}, "the parts were captured in place of the layers"
    assert rows_of(report)[:4] == [("attn", "skipped"), ("attn+mlp", "skipped"), ("layer", "kept"), ("model", "failed")]
    assert report.ladder[2].step_ms == LEVEL_MS["attn+mlp"], "the layer level runs its layers' dense parts"
    first_layer_pass = len(backend.warmup_iters_per_pass) - 1 - TINY["n_layer"]
    assert backend.warmup_iters_per_pass[first_layer_pass:] == [0] * (1 + TINY["n_layer"]), (
        "no pass warms up: every region ran eagerly on the capture stream in the steps before, and a pass after a"
        " failure runs only what the failed pass ran"
    )
    assert report.level == "layer"
    assert_losses_close(eager.losses, run.losses, 1e-5)


def test_a_level_that_narrows_to_the_regions_of_one_timed_before_is_not_timed_again():
    # Through the strategy the whole step fails first (the experts' host copy), then the model level; layer, every
    # layer narrowed to its dense parts, is timed and does not pay; attn+mlp would capture the same regions.
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    backend = timed(**{"attn+mlp": NOT_FASTER})
    backend.fail_step = error
    backend.fail_regions = dict.fromkeys([f"model.blocks.{i}" for i in range(TINY["n_layer"])], error)
    with pytest.warns(UserWarning, match="level 'full_iteration' of scope='auto' failed"):
        run = fit(*decoder(TINY, MoEDecoderModule), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert rows_of(report) == [
        ("attn", "kept"),
        ("attn+mlp", "skipped"),
        ("layer", "slower"),
        ("model", "failed"),
        ("full_iteration", "failed"),
    ]
    assert report.ladder[1].reason == "after narrowing, the same regions as 'layer'"
    assert report.ladder[1].step_ms != report.ladder[1].step_ms, "not timed again"
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "attn", 0)


def test_a_region_that_fails_capture_stays_eager_and_the_others_keep_their_graphs():
    backend = FakeBackend(fail_regions={"model.blocks.0": RuntimeError("a host sync")})
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = backend
    with pytest.warns(UserWarning, match="model.blocks.0 stays eager, the other regions keep their graphs"):
        fit(*decoder(TINY), 8, [callback], **CPU)

    report = callback.report
    assert list(report.exclusions) == ["model.blocks.0"]
    assert (report.stage, report.rollbacks, report.graphs) == (Stage.REPLAYING, 0, 0)
    assert [region.name for region in backend.regions] == ["model.blocks.1"], "captured again, without block 0"
    assert backend.regions[0].replays > 0 and backend.pools == 2, "into a new pool"


def test_a_fixed_scope_under_on_failure_raise_raises_on_the_first_region_that_fails():
    backend = FakeBackend(fail_regions={"model.blocks.1": RuntimeError("a host sync")})
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP, on_failure="raise")
    callback.capture_backend = backend
    with pytest.raises(RuntimeError, match=re.escape("model.blocks.1: capture_failed: RuntimeError: a host sync")):
        fit(*decoder(TINY), 8, [callback], **CPU)
    assert backend.live_graphs == 0


# ---------------------------------------------------------------------------------------------- the walk, unit
def _four_levels() -> tuple[Ladder, CUDAGraphReport]:
    report = CUDAGraphReport()
    names = ("attn", "attn+mlp", "layer", "full_iteration")
    ladder = Ladder([Level(name) for name in names], report)
    ladder.eager_ms = 10.0
    return ladder, report


def test_the_walk_tries_the_widest_level_first_then_each_narrower_one_until_one_pays():
    ladder, report = _four_levels()
    assert [level.name for level in ladder.to_try] == ["full_iteration", "layer", "attn+mlp", "attn"]
    assert ladder.current is not None and ladder.current.name == "full_iteration"
    assert ladder.measured(9.8).name == "layer", "not faster than eager training by the margin: narrow by one"
    assert ladder.failed("capture_failed: a host sync").name == "attn+mlp", "a failure hands over to the next one"
    assert ladder.measured(6.0) is None, "kept: stay"
    assert ladder.settled and report.level == "attn+mlp"
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("attn+mlp", "kept"),
        ("layer", "failed"),
        ("full_iteration", "slower"),
    ]
    assert report.ladder[0].reason == HOLDS_ITS_WORK.format("attn+mlp")


def test_each_level_failing_hands_over_to_the_next_narrower_one_and_the_last_to_eager():
    ladder, report = _four_levels()
    assert ladder.failed("capture_failed").name == "layer"
    assert not ladder.settled
    assert ladder.failed("capture_failed").name == "attn+mlp"
    assert ladder.failed("shape_unstable").name == "attn"
    assert ladder.failed("parity") is EAGER
    assert ladder.settled and report.level is None
    assert [row.status for row in report.ladder] == ["failed"] * 4


def test_the_widest_level_kept_ends_the_walk_whatever_the_narrower_ones_would_time():
    ladder, report = _four_levels()
    assert ladder.measured(10.0 * (1 - MARGIN) * 0.99) is None, "faster than eager by the margin: settled at once"
    assert ladder.settled and report.level == "full_iteration"
    assert [row.status for row in report.ladder] == ["skipped", "skipped", "skipped", "kept"]
    assert all(row.reason == HOLDS_ITS_WORK.format("full_iteration") for row in report.ladder[:3])


def _settled_on_the_whole_step() -> tuple[Ladder, CUDAGraphReport]:
    report = CUDAGraphReport()
    ladder = Ladder([Level(name) for name in ("attn", "layer", "model", "full_iteration")], report)
    ladder.eager_ms = 10.0
    assert ladder.measured(2.0) is None and ladder.settled
    return ladder, report


def test_a_settled_whole_step_that_steps_down_tries_and_times_the_widest_level_below_it():
    ladder, report = _settled_on_the_whole_step()
    level = ladder.step_down("step_python: training_step changed at an epoch")
    assert level is not None and level.name == "model"
    assert not ladder.settled, "never timed: the walk goes on from it"
    assert (ladder.row.level, ladder.row.status, ladder.row.reason) == ("model", "planned", None)
    assert ladder.best_ms != ladder.best_ms and report.level is None, "the whole step's time no longer counts"
    assert ladder.measured(3.0) is None and ladder.settled and report.level == "model"
    assert rows_of(report) == [
        ("attn", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "failed"),
    ]
    assert report.ladder[1].reason == HOLDS_ITS_WORK.format("model")


def test_a_level_stepped_down_to_that_does_not_pay_hands_over_to_the_narrower_ones():
    ladder, report = _settled_on_the_whole_step()
    assert ladder.step_down("skipped_step: a batch skipped at capture").name == "model"
    assert ladder.measured(9.9).name == "layer", "not faster than eager training: not assumed to be"
    assert ladder.failed("capture_failed").name == "attn"
    assert ladder.measured(9.9) is EAGER
    assert [row.status for row in report.ladder] == ["slower", "failed", "slower", "failed"]


def test_only_a_median_far_slower_than_the_bar_is_timed_over_a_second_window():
    ladder, _ = _four_levels()
    bar = 10.0 * (1 - MARGIN)
    assert ladder.far_slower(bar * FAR), "a slow stretch may have made it look slow: time it again"
    assert not ladder.far_slower(bar * FAR * 0.99)
    assert not ladder.far_slower(bar / FAR / 2), "far faster: decided at once"


def test_a_median_near_the_bar_is_timed_longer_when_its_steps_are_noisy_and_a_clear_one_is_not():
    ladder = Ladder([Level("attn"), Level("layer")], CUDAGraphReport())
    ladder.eager_ms = 20.0
    ladder.measured(10.0)  # layer is kept: the bar is its time, less the margin
    bar = 10.0 * (1 - MARGIN)
    assert ladder.close_call(bar * 1.01), "within the margin of the bar"
    assert not ladder.close_call(bar * 0.8, spread=1.3), "clear of the bar by more than the noise"
    noisy = bar * 0.9
    assert not ladder.close_call(noisy, spread=1.05)
    assert ladder.close_call(noisy, spread=1.3), "half the spread of noisy steps reaches the bar"


def test_a_seal_before_the_ladder_settles_carries_to_every_level_and_admits_the_shapes_captured_before():
    sizes = [4, 3] * (STEPS // 2 + 1) + [2]  # two shapes through the whole climb, then a third one
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(TINY["vocab_size"], (4, TINY["seq_len"] + 1), generator=generator)
    data = DataLoader([(tokens[:n, :-1], tokens[:n, 1:]) for n in sizes], batch_size=None)
    backend = timed()
    strategy = auto_strategy(backend, on_shape_change="recapture", seal_after_steps=WARMUP + REFERENCE_STEPS + 6)
    run = trainer(len(sizes), strategy=strategy, **CPU)
    with pytest.raises(RuntimeError, match=r"batch shape \[int64\[2, 16\].*is sealed"):
        run.fit(decoder(TINY)[0], data)

    report = graph_callback(run).report
    assert report.level == "full_iteration" and report.rollbacks == 0, report.ladder
    replayed = [graph for graph in backend.step_graphs if graph.replays > 0]
    assert len(replayed) >= 2, "both shapes sealed at an earlier level were captured again as whole steps"


# ---------------------------------------------------------------------------------------------- a fixed scope
def test_a_fixed_scope_runs_through_the_same_runner_as_a_one_level_ladder_with_no_rows():
    backend = timed()
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
    callback.capture_backend = backend
    eager = fit(*decoder(TINY), STEPS, **CPU)
    run = fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert (report.stage, report.level, report.ladder, report.rollbacks) == (Stage.REPLAYING, None, [], 0)
    assert (report.eager_step_ms, report.step_ms) == (LEVEL_MS["eager"], LEVEL_MS["layer"]), "timed as before"
    assert report.speedup == LEVEL_MS["eager"] / LEVEL_MS["layer"]
    assert "cudagraph/level" not in report.metrics(), "a fixed scope logs no level"
    assert backend.pools == 1, "one level: captured once, never moved"
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0


def test_a_fixed_whole_step_that_fails_has_no_other_level_to_go_to_and_rolls_back():
    backend = FakeBackend(fail_capture=RuntimeError("a host sync"))
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
    strategy.capture_backend = backend
    with pytest.warns(UserWarning, match="rolled back to eager training: capture_failed"):
        run = fit(*decoder(TINY), 8, strategy=strategy, **CPU)

    report = graph_callback(run.trainer).report
    assert (report.stage, report.rollbacks, report.level, report.ladder) == (Stage.DISABLED, 1, None, [])
    assert report.reason.startswith("rollback: capture_failed: RuntimeError: a host sync")
    assert backend.pools == 1 and backend.live_graphs == 0
    assert all(optimizer.restored for optimizer in backend.optimizers)


def test_a_one_level_ladder_is_settled_from_the_start_and_writes_no_rows():
    report = CUDAGraphReport()
    ladder = Ladder([Level("layer")], report, climbs=False)
    assert ladder.settled and ladder.current is not None and ladder.current.name == "layer"
    assert report.ladder == [] and report.level is None


class _Cache:
    """Like transformers' ``DynamicCache`` under ``use_cache=True``: a new object per forward, handed to attention."""

    def __init__(self) -> None:
        self.layers: list[None] = []

    def __repr__(self) -> str:
        return f"Cache(layers={len(self.layers)})"


class _CachedNet(Decoder):
    def forward(self, idx: torch.Tensor, cache: _Cache) -> torch.Tensor:  # type: ignore[override]
        cache.layers.append(None)
        return super().forward(idx)


class _CachedDecoder(DecoderModule):
    """The network takes a cache object made anew by every forward, as GPT-2 does by default (``use_cache=True``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model.__class__ = _CachedNet  # the same modules and parameters: it trains as DecoderModule does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, _Cache())


def test_a_level_whose_shapes_never_settle_hands_over_to_the_next_narrower_one():
    eager = fit(*decoder(TINY, _CachedDecoder), STEPS, **CPU)
    callback = auto_callback(timed())
    run = fit(*decoder(TINY, _CachedDecoder), STEPS, [callback], **CPU)
    report = callback.report
    rows = dict(rows_of(report))
    assert rows["model"] == "failed" and "shape_unstable" in report.ladder[3].reason, report.ladder
    assert (report.stage, report.level, rows["attn"]) == (Stage.REPLAYING, "layer", "skipped"), report.ladder
    assert_losses_close(eager.losses, run.losses, 1e-5)


def test_a_level_taken_out_after_the_walk_moved_on_leaves_training_on_its_level():
    """The step's Python can rule the whole step out once training is on a narrower level (a guard, a re-check)."""
    ladder, report = _four_levels()
    assert ladder.measured(9.8).name == "layer"
    ladder.skip("full_iteration", "step_python: temperature changed from 1.0 to 2.0")
    assert ladder.current is not None and ladder.current.name == "layer"
    assert ladder.measured(6.0) is None and ladder.settled and report.level == "layer"

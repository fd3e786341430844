"""``scope="auto"`` 's ladder on a CPU: levels found per layout, the climb's decisions, narrowing, the memory budget.

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
from tests.models import TINY, DecoderModule, MoEDecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}
WARMUP = 2
#: Steps the climb spends per scoped level: capture and parity checks, the rest of confirmation, then the timed ones.
STEPS_PER_LEVEL = 2 + MEASURE_STEPS
#: Enough for the eager reference, every level timed as long as a close call takes, and the steady-state check.
STEPS = WARMUP + REFERENCE_STEPS + 5 * (1 + MAX_MEASURE_STEPS) + CHECK_STEPS + 4
#: The ``model`` level's time when a test is about the levels below it: not faster than ``attn`` by the margin.
NOT_FASTER = LEVEL_MS["attn"] * (1 - MARGIN / 2)


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


def ladder(report) -> list[tuple[str, str]]:
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


# ---------------------------------------------------------------------------------------------- the climb
def test_the_callback_climbs_from_attention_to_whole_layers_and_skips_the_level_between(tmp_path):
    backend = timed(model=NOT_FASTER)
    eager = fit(*decoder(TINY), STEPS, **CPU)
    callback = auto_callback(backend)
    run = fit(*decoder(TINY), STEPS, [callback], logger=CSVLogger(tmp_path), log_every_n_steps=1, **CPU)

    report = callback.report
    assert ladder(report) == [
        ("attn", "slower"),
        ("attn+mlp", "skipped"),
        ("layer", "kept"),
        ("model", "slower"),
        ("full_iteration", "skipped"),
    ]
    assert report.ladder[1].reason == "'layer' was confirmed faster and holds its work"
    assert report.ladder[1].steps == 0 and report.ladder[1].capture_ms == 0, "the level between was never tried"
    assert "Trainer(strategy='cudagraph')" in report.ladder[-1].reason
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "layer", 0)
    assert [report.ladder[i].step_ms for i in (0, 2)] == [LEVEL_MS["attn"], LEVEL_MS["layer"]]
    assert all(report.ladder[i].steps >= STEPS_PER_LEVEL for i in (0, 2))
    assert report.capture_ms_total >= sum(row.capture_ms for row in report.ladder) > 0
    assert backend.pools == 3, "each level tried captures into a pool of its own"
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0
    with open(f"{run.trainer.logger.log_dir}/metrics.csv") as handle:
        levels = [float(row["cudagraph/level"]) for row in csv.DictReader(handle) if row.get("cudagraph/level")]
    assert levels[0] == 1.0 and levels[-1] == 3.0 and 3.5 in levels, "cudagraph/level follows the climb"


def test_the_callback_climbs_from_attention_to_the_models_submodules_with_the_loss_and_optimizer_eager():
    backend = timed()
    eager = fit(*decoder(TINY), STEPS, **CPU)
    callback = auto_callback(backend)
    run = fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert ladder(report) == [
        ("attn", "slower"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "skipped"),
    ]
    assert report.ladder[2].reason == "'model' was confirmed faster and holds its work"
    assert (report.stage, report.level, report.scopes["model"]) == (Stage.REPLAYING, "model", ["model"])
    assert [region.name for region in backend.regions if region.replays > 0][-1:] == ["model"]
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert max_param_diff(parameters_of(eager.model), parameters_of(run.model)) < 1e-5
    assert patched_forwards(run.model) == [] and backend.live_graphs == 0


def test_through_the_strategy_the_climb_goes_from_attention_to_the_whole_step():
    backend = timed()
    eager = fit(*decoder(TINY), STEPS, **CPU)
    run = fit(*decoder(TINY), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert ladder(report) == [
        ("attn", "slower"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "skipped"),
        ("full_iteration", "kept"),
    ]
    assert backend.pools == 2, "two levels tried: attention, then the whole step"
    assert (report.stage, report.level) == (Stage.REPLAYING, "full_iteration")
    assert backend.step_graphs and backend.step_graphs[-1].replays > 0
    assert_losses_close(eager.losses, run.losses, 1e-5)
    assert all(optimizer.restored for optimizer in backend.optimizers)


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
    assert [report.ladder[i].step_ms for i in (0, 2)] == [LEVEL_MS["attn"], LEVEL_MS["layer"]]
    assert report.level == "layer"
    # Each timed level spent its capture step, its confirming steps, then the steps it timed.
    timed_levels = [row for row in report.ladder if row.status in ("kept", "slower")]
    assert all(row.steps >= 1 + confirm_steps + MEASURE_STEPS for row in timed_levels), report.ladder


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


def test_wider_levels_within_the_margin_are_not_kept_and_training_goes_back_to_the_best():
    close = LEVEL_MS["attn"] * (1 - MARGIN / 2)  # faster than attn, but by less than the margin
    backend = timed(layer=close, model=close, **{"attn+mlp": close})
    callback = auto_callback(backend)
    fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert ladder(report)[:4] == [("attn", "kept"), ("attn+mlp", "slower"), ("layer", "slower"), ("model", "slower")]
    assert (report.stage, report.level) == (Stage.REPLAYING, "attn")
    steps = [row.steps for row in report.ladder[:3]]
    clear = WARMUP + REFERENCE_STEPS + 1 + MEASURE_STEPS + 1
    assert steps[0] <= clear, "a clear call is decided on a few steps (warmup and the eager reference counted)"
    assert steps[2] >= 1 + MAX_MEASURE_STEPS, "a call within the margin is timed longer"
    assert level_of_last_capture(backend) == "attn", "the best level is captured again"


def level_of_last_capture(backend: FakeBackend) -> str:
    last = backend.regions[-1].name
    if last == "model":
        return "model"
    return "layer" if re.fullmatch(r"model\.blocks\.\d+", last) else "attn+mlp" if last.endswith(".mlp") else "attn"


def test_when_the_widest_level_fails_the_climb_goes_down_to_the_next_narrower_one():
    backend = timed()
    backend.fail_step = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    with pytest.warns(UserWarning, match="level 'full_iteration' of scope='auto' failed .*tries 'model' next"):
        run = fit(*decoder(TINY), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert ladder(report) == [
        ("attn", "slower"),
        ("attn+mlp", "skipped"),
        ("layer", "skipped"),
        ("model", "kept"),
        ("full_iteration", "failed"),
    ]
    assert report.ladder[-1].reason.startswith("capture_failed: RuntimeError: Cannot copy")
    assert (report.stage, report.level, report.rollbacks) == (Stage.REPLAYING, "model", 0)
    assert level_of_last_capture(backend) == "model"
    assert all(optimizer.restored for optimizer in backend.optimizers)


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


def test_a_level_between_over_the_memory_budget_ends_the_climb_on_the_best_level_before_it():
    backend = timed(layer=7.9, model=7.9)  # a MiB per region: attn 2, attn+mlp 4, layer 2, model 1; none faster
    callback = auto_callback(backend, max_pool_mib=3)
    with pytest.warns(UserWarning, match="level 'attn\\+mlp' of scope='auto' failed .*goes back to 'attn'"):
        fit(*decoder(TINY), STEPS, [callback], **CPU)

    report = callback.report
    assert ladder(report)[:4] == [("attn", "kept"), ("attn+mlp", "failed"), ("layer", "slower"), ("model", "slower")]
    assert report.ladder[1].reason.startswith("memory_budget")
    assert (report.stage, report.level) == (Stage.REPLAYING, "attn")


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
    assert ladder(report)[:4] == [("attn", "slower"), ("attn+mlp", "skipped"), ("layer", "kept"), ("model", "failed")]
    assert report.ladder[2].step_ms == LEVEL_MS["attn+mlp"], "the layer level runs its layers' dense parts"
    first_layer_pass = len(backend.warmup_iters_per_pass) - 1 - TINY["n_layer"]
    assert backend.warmup_iters_per_pass[first_layer_pass:] == [0] * (1 + TINY["n_layer"]), (
        "no pass warms up: every region ran eagerly on the capture stream in the steps before, and a pass after a"
        " failure runs only what the failed pass ran"
    )
    assert report.level == "layer"
    assert_losses_close(eager.losses, run.losses, 1e-5)


def test_a_level_that_narrows_to_the_regions_of_one_timed_before_is_not_timed_again():
    # Through the strategy the whole step fails first (the experts' host copy); layer, every layer narrowed to its
    # dense parts, is timed and does not pay; attn+mlp would capture the same regions.
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    backend = timed(**{"attn+mlp": 7.9})
    backend.fail_step = error
    backend.fail_regions = dict.fromkeys([f"model.blocks.{i}" for i in range(TINY["n_layer"])], error)
    with pytest.warns(UserWarning, match="level 'full_iteration' of scope='auto' failed"):
        run = fit(*decoder(TINY, MoEDecoderModule), STEPS, strategy=auto_strategy(backend), **CPU)

    report = graph_callback(run.trainer).report
    assert ladder(report) == [
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


def test_the_walk_tries_the_narrowest_then_widens_fully_then_narrows_step_by_step():
    ladder, report = _four_levels()
    assert [level.name for level in ladder.to_try] == ["attn", "full_iteration", "layer", "attn+mlp"]
    assert ladder.measured(8.0).name == "full_iteration"
    assert ladder.measured(7.9).name == "layer", "within the margin of attn: narrow by one"
    assert ladder.failed("capture_failed: a host sync").name == "attn+mlp", "a failure hands over to the next one"
    assert ladder.measured(6.0) is None, "the last level, kept: stay"
    assert ladder.settled and report.level == "attn+mlp"
    assert [(row.level, row.status) for row in report.ladder] == [
        ("attn", "slower"),
        ("attn+mlp", "kept"),
        ("layer", "failed"),
        ("full_iteration", "slower"),
    ]


def test_the_first_level_failing_hands_over_to_the_widest_and_the_last_to_eager():
    ladder, report = _four_levels()
    assert ladder.failed("shape_unstable").name == "full_iteration"
    assert not ladder.settled
    assert ladder.failed("capture_failed").name == "layer"
    assert ladder.failed("capture_failed").name == "attn+mlp"
    assert ladder.failed("parity") is EAGER
    assert ladder.settled and report.level is None
    assert [row.status for row in report.ladder] == ["failed"] * 4


def test_the_last_level_failing_goes_back_to_the_best_one():
    ladder, report = _four_levels()
    ladder.measured(8.0)
    ladder.measured(9.0)
    ladder.measured(9.0)
    assert ladder.failed("memory_budget").name == "attn"
    assert report.level == "attn"


def test_a_median_near_the_bar_is_timed_longer_when_its_steps_are_noisy_and_a_clear_one_is_not():
    ladder = Ladder([Level("attn"), Level("layer")], CUDAGraphReport())
    ladder.eager_ms = 20.0
    ladder.measured(10.0)  # attn is kept: layer must beat 10 ms by the margin
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


class _CachedAttention(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.inner = attn

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        cache.layers.append(None)
        return self.inner(x)


class _CachedDecoder(DecoderModule):
    """Attention takes a cache object made anew by every forward, as GPT-2 does with its default ``use_cache=True``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.model.blocks:
            block.attn = _CachedAttention(block.attn)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        net, cache = self.model, _Cache()
        x = net.drop(net.tok_emb(idx) + net.pos_emb(net.positions[: idx.shape[1]]))
        for block in net.blocks:
            x = x + block.attn(block.ln1(x), cache)
            x = x + block.mlp(block.ln2(x))
        return net.head(net.ln_f(x))


def test_a_level_whose_shapes_never_settle_hands_over_and_the_climb_reaches_the_whole_step():
    eager = fit(*decoder(TINY, _CachedDecoder), STEPS, **CPU)
    run = fit(*decoder(TINY, _CachedDecoder), STEPS, strategy=auto_strategy(timed()), **CPU)
    report = graph_callback(run.trainer).report
    rows = dict(ladder(report))
    assert rows["attn"] == "failed" and "shape_unstable" in report.ladder[0].reason, report.ladder
    assert (report.stage, report.level) == (Stage.REPLAYING, "full_iteration"), report.ladder
    assert_losses_close(eager.losses, run.losses, 1e-5)

"""FSDP2 with CUDA graphs on a CPU: every refusal and rule of ``ModelParallelCUDAGraphStrategy``, as a user sees it.

One process is enough: Lightning's ``ModelParallelStrategy`` with ``accelerator="cpu", devices=1`` starts a gloo
group of one rank, and ``fully_shard`` shards each block and the model over it. Each refusal is the package's
``ValueError`` (component, value, allowed values, fix), raised in preflight before any training batch starts; the
accepted fits (``scope="auto"``'s plan, the whole step) run through the fake capture backend
(:mod:`tests.fake_backend`).

Covered: scoped scopes under FSDP2, gradient accumulation, ``compile=``, Lightning's own ``ModelParallelStrategy``,
``FSDPStrategy`` and ``DeepSpeedStrategy`` under the callback, ``scope="auto"``'s plan, the whole step against eager
FSDP2, and the hook rule (FSDP2's own hooks exempt, a user's hook refused). The last two tests check that refusals
under FSDP2 point to fixes FSDP2 accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.tensor import DTensor

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphReport, ModelParallelCUDAGraphStrategy, Stage
from lightning_cudagraph._rollout.sharding import SCOPED_UNDER_FSDP2
from tests.fake_backend import FakeBackend
from tests.helpers import (
    LEVEL_MS,
    LossRecorder,
    StepCounter,
    assert_losses_close,
    graph_callback,
    needs_fsdp2,
    timed_by_level,
    trainer,
)
from tests.models import TINY, TINY_DATA, DecoderModule, ShardedDecoder, decoder

CPU = {"accelerator": "cpu", "devices": 1}
STRATEGY = "ModelParallelCUDAGraphStrategy"
SCOPED_LEVELS = ["attn", "attn+mlp", "layer", "model"]


# =================================================================== models
class HookedBeforeSharding(ShardedDecoder):
    """A user's forward hook on the first block, registered when the model is built (before ``fully_shard``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model.blocks[0].register_forward_hook(lambda module, args, output: None)


class HookedAfterSharding(ShardedDecoder):
    """A user's forward pre-hook on the first block, registered in ``configure_model`` after ``fully_shard``."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.blocks[0].register_forward_pre_hook(lambda module, args: None)


class ManualOptimization(ShardedDecoder):
    """The sharded decoder trained with manual optimization."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


# =================================================================== helpers
def fsdp2(scope: str | Sequence[str] = "auto", **options: Any) -> ModelParallelCUDAGraphStrategy:
    """The FSDP2 strategy with every rank data-parallel, capturing through a fake backend."""
    strategy = ModelParallelCUDAGraphStrategy(scope=scope, tensor_parallel_size=1, **options)
    strategy.capture_backend = FakeBackend()
    return strategy


def eager_fsdp2() -> ModelParallelStrategy:
    """Lightning's own FSDP2 strategy on one process."""
    return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)


def refused_fit(
    strategy: Strategy | str,
    module: type[DecoderModule] = ShardedDecoder,
    callbacks: Sequence[pl.Callback] = (),
    **options: Any,
) -> tuple[str, CUDAGraphReport]:
    """Fit a sharded decoder, expecting the package's ``ValueError`` before any training batch starts.

    Returns the message and the report of the Trainer's graph callback.
    """
    started = StepCounter()
    run = trainer(4, [started, *callbacks], strategy=strategy, **{**CPU, **options})
    with pytest.raises(ValueError) as error:
        run.fit(*decoder(TINY, module, **TINY_DATA))
    assert started.batches == 0, "refused after training had started"
    report = graph_callback(run).report
    assert report.stage == Stage.DISABLED and report.reason.startswith("invalid_configuration: "), report.reason
    return str(error.value), report


def assert_refused(message: str, component: str, *fragments: str) -> None:
    """The package's error format (component, value, allowed values, fix) with each fragment in it."""
    assert message.startswith(f"{component}: `") and ". Allowed: " in message and ". Fix: " in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


def whole_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by name, FSDP2's sharded ones gathered whole, as float32 CPU copies."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
    }


def ladder_of(report: CUDAGraphReport) -> list[tuple[str, str]]:
    return [(row.level, row.status) for row in report.ladder]


# =================================================================== refusals
@pytest.mark.parametrize(
    ("strategy", "callbacks", "component", "shown"),
    [
        pytest.param(lambda: fsdp2(["layer"]), list, STRATEGY, "`scope=['layer']`", id="layer"),
        pytest.param(lambda: fsdp2(["attn", "mlp"]), list, STRATEGY, "`scope=['attn', 'mlp']`", id="attn-mlp"),
        pytest.param(
            lambda: "fsdp2_cudagraph_full",
            lambda: [CUDAGraphCallback(scope=["layer"])],
            "CUDAGraphCallback",
            "`scope=['layer']`",
            id="users-callback-layer",
        ),
    ],
)
def test_scoped_graphs_are_refused_under_fsdp2(strategy, callbacks, component, shown):
    message, _ = refused_fit(strategy(), callbacks=callbacks())
    assert_refused(
        message,
        component,
        shown,
        "Allowed: ['full_iteration'] or 'auto' under FSDP2",
        "scoped graphs are refused under FSDP2",
        "unsharded copy of the parameters",
        "scope=['full_iteration']",
        "strategy='fsdp2_cudagraph_full'",
    )


@needs_fsdp2
@pytest.mark.parametrize("strategy", ["fsdp2_cudagraph_full", "fsdp2_cudagraph"])
def test_gradient_accumulation_is_refused_under_fsdp2_and_the_fix_trains(strategy):
    message, _ = refused_fit(strategy, accumulate_grad_batches=2)
    assert_refused(
        message,
        STRATEGY,
        "`Trainer(accumulate_grad_batches=2)`",
        "Allowed: 1 under FSDP2 with CUDA graphs",
        "set_requires_gradient_sync",
        "pass accumulate_grad_batches=1 with a larger batch",
        "impl='none'",
    )
    # The fix it names: the same fit eagerly (impl='none') accumulates as Lightning's FSDP2 does.
    eager = ModelParallelCUDAGraphStrategy(impl="none", tensor_parallel_size=1)
    run = trainer(2, strategy=eager, accumulate_grad_batches=2, **CPU)
    run.fit(*decoder(TINY, ShardedDecoder, **TINY_DATA))
    assert run.global_step == 2 and graph_callback(run).report.reason == "impl_none"


@pytest.mark.parametrize("scope", ["auto", ["full_iteration"]], ids=str)
@pytest.mark.parametrize("compile_option", [True, {"backend": "eager"}], ids=["inductor", "eager-backend"])
def test_compile_is_refused_under_fsdp2_when_the_strategy_is_built(compile_option, scope):
    # Built, not fitted: the refusal comes before any Trainer, and offers no scope (FSDP2 refuses them all with it).
    with pytest.raises(ValueError) as refusal:
        ModelParallelCUDAGraphStrategy(scope=scope, compile=compile_option, tensor_parallel_size=1)
    message = str(refusal.value)
    assert_refused(message, STRATEGY, "`compile=", "Allowed: compile= on one device", "FSDP2", "drop compile=")
    assert "scope=['layer']" not in message and "cudagraph_full" not in message


@pytest.mark.parametrize("scope", ["auto", ["layer"], ["full_iteration"]], ids=str)
def test_lightnings_own_model_parallel_strategy_with_the_callback_is_refused(scope):
    callback = CUDAGraphCallback(scope=scope)
    callback.capture_backend = FakeBackend()
    message, report = refused_fit(eager_fsdp2(), callbacks=[callback])
    assert report is callback.report
    assert_refused(
        message,
        "CUDAGraphCallback",
        "`Trainer(strategy=ModelParallelStrategy(...))`",
        "Allowed: a single-device, DDP or FSDP2 strategy",
        "parameters move or reshard between steps outside any graph",
        "apply fully_shard in configure_model and pass strategy='fsdp2_cudagraph_full'",
    )


@pytest.mark.parametrize(
    ("strategy", "state", "reason"),
    [
        pytest.param(FSDPStrategy, {}, "parameters move or reshard", id="fsdp1"),
        pytest.param(FSDPStrategy, {"cpu_offload": True}, "CPU offloading moves parameters", id="fsdp1-offload"),
        pytest.param(DeepSpeedStrategy, {}, "parameters move or reshard", id="deepspeed"),
        pytest.param(
            DeepSpeedStrategy,
            {"config": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}},
            "CPU offloading moves parameters",
            id="deepspeed-offload",
        ),
    ],
)
def test_fsdp1_and_deepspeed_are_refused_with_fsdp2_named_as_the_route_for_sharding(strategy, state, reason):
    # Neither builds a CPU fit (Lightning's FSDPStrategy needs a GPU accelerator, DeepSpeed is not installed), so, as
    # in tests/test_refusals.py, the Trainer's strategy is swapped for an unbuilt one: its type is what is checked.
    from lightning_cudagraph._options.config import CUDAGraphConfig
    from lightning_cudagraph._rollout.preflight import check_trainer

    run = pl.Trainer(logger=False, **CPU)
    run.strategy._lightning_module = None
    swapped = object.__new__(strategy)
    swapped.__dict__.update(state)
    run._accelerator_connector.strategy = swapped
    with pytest.raises(ValueError) as error:
        check_trainer(CUDAGraphConfig(), run, DecoderModule(**TINY))
    assert_refused(
        str(error.value),
        "CUDAGraphCallback",
        f"`Trainer(strategy={strategy.__name__}(...))`",
        "FSDP2 strategy",
        reason,
        "apply fully_shard in configure_model and pass strategy='fsdp2_cudagraph_full' (FSDP2, whole step)",
    )


# =================================================================== scope="auto"
@needs_fsdp2
def test_auto_under_fsdp2_skips_every_scoped_level_and_keeps_the_whole_step(caplog):
    steps = 24  # warmup, the eager reference steps, then the whole step captured, confirmed, timed and kept
    run = trainer(steps, strategy="fsdp2_cudagraph", **CPU)
    backend = FakeBackend(step_ms=timed_by_level(LEVEL_MS))
    run.strategy.capture_backend = backend
    with caplog.at_level(logging.INFO):
        run.fit(*decoder(TINY, ShardedDecoder, **TINY_DATA))

    report = graph_callback(run).report
    assert ladder_of(report) == [*((level, "skipped") for level in SCOPED_LEVELS), ("full_iteration", "kept")]
    for row in report.ladder[:-1]:
        assert row.reason == SCOPED_UNDER_FSDP2 and row.reason.startswith("scoped graphs are refused under FSDP2"), row
        assert row.steps == 0 and row.capture_ms == 0, row
    assert (report.stage, report.level) == (Stage.REPLAYING, "full_iteration")
    assert report.replays > 0 and report.rollbacks == 0
    assert backend.regions == [], "no scoped region may be captured under FSDP2"

    plan = [r.getMessage() for r in caplog.records if "scope='auto' will try" in r.getMessage()]
    assert len(plan) == 1, [r.getMessage() for r in caplog.records]
    for level in SCOPED_LEVELS:
        assert f"{level}: skipped (scoped graphs are refused under FSDP2" in plan[0], plan[0]
    assert plan[0].endswith("full_iteration: planned"), plan[0]


# =================================================================== the whole step
@needs_fsdp2
def test_fsdp2_whole_step_replays_and_trains_as_lightnings_fsdp2():
    steps = 10
    eager_losses = LossRecorder()
    eager_model, data = decoder(TINY, ShardedDecoder, **TINY_DATA)
    trainer(steps, [eager_losses], strategy=eager_fsdp2(), **CPU).fit(eager_model, data)

    losses = LossRecorder()
    run = trainer(steps, [losses], strategy="fsdp2_cudagraph_full", **CPU)
    backend = FakeBackend()
    run.strategy.capture_backend = backend
    model, data = decoder(TINY, ShardedDecoder, **TINY_DATA)
    run.fit(model, data)

    report = graph_callback(run).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.replays > 0 and report.steps_replayed > 0 and report.rollbacks == 0
    assert backend.step_graphs and backend.step_graphs[-1].replays > 0
    assert isinstance(model.model.blocks[0].attn.qkv.weight, DTensor), "the model was not sharded"
    assert_losses_close(eager_losses.losses, losses.losses, 1e-5)
    eager, graphed = whole_parameters(eager_model), whole_parameters(model)
    assert max(float((eager[name] - graphed[name]).abs().max()) for name in eager) < 1e-5


# =================================================================== hooks
@needs_fsdp2
def test_fsdp2s_own_hooks_do_not_refuse_the_whole_step():
    run = trainer(6, strategy=fsdp2(["full_iteration"], warmup_steps=2), **CPU)
    model, data = decoder(TINY, ShardedDecoder, **TINY_DATA)
    run.fit(model, data)
    hooked = [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    assert {"", "model.blocks.0", "model.blocks.1"} <= set(hooked), f"FSDP2 registered no hooks on {hooked}"
    report = graph_callback(run).report
    assert report.stage == Stage.REPLAYING and report.replays > 0, report.reason


@pytest.mark.parametrize("module", [HookedBeforeSharding, HookedAfterSharding], ids=lambda m: m.__name__)
def test_a_users_hook_on_a_sharded_block_is_refused_under_the_fsdp2_whole_step(module):
    message, _ = refused_fit(fsdp2(["full_iteration"]), module)
    assert_refused(
        message,
        STRATEGY,
        "`scope=['full_iteration']`",
        "Allowed: full_iteration on modules without forward or backward hooks",
        "Fix: model.blocks.0 carry hooks,",  # the user's hook alone: FSDP2's on the model and block 1 are not named
        "run once at capture and never again",
        "hook.remove()",
    )


# =================================================================== fixes that FSDP2 accepts
def _hook_refusal() -> str:
    return refused_fit(fsdp2(["full_iteration"]), HookedBeforeSharding)[0]


def _manual_optimization_refusal() -> str:
    return refused_fit(fsdp2(["full_iteration"]), ManualOptimization)[0]


def _compile_under_auto_refusal() -> str:
    with pytest.raises(ValueError) as error:
        ModelParallelCUDAGraphStrategy(compile=True, tensor_parallel_size=1)
    return str(error.value)


@pytest.mark.parametrize(
    "refusal",
    [_hook_refusal, _manual_optimization_refusal, _compile_under_auto_refusal],
    ids=["users-hook", "manual-optimization", "compile-under-auto"],
)
def test_a_refusal_under_fsdp2_does_not_send_the_user_to_a_scoped_capture(refusal):
    message = refusal()
    assert message.startswith(f"{STRATEGY}: `"), message
    # Following this advice under the same strategy only meets the next refusal (scoped graphs under FSDP2).
    assert "scope=['layer']" not in message and "scoped capture" not in message, message


@needs_fsdp2
def test_auto_under_fsdp2_with_the_whole_step_ruled_out_says_why_graphs_are_off():
    run = trainer(4, strategy="fsdp2_cudagraph", **CPU)
    run.strategy.capture_backend = FakeBackend()
    with pytest.warns(UserWarning, match=r"CUDA graphs off \(no_targets\)") as caught:
        run.fit(*decoder(TINY, HookedBeforeSharding, **TINY_DATA))
    report = graph_callback(run).report
    assert (report.stage, report.reason) == (Stage.DISABLED, "no_targets")
    assert ladder_of(report) == [(level, "skipped") for level in [*SCOPED_LEVELS, "full_iteration"]]
    warning = next(str(w.message) for w in caught if "no_targets" in str(w.message))
    assert "model.blocks.0 carry hooks" in warning and "refused under FSDP2" in warning, warning
    # The model has attention, MLP and layer modules: they were found, and skipped because of FSDP2.
    assert "found no attention, MLP or layer modules" not in warning, warning

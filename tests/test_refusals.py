"""Combinations that cannot work are refused before any GPU work, with the package's error format."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from tests.fake_backend import FakeBackend
from tests.helpers import graph_callback, trainer
from tests.models import TINY, DecoderModule, decoder

CPU = {"accelerator": "cpu", "devices": 1}


def assert_refused(error: pytest.ExceptionInfo, component: str, *fragments: str) -> None:
    message = str(error.value)
    assert message.startswith(f"{component}:") and "Allowed:" in message and "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, message


class _WithOptimizer(DecoderModule):
    def __init__(self, build, **kwargs):
        super().__init__(**kwargs)
        self.build = build

    def configure_optimizers(self):
        return self.build(self.parameters())


@pytest.mark.parametrize(
    ("build", "fragments"),
    [
        pytest.param(lambda p: torch.optim.LBFGS(p), ["optimizer='LBFGS'", "fused=True"], id="lbfgs"),
        pytest.param(lambda p: torch.optim.Adam(p, differentiable=True), ["differentiable=True"], id="differentiable"),
    ],
)
def test_full_iteration_refuses_optimizers_it_cannot_capture_even_without_cuda(build, fragments):
    model, data = decoder(TINY)
    model = _WithOptimizer(build, **dict(model.hparams))
    run = trainer(4, strategy="cudagraph_full", **CPU)
    with pytest.raises(ValueError, match="CUDAGraphStrategy") as error:
        run.fit(model, data)
    assert_refused(error, "CUDAGraphStrategy", *fragments)
    report = graph_callback(run).report
    assert report.stage == Stage.DISABLED and report.reason.startswith("invalid_configuration: CUDAGraphStrategy")


def test_a_refusal_at_setup_leaves_the_report_saying_so():
    callback = CUDAGraphCallback(scope=["moe"])
    with pytest.raises(ValueError, match="matches no module"):
        trainer(4, [callback], **CPU).fit(*decoder(TINY))
    assert callback.report.stage == Stage.DISABLED
    assert callback.report.reason.startswith("invalid_configuration: CUDAGraphCallback: scope 'moe'")


def test_two_different_callbacks_on_one_trainer_are_refused():
    callbacks = [CUDAGraphCallback(scope=["attn"]), CUDAGraphCallback(scope=["mlp"])]
    with pytest.raises(ValueError, match="2 CUDAGraphCallbacks") as error:
        trainer(4, callbacks, **CPU).fit(*decoder(TINY))
    assert_refused(error, "CUDAGraphCallback", "one CUDAGraphCallback per Trainer", "scope=['attn', 'mlp']")


def test_a_modules_override_under_auto_must_take_effect():
    callback = CUDAGraphCallback(modules={"attn": "nowhere.*"})
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY))
    assert "scope 'attn' matches no module" in str(error.value), str(error.value)


def test_modules_overrides_and_custom_scopes_under_auto_shape_every_level():
    callback = CUDAGraphCallback(modules={"attn": "model.blocks.0.attn", "head": "model.head"})
    callback.capture_backend = FakeBackend()
    trainer(6, [callback], **CPU).fit(*decoder(TINY))
    scopes = callback.report.scopes
    assert scopes["attn"] == ["model.blocks.0.attn", "model.head"]
    assert scopes["attn+mlp"] == ["model.blocks.0.attn", "model.blocks.0.mlp", "model.blocks.1.mlp", "model.head"]
    assert scopes["layer"] == ["model.blocks.0", "model.blocks.1", "model.head"]
    assert callback.report.captures >= 1 and callback.report.rollbacks == 0
    assert callback.report.stage != Stage.DISABLED, callback.report.reason


@pytest.mark.parametrize("options", [{"callbacks": [CUDAGraphCallback(scope=["layer"])]}, {"strategy": "cudagraph"}])
def test_anomaly_detection_is_refused_with_graphs(options):
    with pytest.raises(ValueError, match="detect_anomaly") as error:
        trainer(4, detect_anomaly=True, **options, **CPU).fit(*decoder(TINY))
    assert "impl='none'" in str(error.value)


@pytest.mark.parametrize("strategy", [FSDPStrategy, DeepSpeedStrategy])
def test_strategies_that_move_parameters_between_steps_are_refused(strategy):
    from lightning_cudagraph._options.config import CUDAGraphConfig
    from lightning_cudagraph._rollout.preflight import check_trainer

    run = pl.Trainer(logger=False, **CPU)
    run.strategy._lightning_module = None
    run._accelerator_connector.strategy = object.__new__(strategy)  # the type is what is checked, not a live one
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        check_trainer(CUDAGraphConfig(), run, DecoderModule(**TINY))
    assert_refused(error, "CUDAGraphCallback", type(run.strategy).__name__, "use DDP")


def test_a_single_device_strategy_with_a_fake_backend_still_refuses_full_iteration_hooks():
    strategy = CUDAGraphStrategy(scope=["full_iteration"])
    strategy.capture_backend = FakeBackend()
    model, data = decoder(TINY)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(ValueError, match="global module hooks"):
            trainer(4, strategy=strategy, **CPU).fit(model, data)
    finally:
        handle.remove()


@pytest.mark.parametrize("strategy", ["cudagraph_layer", "cudagraph"])
def test_a_single_device_strategy_on_several_devices_is_refused_with_the_ddp_strategy_named(strategy):
    with pytest.raises(ValueError, match="CUDAGraphStrategy") as error:
        trainer(4, strategy=strategy, accelerator="cpu", devices=2).fit(*decoder(TINY))
    assert_refused(error, "CUDAGraphStrategy", "`Trainer(devices=2)`", "ddp_cudagraph")

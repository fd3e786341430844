"""Inputs that were silent or obscure: each refused before any GPU work with a clear message, or handled as documented.

Silent: ``pad_values`` keys for samples that are bare tensors, a ``None`` field, activation checkpointing set on an
instance through a partial or a wrapper, global module hooks inside replayed regions. Obscure: misspelt DDP and FSDP2
keywords, NumPy numbers, ``compile=None``, strategy options after a registered name on the LightningCLI.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_cudagraph import (
    CUDAGraphCallback,
    CUDAGraphStrategy,
    DDPCUDAGraphStrategy,
    ModelParallelCUDAGraphStrategy,
    Stage,
)
from lightning_cudagraph._options.hooks import global_hooks, global_hooks_warning
from lightning_cudagraph.bucketing import PadToBucket, bucket_length
from tests.fake_backend import FakeBackend
from tests.helpers import trainer
from tests.models import TINY, DecoderModule, decoder
from tests.test_bad_inputs import refused

CPU = {"accelerator": "cpu", "devices": 1}
STRATEGIES = [CUDAGraphStrategy, DDPCUDAGraphStrategy, ModelParallelCUDAGraphStrategy]


@pytest.fixture(autouse=True)
def _no_allocator_env(monkeypatch):
    """Keep the allocator rule out of the way; the package may set NCCL_GRAPH_REGISTER, undo that."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "placeholder")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")


# =================================================================== PadToBucket
def test_a_named_pad_value_for_bare_tensor_samples_is_refused_with_position_zero_as_the_fix():
    collate = PadToBucket(multiple=4, pad_values={"labels": -100})
    with pytest.raises(ValueError, match="pad_values") as error:
        collate([torch.arange(3), torch.arange(5)])  # was padded with 0, the key ignored
    refused(error, "PadToBucket", "`pad_values={'labels': -100}`", "only the key 0", "pad_values={0: -100}")
    fixed = PadToBucket(multiple=4, pad_values={0: -100})([torch.arange(3), torch.arange(5)])  # the fix, literally
    assert fixed[0].tolist() == [0, 1, 2, -100, -100, -100, -100, -100]


@pytest.mark.parametrize(
    ("samples", "fragments"),
    [
        pytest.param(
            [{"input_ids": torch.arange(3), "labels": torch.arange(3)}, {"input_ids": torch.arange(4), "labels": None}],
            ["`samples[1]['labels']=None`", "field 'labels' of sample 1 is None"],
            id="mapping",
        ),
        pytest.param(
            [(torch.arange(3), torch.arange(3)), (torch.arange(4), None)],
            ["`samples[1][1]=None`", "field 1 of sample 1 is None"],
            id="tuple",
        ),
        pytest.param([torch.arange(3), None], ["`samples[1]=None`", "sample 1 is None"], id="bare"),
    ],
)
def test_a_none_field_is_named_with_its_sample(samples, fragments):
    with pytest.raises(ValueError, match="None") as error:  # was torch's "Could not infer dtype of NoneType"
        PadToBucket(multiple=4)(samples)
    refused(error, "PadToBucket", *fragments, "give it a value in the Dataset")


# =================================================================== activation checkpointing set on an instance
def _partial(mlp: torch.nn.Module) -> None:
    mlp.forward = functools.partial(checkpoint, mlp.forward, use_reentrant=False)


def _wraps(mlp: torch.nn.Module) -> None:
    def checkpointed(forward):
        @functools.wraps(forward)
        def wrapper(*args):
            return checkpoint(forward, *args, use_reentrant=False)

        return wrapper

    mlp.forward = checkpointed(mlp.forward)


class _Checkpointed:
    """A callable object that checkpoints the forward it holds."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args):
        return checkpoint(self.forward, *args, use_reentrant=False)


def _callable_object(mlp: torch.nn.Module) -> None:
    mlp.forward = _Checkpointed(mlp.forward)


@pytest.mark.parametrize("bind", [_partial, _wraps, _callable_object], ids=["partial", "wraps", "callable-object"])
def test_checkpointing_set_on_an_instances_forward_is_refused_however_it_is_bound(bind):
    class Checkpointed(DecoderModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            for block in self.model.blocks:
                bind(block.mlp)

    with pytest.raises(ValueError, match="activation checkpointing") as error:
        trainer(4, [CUDAGraphCallback(scope=["layer"])], **CPU).fit(*decoder(TINY, module=Checkpointed))
    refused(error, "CUDAGraphCallback", "model.blocks.0.mlp", "the forward set on the instance calls torch.utils")


def test_a_partial_forward_without_checkpointing_is_not_refused():
    class Partial(DecoderModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            for block in self.model.blocks:
                block.mlp.forward = functools.partial(type(block.mlp).forward, block.mlp)

    callback = CUDAGraphCallback(scope=["layer"])
    callback.capture_backend = FakeBackend()
    trainer(6, [callback], **CPU).fit(*decoder(TINY, module=Partial))
    assert callback.report.stage != Stage.DISABLED, callback.report.reason


# =================================================================== global module hooks
def test_global_hooks_are_named_with_how_they_were_registered():
    def count_calls(module, args, output):
        return None

    assert global_hooks_warning("CUDAGraphCallback", ["model.blocks.0"]) is None
    handle = torch.nn.modules.module.register_module_forward_hook(count_calls)
    try:
        assert global_hooks() == [
            "test_global_hooks_are_named_with_how_they_were_registered.count_calls (register_module_forward_hook)"
        ]
        message = global_hooks_warning("CUDAGraphCallback", ["model.blocks.0", "model.blocks.1"])
    finally:
        handle.remove()
    assert message is not None and message.startswith("CUDAGraphCallback: the global module hook(s)"), message
    assert "count_calls (register_module_forward_hook)" in message and "(model.blocks.0, model.blocks.1)" in message
    assert "Fix: remove them for the fit (handle.remove())" in message


def test_a_global_forward_hook_is_named_before_regions_replay_without_it():
    calls: dict[str, int] = {}
    names: dict[torch.nn.Module, str] = {}

    def count_calls(module, args, output):
        calls[names.get(module, "")] = calls.get(names.get(module, ""), 0) + 1

    model, data = decoder(TINY)
    names.update({module: name for name, module in model.named_modules()})
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2)
    callback.capture_backend = FakeBackend()
    handle = torch.nn.modules.module.register_module_forward_hook(count_calls)
    try:
        with pytest.warns(UserWarning, match="register_module_forward_hook") as record:
            trainer(8, [callback], **CPU).fit(model, data)
    finally:
        handle.remove()
    message = next(str(w.message) for w in record if "global module hook" in str(w.message))
    assert "count_calls (register_module_forward_hook)" in message and "model.blocks.0" in message, message
    assert callback.report.replays > 0, callback.report.reason
    # What the warning says: the regions' own calls keep firing the hook, the modules inside them stop.
    assert calls["model.blocks.0"] == 8 and calls["model.blocks.0.mlp.fc"] < 8, calls


# =================================================================== misspelt DDP and FSDP2 keywords
@pytest.mark.parametrize(
    ("cls", "keyword", "close"),
    [
        pytest.param(DDPCUDAGraphStrategy, "find_unused_paramters", "find_unused_parameters", id="ddp-ddp-module"),
        pytest.param(DDPCUDAGraphStrategy, "proces_group_backend", "process_group_backend", id="ddp-strategy"),
        pytest.param(DDPCUDAGraphStrategy, "replay_timeout", "replay_timeout_s", id="ddp-own"),
        pytest.param(ModelParallelCUDAGraphStrategy, "save_distributed_checkpont", "save_distributed_checkpoint"),
        pytest.param(ModelParallelCUDAGraphStrategy, "tensor_paralel_size", "tensor_parallel_size", id="fsdp2-own"),
    ],
)
def test_a_misspelt_strategy_keyword_is_refused_at_construction_with_the_close_name(cls, keyword, close):
    with pytest.raises(ValueError, match=keyword) as error:  # was accepted, then a TypeError at fit
        cls(**{keyword: True})
    refused(error, cls.__name__, f"`{keyword}=True`", f"did you mean {close!r}?")


def test_keywords_lightning_passes_itself_are_refused_and_the_others_still_reach_ddp():
    with pytest.raises(ValueError, match="device_ids") as error:
        DDPCUDAGraphStrategy(device_ids=[0])
    refused(error, "DDPCUDAGraphStrategy", "Lightning passes each process's device itself")
    strategy = DDPCUDAGraphStrategy(find_unused_parameters=True, static_graph=True, process_group_backend="gloo")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": True}
    assert ModelParallelCUDAGraphStrategy(save_distributed_checkpoint=False)._save_distributed_checkpoint is False


# =================================================================== NumPy numbers
NUMPY_OPTIONS = {
    "warmup_steps": (np.int64(2), 2),
    "confirm_steps": (np.int32(3), 3),
    "max_pool_mib": (np.float32(600), 600.0),
    "parity_tol": (np.float32(0.125), 0.125),
    "seal_after_steps": (np.int64(5), 5),
    "audit_every_n_steps": (np.int64(50), 50),
    "eval_graphs": (np.bool_(False), False),
    "scope": (np.array(["attn", "mlp"]), ("attn", "mlp")),
}


@pytest.mark.parametrize("cls", [CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy])
@pytest.mark.parametrize("option", list(NUMPY_OPTIONS))
def test_numpy_values_are_taken_as_the_python_values_they_hold(cls, option):
    given, stored = NUMPY_OPTIONS[option]
    built = cls(**{option: given})
    config = getattr(built, "cudagraph_config", None) or built.config
    assert getattr(config, option) == stored and type(getattr(config, option)) is type(stored)


@pytest.mark.parametrize("cls", STRATEGIES[1:])
def test_numpy_counts_and_seconds_of_the_strategies(cls):
    strategy = cls(on_shape_change="recapture", max_graphs=np.int64(3), replay_timeout_s=np.float32(600))
    assert (strategy.cudagraph_config.max_graphs, strategy.replay_timeout_s) == (3, 600.0)
    assert type(strategy.cudagraph_config.max_graphs) is int and type(strategy.replay_timeout_s) is float


def test_numpy_bucket_sizes_and_pad_values():
    collate = PadToBucket(buckets=np.array([8, 16]), pad_values={np.int64(1): np.int64(-100)})
    assert collate.buckets == [8, 16] and collate.pad_values == {1: -100}
    batch = collate([(torch.arange(3), torch.arange(3))])
    assert batch[1][0].tolist() == [0, 1, 2, *[-100] * 5]
    assert PadToBucket(multiple=np.int64(8)).multiple == 8
    assert PadToBucket(buckets=[np.int64(8), np.int64(16)]).buckets == [8, 16]
    assert bucket_length(70, buckets=np.array([64, 128])) == 128 and bucket_length(70, multiple=np.int64(32)) == 96


def test_a_numpy_value_that_is_not_allowed_is_still_refused_as_its_python_value():
    with pytest.raises(ValueError, match="warmup_steps") as error:
        CUDAGraphCallback(warmup_steps=np.int64(-1))
    refused(error, "CUDAGraphCallback", "`warmup_steps=-1`", "an integer >= 0")


# =================================================================== compile=None
@pytest.mark.parametrize("cls", [CUDAGraphCallback, *STRATEGIES])
def test_compile_none_is_off_everywhere(cls):
    built = cls(compile=None)  # was refused by ModelParallelCUDAGraphStrategy
    config = getattr(built, "cudagraph_config", None) or built.config
    assert config.compile is None and config.options()["compile"] is False


# =================================================================== LightningCLI: options go with the class name
@pytest.mark.parametrize(
    ("flags", "cls", "replay_timeout_s"),
    [
        pytest.param(
            ["--trainer.strategy=CUDAGraphStrategy", "--trainer.strategy.scope=[layer]"],
            CUDAGraphStrategy,
            None,
            id="cudagraph_layer",
        ),
        pytest.param(
            [
                "--trainer.strategy=DDPCUDAGraphStrategy",
                "--trainer.strategy.scope=[layer]",
                "--trainer.strategy.replay_timeout_s=600",
            ],
            DDPCUDAGraphStrategy,
            600,
            id="ddp",
        ),
        pytest.param(
            [
                "--trainer.strategy=ModelParallelCUDAGraphStrategy",
                "--trainer.strategy.scope=[full_iteration]",
                "--trainer.strategy.tensor_parallel_size=1",
                "--trainer.strategy.replay_timeout_s=600",
            ],
            ModelParallelCUDAGraphStrategy,
            600,
            id="fsdp2_cudagraph_full",
        ),
    ],
)
def test_cli_options_of_a_registered_names_strategy_go_with_its_class(
    tmp_path, monkeypatch, flags, cls, replay_timeout_s
):
    pytest.importorskip("jsonargparse")
    from tests.test_strategies import build_cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = build_cli(tmp_path, [*flags, "--trainer.strategy.max_pool_mib=512"], monkeypatch).trainer.strategy
    assert type(strategy) is cls and strategy.cudagraph_config.max_pool_mib == 512
    assert getattr(strategy, "replay_timeout_s", None) == replay_timeout_s

"""Inputs that used to be silent or obscure: each is refused before any GPU work, naming the value and the fix.

One test per input (issue 26), plus the messages whose fixes must work when followed literally (issue 24).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy, Stage
from lightning_cudagraph._backend.cuda import CUDABackend
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.options import TE_INSTALL
from lightning_cudagraph.bucketing import PadToBucket
from tests.fake_backend import FakeBackend
from tests.helpers import fit, trainer
from tests.models import MLP, TINY, DecoderModule, decoder
from tests.test_bucketing import _MaskedLoss, variable_length_loader

CPU = {"accelerator": "cpu", "devices": 1}


@pytest.fixture(autouse=True)
def _no_allocator_env(monkeypatch):
    """Keep the allocator rule out of the way; the package may set NCCL_GRAPH_REGISTER, undo that."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "placeholder")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")


def refused(error: pytest.ExceptionInfo, component: str, *fragments: str) -> str:
    """The message, checked for the package's four parts and for ``fragments`` (the value and the fix)."""
    message = str(error.value)
    assert message.startswith(f"{component}:") and "Allowed:" in message and "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# =================================================================== options
def test_confirm_steps_beyond_the_bound_is_refused():
    with pytest.raises(ValueError, match="confirm_steps") as error:
        CUDAGraphCallback(confirm_steps=10**6)
    refused(error, "CUDAGraphCallback", "`confirm_steps=1000000`", "1 to 100", "confirm_steps=2")
    assert CUDAGraphCallback(confirm_steps=100).config.confirm_steps == 100


def test_a_misspelt_builtin_scope_key_under_auto_is_refused_with_did_you_mean():
    with pytest.raises(ValueError, match="modules") as error:
        CUDAGraphCallback(modules={"atn": "blocks.*.attn"})
    refused(error, "CUDAGraphCallback", "modules={'atn': 'blocks.*.attn'}", "did you mean 'attn'?")
    # A new scope with a name unlike any built-in one still joins every level.
    assert CUDAGraphCallback(modules={"head": "model.head"}).config.modules == {"head": ("model.head",)}


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        pytest.param(
            {"scope": ["attn"], "modules": {"mlp": "blocks.*.mlp"}},
            ["modules={'mlp': 'blocks.*.mlp'}", "add 'mlp' to scope=", "scope=['attn', 'mlp']"],
            id="builtin-key",
        ),
        pytest.param(
            {"scope": ["attn"], "modules": {"head": "head"}},
            ["modules={'head': 'head'}", "add it to scope=", "scope=['attn', 'head']"],
            id="new-scope-key",
        ),
        pytest.param(
            {"scope": ["layer"], "modules": {"atn": "blocks.*.attn"}},
            ["modules={'atn': 'blocks.*.attn'}", "did you mean 'attn'?"],
            id="misspelt-key",
        ),
        pytest.param(
            {"scope": ["full_iteration"], "modules": {"attn": "blocks.*.attn"}},
            ["no modules= with scope=['full_iteration']", "drop modules="],
            id="full-iteration",
        ),
    ],
)
def test_a_modules_key_no_requested_scope_uses_is_refused_with_the_fix(options, fragments):
    with pytest.raises(ValueError, match="modules") as error:
        CUDAGraphCallback(**options)
    refused(error, "CUDAGraphCallback", *fragments)


def test_the_fix_for_an_unused_modules_key_works_as_written():
    config = CUDAGraphConfig.from_options("CUDAGraphCallback", scope=["attn", "mlp"], modules={"mlp": "blocks.*.mlp"})
    assert config.modules == {"mlp": ("blocks.*.mlp",)}


def test_an_unknown_inductor_option_is_refused_at_construction_with_close_names():
    with pytest.raises(ValueError, match="compile") as error:
        CUDAGraphCallback(scope=["layer"], compile={"options": {"max_autotun": True}})
    refused(error, "CUDAGraphCallback", "'max_autotun' is not one", "did you mean 'max_autotune'")
    assert CUDAGraphCallback(scope=["layer"], compile={"options": {"max_autotune": True}}).config.compile is not None


def test_compile_of_the_wrong_type_suggests_a_fix_that_is_accepted_as_written():
    with pytest.raises(ValueError, match="compile") as error:
        CUDAGraphCallback(compile="yes")
    message = refused(error, "CUDAGraphCallback", "`compile='yes'`", "scope=['layer'], compile=True")
    assert "compile=True" in message
    assert CUDAGraphCallback(scope=["layer"], compile=True).config.compile is not None  # the fix, literally


def test_full_iteration_with_graphs_off_tells_how_to_turn_them_off():
    with pytest.raises(ValueError, match="impl") as error:
        CUDAGraphStrategy(scope=["full_iteration"], impl="none")
    refused(error, "CUDAGraphStrategy", "`impl='none'`", "drop scope=['full_iteration']", "keep impl='none'")
    assert not CUDAGraphStrategy(impl="none").cudagraph_config.enabled  # the fix, literally


def test_the_transformer_engine_fix_is_a_command_that_works(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a)
    )
    with pytest.raises(ValueError, match="transformer_engine") as error:
        CUDAGraphCallback(impl="transformer_engine", scope=["layer"])
    message = refused(error, "CUDAGraphCallback", TE_INSTALL, "impl='local'")
    assert "lightning-cudagraph[" not in message  # unpublished, and unquoted brackets break in zsh


@pytest.mark.parametrize("cls", [CUDAGraphCallback, CUDAGraphStrategy])
def test_a_misspelt_keyword_names_the_option_it_looks_like(cls):
    with pytest.raises(ValueError, match="warmup_step=") as error:
        cls(warmup_step=5)
    refused(error, cls.__name__, "did you mean 'warmup_steps'?")


def test_an_unknown_scope_suggests_the_close_builtin():
    with pytest.raises(ValueError, match="scope") as error:
        CUDAGraphCallback(scope=["atn"])
    refused(error, "CUDAGraphCallback", "`scope=['atn']`", "did you mean 'attn'?")


# =================================================================== capture_backend
class _NoDevice:
    pass


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        pytest.param("cuda", ["`capture_backend='cuda'`", "CaptureBackend instance"], id="string"),
        pytest.param(
            FakeBackend, ["FakeBackend'>", "an instance, not the class: capture_backend = FakeBackend(...)"], id="class"
        ),
        pytest.param(
            CUDABackend(torch.device("cpu")),
            ["CUDABackend(device=device(type='cpu'))", "CUDABackend(torch.device('cuda', 0))"],
            id="cuda-backend-on-cpu",
        ),
        pytest.param(_NoDevice(), ["_NoDevice object", "CaptureBackend subclass"], id="not-a-backend"),
    ],
)
@pytest.mark.parametrize("owner", [CUDAGraphCallback, CUDAGraphStrategy])
def test_a_capture_backend_that_cannot_capture_is_refused_where_it_is_set(owner, value, fragments):
    target = owner(scope=["layer"])
    with pytest.raises(ValueError, match="capture_backend") as error:
        target.capture_backend = value
    refused(error, owner.__name__, *fragments)
    assert target.capture_backend is None
    target.capture_backend = backend = FakeBackend()
    assert target.capture_backend is backend


@pytest.mark.parametrize("cls", [CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy])
def test_capture_backend_as_a_keyword_says_to_set_it_on_the_instance(cls):
    with pytest.raises(ValueError, match="capture_backend") as error:
        cls(scope=["layer"], capture_backend=FakeBackend())
    refused(error, cls.__name__, ".capture_backend = backend")


# =================================================================== PadToBucket
def test_named_pad_values_on_tuple_samples_are_refused_with_positions_as_the_fix():
    collate = PadToBucket(multiple=4, pad_values={"labels": -100})
    with pytest.raises(ValueError, match="pad_values") as error:
        collate([(torch.arange(3), torch.arange(3))])
    refused(error, "PadToBucket", "`pad_values={'labels': -100}`", "positions 0 to 1", "pad_values={1: -100}")


def test_pad_values_naming_no_key_of_mapping_samples_are_refused():
    collate = PadToBucket(multiple=4, pad_values={"label": -100})
    with pytest.raises(ValueError, match="pad_values") as error:
        collate([{"input_ids": torch.arange(3), "labels": torch.arange(3)}])
    refused(error, "PadToBucket", "['input_ids', 'labels']")


@pytest.mark.parametrize("buckets", [[64.5, 128], ["64", "128"], [True, 8]])
def test_non_integer_buckets_are_refused_at_construction(buckets):
    with pytest.raises(ValueError, match="buckets") as error:
        PadToBucket(buckets=buckets)
    refused(error, "PadToBucket", f"`buckets={buckets!r}`", "integer lengths")


# =================================================================== at fit (before any capture)
def test_seal_after_steps_beyond_max_steps_is_refused_at_setup():
    callback = CUDAGraphCallback(scope=["layer"], seal_after_steps=50)
    with pytest.raises(ValueError, match="seal_after_steps") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY))
    refused(error, "CUDAGraphCallback", "`seal_after_steps=50`", "Trainer(max_steps=4)", "seal_after_steps=4 or less")


def test_seal_after_steps_beyond_a_fit_bounded_by_epochs_is_refused_at_fit_start():
    callback = CUDAGraphCallback(scope=["layer"], seal_after_steps=50)
    callback.capture_backend = FakeBackend()
    model, data = decoder(TINY, batch_size=4, train_samples=32)  # 8 optimizer steps an epoch
    with pytest.raises(ValueError, match="seal_after_steps") as error:
        trainer(-1, [callback], max_epochs=2, **CPU).fit(model, data)
    refused(error, "CUDAGraphCallback", "`seal_after_steps=50`", "the fit's 16 optimizer steps", "seal_after_steps=16")


class _CheckpointedMLP(MLP):
    """An MLP whose forward recomputes itself in the backward (functional activation checkpointing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class _CheckpointedModule(DecoderModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.model.blocks:
            block.mlp = _CheckpointedMLP(TINY["width"], 0.0)


def test_functional_checkpoint_inside_a_captured_forward_is_refused():
    callback = CUDAGraphCallback(scope=["mlp"])
    with pytest.raises(ValueError, match="activation checkpointing") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY, module=_CheckpointedModule))
    refused(error, "CUDAGraphCallback", "model.blocks.0.mlp", "_CheckpointedMLP.forward calls torch.utils.checkpoint")
    assert "pick a scope that does not contain it" in str(error.value)


class _InstanceCheckpointed(DecoderModule):
    """Checkpointing bound on the instance, as users patch a block: ``block.mlp.forward = ...``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.model.blocks:
            original = block.mlp.forward
            block.mlp.forward = lambda x, original=original: checkpoint(original, x, use_reentrant=False)


def test_functional_checkpoint_in_a_forward_set_on_the_instance_is_refused():
    callback = CUDAGraphCallback(scope=["layer"])
    with pytest.raises(ValueError, match="activation checkpointing") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY, module=_InstanceCheckpointed))
    refused(error, "CUDAGraphCallback", "model.blocks.0.mlp", "torch.utils.checkpoint")


def test_functional_checkpoint_outside_the_captured_regions_is_fine():
    callback = CUDAGraphCallback(scope=["attn"])
    callback.capture_backend = FakeBackend()
    trainer(6, [callback], **CPU).fit(*decoder(TINY, module=_CheckpointedModule))
    assert callback.report.stage != Stage.DISABLED, callback.report.reason


def test_a_modules_predicate_that_raises_is_named_with_its_scope_and_module():
    def picky(name: str, module: nn.Module) -> bool:
        return module.in_features > 0  # raises on modules without in_features

    callback = CUDAGraphCallback(scope=["head"], modules={"head": picky})
    with pytest.raises(ValueError, match="modules\\['head'\\]") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY))
    refused(error, "CUDAGraphCallback", "AttributeError", "on module 'model'", "return False")
    assert isinstance(error.value.__cause__, AttributeError)


def test_a_modules_override_that_matches_nothing_is_named_with_close_names():
    callback = CUDAGraphCallback(scope=["attn"], modules={"attn": "model.blocks.*.atn"})
    with pytest.raises(ValueError, match="matches no module") as error:
        trainer(4, [callback], **CPU).fit(*decoder(TINY))
    message = str(error.value)
    assert "`modules={'attn': 'model.blocks.*.atn'}`" in message, message
    assert "'model.blocks.*.attn'" in message and "drop the 'attn' key" in message, message


def test_two_identical_callbacks_reach_the_packages_refusal():
    with pytest.raises(ValueError, match="one CUDAGraphCallback per Trainer") as error:
        trainer(4, [CUDAGraphCallback(), CUDAGraphCallback()], **CPU)
    refused(error, "CUDAGraphCallback", "2 CUDAGraphCallbacks", "Trainer(callbacks=[CUDAGraphCallback()])")


# =================================================================== seal taken during warmup (documented)
def test_a_seal_during_warmup_keeps_the_warmup_shape_and_refuses_the_others():
    # 8 batches of length 8 (bucket 8), then one of length 16: the seal is due at step 1, inside the 3 eager steps.
    lengths = [5, 6] * 8 + [14, 15]
    collate = PadToBucket(buckets=[8, 16], pad_values={1: -100})
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=3, seal_after_steps=1, on_shape_change="recapture")
    callback.capture_backend = FakeBackend()
    model = decoder(TINY, module=_MaskedLoss)[0]
    with pytest.raises(RuntimeError, match=r"int64\[2, 16\].*sealed \(captured: \[int64\[2, 8\]"):
        fit(model, variable_length_loader(lengths, collate), 9, [callback], **CPU)
    assert callback.report.captures == 1, "the shape warmup stabilised was captured although the seal came first"


class _WithIds(DecoderModule):
    """Batches carry a string per batch (an id), which ``training_step`` ignores."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)


def test_a_whole_step_fit_whose_batches_carry_a_changing_string_says_so():
    tokens = torch.randint(TINY["vocab_size"], (8 * 4, TINY["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    batches = [(tokens[i : i + 4, :-1], tokens[i : i + 4, 1:], f"batch-{i}") for i in range(0, 32, 4)]
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    model, _ = decoder(TINY, module=_WithIds)
    with pytest.warns(UserWarning, match="not_engaged"):
        trainer(8, strategy=strategy, **CPU).fit(model, DataLoader(batches, batch_size=None))
    reason = strategy.rollout.report.reason
    assert "every batch had another signature" in reason and "'batch-0'" in reason, reason
    assert "the targets did not run" not in reason

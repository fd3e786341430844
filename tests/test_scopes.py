"""Scope names resolved to the modules of small CPU models: built-in patterns, overrides, auto, and errors."""

import pytest
import torch.nn as nn

from lightning_cudagraph._options.levels import build_levels
from lightning_cudagraph._options.scopes import resolve_scopes


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.attn = Attention()
        self.mlp = MLP()


class GPT(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = nn.Linear(8, 16)


class LlamaLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.mlp = MLP()


class SparseExperts(nn.Module):
    """Named like Mixtral's MixtralSparseMoeBlock: a ``gate`` router and the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(MLP() for _ in range(4))


class MixtralLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.block_sparse_moe = SparseExperts()


def hf_model(layer_cls: type[nn.Module], n_layers: int = 2) -> nn.Module:
    """``model.layers.<i>`` as in Hugging Face Llama/Mistral/Mixtral."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList(layer_cls() for _ in range(n_layers))
    return root


def gpt2_model() -> nn.Module:
    """``transformer.h.<i>`` as in Hugging Face GPT-2."""
    root = nn.Module()
    root.transformer = nn.Module()
    root.transformer.h = nn.ModuleList(Block() for _ in range(3))
    return root


def names(resolution) -> list[str]:
    return [target.name for target in resolution.targets]


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        pytest.param(["attn"], ["blocks.0.attn", "blocks.1.attn"], id="attn"),
        pytest.param(["mlp"], ["blocks.0.mlp", "blocks.1.mlp"], id="mlp"),
        pytest.param(["layer"], ["blocks.0", "blocks.1"], id="layer"),
        pytest.param(
            ["attn", "mlp"], ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"], id="attn-mlp"
        ),
        pytest.param(
            ["mlp", "attn"], ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"], id="model-order"
        ),
    ],
)
def test_gpt_like_scopes(scope, expected):
    resolution = resolve_scopes(GPT(), scope)
    assert names(resolution) == expected
    assert resolution.nested == {}


def test_each_target_records_its_scope_and_module():
    model = GPT()
    resolution = resolve_scopes(model, ["attn", "mlp"])
    assert [(t.name, t.scope) for t in resolution.targets[:2]] == [("blocks.0.attn", "attn"), ("blocks.0.mlp", "mlp")]
    assert resolution.targets[0].module is model.blocks[0].attn
    assert resolution.matched == {"attn": ["blocks.0.attn", "blocks.1.attn"], "mlp": ["blocks.0.mlp", "blocks.1.mlp"]}


def test_attn_nested_in_layer_is_folded_into_the_layer():
    resolution = resolve_scopes(GPT(), ["layer", "attn"])
    assert names(resolution) == ["blocks.0", "blocks.1"]
    assert {t.scope for t in resolution.targets} == {"layer"}
    assert resolution.nested == {"blocks.0.attn": "blocks.0", "blocks.1.attn": "blocks.1"}
    assert resolution.matched["attn"] == ["blocks.0.attn", "blocks.1.attn"]
    assert "nested" in resolution.summary()


@pytest.mark.parametrize(
    ("build", "scope", "expected"),
    [
        pytest.param(
            lambda: hf_model(LlamaLayer),
            ["attn"],
            ["model.layers.0.self_attn", "model.layers.1.self_attn"],
            id="llama-attn",
        ),
        pytest.param(
            lambda: hf_model(LlamaLayer), ["mlp"], ["model.layers.0.mlp", "model.layers.1.mlp"], id="llama-mlp"
        ),
        pytest.param(lambda: hf_model(LlamaLayer), ["layer"], ["model.layers.0", "model.layers.1"], id="llama-layer"),
        pytest.param(gpt2_model, ["layer"], ["transformer.h.0", "transformer.h.1", "transformer.h.2"], id="gpt2-layer"),
        pytest.param(
            gpt2_model,
            ["attn"],
            ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
            id="gpt2-attn",
        ),
        pytest.param(
            lambda: hf_model(MixtralLayer),
            ["moe_router"],
            ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"],
            id="mixtral-router",
        ),
        pytest.param(
            lambda: hf_model(MixtralLayer),
            ["moe"],
            ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"],
            id="mixtral-moe",
        ),
    ],
)
def test_hugging_face_style_names(build, scope, expected):
    assert names(resolve_scopes(build(), scope)) == expected


def test_mixtral_experts_are_not_taken_for_mlp_scope():
    with pytest.raises(ValueError, match="'mlp' matches no module"):
        resolve_scopes(hf_model(MixtralLayer), ["mlp"])


def test_multihead_attention_found_by_class_under_any_name():
    model = nn.Module()
    model.encoder = nn.ModuleList(
        nn.ModuleDict({"mixer": nn.MultiheadAttention(8, 2), "proj": nn.Linear(8, 8)}) for _ in range(2)
    )
    assert names(resolve_scopes(model, ["attn"])) == ["encoder.0.mixer", "encoder.1.mixer"]


def test_transformer_encoder_layer_found_for_layer():
    model = nn.Module()
    model.encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16), num_layers=2, enable_nested_tensor=False
    )
    resolution = resolve_scopes(model, ["layer"])
    assert names(resolution) == ["encoder.layers.0", "encoder.layers.1"]
    assert all(isinstance(t.module, nn.TransformerEncoderLayer) for t in resolution.targets)
    # The encoder layer's own MultiheadAttention is an attn target, and folds into the layer when both are asked.
    assert names(resolve_scopes(model, ["attn"])) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert names(resolve_scopes(model, ["attn", "layer"])) == ["encoder.layers.0", "encoder.layers.1"]


def test_transformer_encoder_layer_found_by_class_outside_a_layer_container():
    model = nn.Module()
    model.first = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    assert names(resolve_scopes(model, ["layer"])) == ["first"]


class MambaMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(8, 16)


class MoEWithPreprocess(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.preprocess = nn.Identity()
        self.experts = nn.ModuleList(MLP() for _ in range(2))


def test_moe_preprocess_found_by_name():
    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"moe": MoEWithPreprocess()}) for _ in range(2))
    resolution = resolve_scopes(model, ["moe_router", "moe_preprocess"])
    assert names(resolution) == [
        "layers.0.moe.router",
        "layers.0.moe.preprocess",
        "layers.1.moe.router",
        "layers.1.moe.preprocess",
    ]
    assert [t.scope for t in resolution.targets[:2]] == ["moe_router", "moe_preprocess"]


def test_mamba_found_by_class_name():
    model = nn.Module()
    model.backbone = nn.ModuleList(nn.ModuleDict({"mixer": MambaMixer(), "norm": nn.LayerNorm(8)}) for _ in range(2))
    assert names(resolve_scopes(model, ["mamba"])) == ["backbone.0.mixer", "backbone.1.mixer"]


@pytest.mark.parametrize(
    ("overrides", "scope", "expected"),
    [
        pytest.param({"attn": ["blocks.1.attn"]}, ["attn"], ["blocks.1.attn"], id="glob-narrows-builtin"),
        pytest.param({"attn": ["blocks.*.attn.qkv"]}, ["attn"], ["blocks.0.attn.qkv", "blocks.1.attn.qkv"], id="glob"),
        pytest.param({"mlp": [MLP]}, ["mlp"], ["blocks.0.mlp", "blocks.1.mlp"], id="class"),
        pytest.param({"head": [lambda name, module: name == "head"]}, ["head"], ["head"], id="predicate-new-scope"),
        pytest.param(
            {"norms": [lambda name, module: isinstance(module, nn.LayerNorm)], "head": ["head"]},
            ["norms", "head"],
            ["blocks.0.ln", "blocks.1.ln", "head"],
            id="two-custom-scopes",
        ),
        pytest.param({"layer": ["embed"]}, ["layer"], ["embed"], id="override-replaces-builtin"),
    ],
)
def test_overrides(overrides, scope, expected):
    assert names(resolve_scopes(GPT(), scope, overrides)) == expected


@pytest.mark.parametrize(
    ("build", "first", "expected"),
    [
        pytest.param(GPT, "attn", ["blocks.0.attn", "blocks.1.attn"], id="attn-first"),
        pytest.param(
            lambda: nn.ModuleDict({"blocks": nn.ModuleList(nn.ModuleDict({"mlp": MLP()}) for _ in range(2))}),
            "attn+mlp",
            ["blocks.0.mlp", "blocks.1.mlp"],
            id="mlp-without-attn",
        ),
        pytest.param(
            lambda: nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(8, 8) for _ in range(3))}),
            "layer",
            ["layers.0", "layers.1", "layers.2"],
            id="layer-without-attn-or-mlp",
        ),
    ],
)
def test_auto_starts_on_the_narrowest_level_that_finds_modules(build, first, expected):
    found = build_levels(build(), {}, whole_step_problem="no strategy")
    levels = [level for level in found if level.unavailable is None]
    assert levels[0].name == first
    assert [t.name for t in levels[0].targets] == expected


def test_auto_on_a_model_with_no_named_regions_has_only_its_submodules_and_the_whole_step():
    levels = build_levels(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), {}, whole_step_problem=None)
    assert [level.name for level in levels if level.unavailable is None] == ["model", "full_iteration"]
    assert [target.name for target in levels[3].targets] == ["0", "2"], "the children that hold parameters"


def test_the_model_level_is_left_out_when_a_parameter_sits_outside_every_called_submodule():
    model = nn.Module()
    model.blocks, model.head = nn.ModuleList([nn.Linear(8, 8)]), nn.Linear(8, 2)
    levels = {level.name: level for level in build_levels(model, {}, whole_step_problem=None)}
    why = "trainable parameters outside a called submodule of Module: blocks.0.weight, ..."
    assert levels["model"].unavailable == why
    model.blocks.requires_grad_(False)  # frozen (a peft base): the head alone holds what trains
    levels = {level.name: level for level in build_levels(model, {}, whole_step_problem=None)}
    assert [target.name for target in levels["model"].targets] == ["head"]


def test_scope_matching_nothing_lists_candidate_names():
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        resolve_scopes(GPT(n_layers=3), ["attn", "mamba"])
    message = str(error.value)
    assert "'mamba' matches no module of GPT" in message
    assert "Allowed:" in message
    assert "Fix:" in message
    assert "blocks.* (Block)" in message
    assert "blocks.*.attn (Attention)" in message
    assert "blocks.0" not in message
    assert "blocks.2" not in message


def test_scope_matching_nothing_names_the_component():
    with pytest.raises(ValueError, match=r"^CUDAGraphStrategy: scope 'moe'"):
        resolve_scopes(GPT(), ["moe"], component="CUDAGraphStrategy")


def test_empty_override_match_is_an_error():
    with pytest.raises(ValueError, match="'attn' matches no module"):
        resolve_scopes(GPT(), ["attn"], {"attn": ["nothing.*"]})


def test_full_iteration_needs_no_module():
    assert resolve_scopes(GPT(), ["full_iteration"]).targets == []


def test_root_module_is_never_a_target():
    with pytest.raises(ValueError, match="'attn' matches no module of MultiheadAttention"):
        resolve_scopes(nn.MultiheadAttention(8, 2), ["attn"])
    resolution = resolve_scopes(GPT(), ["everything"], {"everything": [lambda name, module: True]})
    assert "" not in names(resolution)
    assert names(resolution) == ["embed", "blocks", "head"]


def _te_named(class_name: str, **children: nn.Module) -> nn.Module:
    """A module whose class has a Transformer Engine class name (TE needs CUDA; discovery only reads names)."""
    module = type(class_name, (nn.Module,), {})()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def _te_style_model() -> nn.Module:
    """Two layers shaped like ``te.TransformerLayer``, under attribute names no name rule knows."""

    def te_layer() -> nn.Module:
        attention = _te_named("MultiheadAttention", qkv=nn.Linear(8, 24), core=_te_named("DotProductAttention"))
        return _te_named("TransformerLayer", mixer=attention, ff=_te_named("LayerNormMLP", fc1=nn.Linear(8, 32)))

    model = nn.Module()
    model.stack = nn.ModuleDict({"first": te_layer(), "second": te_layer()})
    return model


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        pytest.param(["attn"], ["stack.first.mixer", "stack.second.mixer"], id="attn-outer-MultiheadAttention"),
        pytest.param(["mlp"], ["stack.first.ff", "stack.second.ff"], id="mlp-LayerNormMLP"),
        pytest.param(["layer"], ["stack.first", "stack.second"], id="layer-TransformerLayer"),
        pytest.param(["attn", "layer"], ["stack.first", "stack.second"], id="layer-folds-attn"),
    ],
)
def test_transformer_engine_modules_found_by_class_name(scope, expected):
    assert names(resolve_scopes(_te_style_model(), scope)) == expected


def test_bare_dot_product_attention_found_for_attn():
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleDict({"core": _te_named("DotProductAttention")}) for _ in range(2))
    assert names(resolve_scopes(model, ["attn"])) == ["blocks.0.core", "blocks.1.core"]


def test_a_misspelt_selector_in_a_modules_list_is_refused_with_close_names():
    from tests.models import TINY, decoder

    model, _ = decoder(TINY)
    with pytest.raises(ValueError, match=r"modules\['layer'\].*correct or drop 'model.blokcs.1'.*close names") as error:
        resolve_scopes(model, ["layer"], {"layer": ["model.blocks.0", "model.blokcs.1"]})
    assert "'model.blocks.*'" in str(error.value), str(error.value)
    assert [t.name for t in resolve_scopes(model, ["layer"], {"layer": ["model.blocks.0", "model.blocks.1"]}).targets]

"""What each built-in scope finds on real layouts: Hugging Face models built from tiny configs on the meta device,
and trees shaped like Megatron-Core, timm and transformers 4.x where the library is not a test dependency.
The Hugging Face cases skip where transformers is not installed; the others run anyway.

A layout change in a future transformers release (a renamed router, an MoE block moved) fails here.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from lightning_cudagraph._options.levels import LEVEL_SCOPES, build_levels
from lightning_cudagraph._options.scopes import resolve_scopes

SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "layer")
ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}
MOE = {"moe_intermediate_size": 16, "num_experts_per_tok": 2}
SSM = {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64}


def each(pattern: str, indices) -> list[str]:
    return [pattern.format(i) for i in indices]


def names(resolution) -> list[str]:
    return [target.name for target in resolution.targets]


def on_meta(cls_name: str, config_name: str, **config) -> nn.Module:
    """A real Hugging Face model, built without memory; skipped where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))


def named_class(class_name: str, **children: nn.Module) -> nn.Module:
    """A module whose class carries a library's class name (discovery reads names, never imports the library)."""
    module = type(class_name, (nn.Module,), {})()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def megatron_gpt() -> nn.Module:
    """Megatron-Core's GPT/hybrid module tree: a dense layer, an MoE layer, a Mamba layer."""

    def layer(mlp: nn.Module) -> nn.Module:
        attention = named_class("SelfAttention", linear_qkv=nn.Linear(4, 12), linear_proj=nn.Linear(4, 4))
        return named_class("TransformerLayer", self_attention=attention, pre_mlp_layernorm=nn.LayerNorm(4), mlp=mlp)

    moe = named_class(
        "MoELayer",
        router=named_class("TopKRouter"),
        experts=named_class("TEGroupedMLP"),
        shared_experts=named_class("SharedExpertMLP"),
    )
    mamba = named_class("MambaLayer", norm=nn.LayerNorm(4), mixer=named_class("MambaMixer", in_proj=nn.Linear(4, 8)))
    model = nn.Module()
    model.decoder = named_class(
        "TransformerBlock", layers=nn.ModuleList([layer(named_class("MLP")), layer(moe), mamba])
    )
    return model


def timm_vit() -> nn.Module:
    """timm's VisionTransformer: ``blocks`` is an ``nn.Sequential`` of ``Block(norm1, attn, norm2, mlp)``."""

    def block() -> nn.Module:
        attn = named_class("Attention", qkv=nn.Linear(4, 12), proj=nn.Linear(4, 4))
        mlp = named_class("Mlp", fc1=nn.Linear(4, 8), fc2=nn.Linear(8, 4))
        return named_class("Block", norm1=nn.LayerNorm(4), attn=attn, norm2=nn.LayerNorm(4), mlp=mlp)

    return named_class("VisionTransformer", patch_embed=nn.Conv2d(3, 4, 2), blocks=nn.Sequential(block(), block()))


def example_moe() -> nn.Module:
    from tests.models import TINY, MoEDecoderModule

    return MoEDecoderModule(experts=4, **TINY)


def hf4_mixtral() -> nn.Module:
    """transformers 4.x Mixtral: the MoE block at ``block_sparse_moe``, a plain Linear ``gate``, listed experts."""
    experts = nn.ModuleList(named_class("MixtralBlockSparseTop2MLP", w1=nn.Linear(4, 8)) for _ in range(2))
    moe = named_class("MixtralSparseMoeBlock", gate=nn.Linear(4, 2), experts=experts)
    layer = named_class("MixtralDecoderLayer", self_attn=named_class("MixtralAttention"), block_sparse_moe=moe)
    model = nn.Module()
    model.model = named_class("MixtralModel", layers=nn.ModuleList([layer]))
    return model


def hf4_vit() -> nn.Module:
    """transformers 4.x ViT: ``encoder.layer.N``, the feed-forward split into ``intermediate`` and ``output``."""
    layer = named_class(
        "ViTLayer",
        attention=named_class("ViTAttention", output=named_class("ViTSelfOutput")),
        intermediate=named_class("ViTIntermediate"),
        output=named_class("ViTOutput"),
    )
    model = nn.Module()
    model.encoder = named_class("ViTEncoder", layer=nn.ModuleList([layer]))
    return model


# Each layout: how to build it, and what each scope finds; a scope left out must match nothing.
LAYOUTS = {
    "llama": (
        lambda: on_meta("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=2, **DECODER),
        {
            "attn": each("model.layers.{}.self_attn", range(2)),
            "mlp": each("model.layers.{}.mlp", range(2)),
            "layer": each("model.layers.{}", range(2)),
        },
    ),
    "gpt2": (
        lambda: on_meta(
            "GPT2LMHeadModel",
            "GPT2Config",
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
        {
            "attn": each("transformer.h.{}.attn", range(2)),
            "mlp": each("transformer.h.{}.mlp", range(2)),
            "layer": each("transformer.h.{}", range(2)),
        },
    ),
    "qwen3_moe": (
        lambda: on_meta("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_hidden_layers=2, num_experts=4, **DECODER, **MOE),
        {
            "attn": each("model.layers.{}.self_attn", range(2)),
            "moe": each("model.layers.{}.mlp", range(2)),
            "moe_router": each("model.layers.{}.mlp.gate", range(2)),
            "layer": each("model.layers.{}", range(2)),
        },
    ),
    "qwen2_moe": (  # its dense shared_expert inside the MoE block is not an mlp region
        lambda: on_meta(
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            num_hidden_layers=2,
            num_experts=4,
            shared_expert_intermediate_size=16,
            **DECODER,
            **MOE,
        ),
        {
            "attn": each("model.layers.{}.self_attn", range(2)),
            "moe": each("model.layers.{}.mlp", range(2)),
            "moe_router": each("model.layers.{}.mlp.gate", range(2)),
            "layer": each("model.layers.{}", range(2)),
        },
    ),
    "mixtral": (
        lambda: on_meta("MixtralForCausalLM", "MixtralConfig", num_hidden_layers=2, num_local_experts=4, **DECODER),
        {
            "attn": each("model.layers.{}.self_attn", range(2)),
            "moe": each("model.layers.{}.mlp", range(2)),
            "moe_router": each("model.layers.{}.mlp.gate", range(2)),
            "layer": each("model.layers.{}", range(2)),
        },
    ),
    "deepseek_v3": (  # layer 0 dense, layers 1-2 MoE (DeepseekV3MoE, router DeepseekV3TopkRouter)
        lambda: on_meta(
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **DECODER,
            **MOE,
        ),
        {
            "attn": each("model.layers.{}.self_attn", range(3)),
            "mlp": ["model.layers.0.mlp"],
            "moe": each("model.layers.{}.mlp", [1, 2]),
            "moe_router": each("model.layers.{}.mlp.gate", [1, 2]),
            "layer": each("model.layers.{}", range(3)),
        },
    ),
    "example_moe": (  # the MoE test model (as examples/moe.py): the one layout with a preprocess module
        example_moe,
        {
            "attn": each("model.blocks.{}.attn", range(2)),
            "moe": each("model.blocks.{}.moe", range(2)),
            "moe_router": each("model.blocks.{}.moe.router", range(2)),
            "moe_preprocess": each("model.blocks.{}.moe.preprocess", range(2)),
            "layer": each("model.blocks.{}", range(2)),
        },
    ),
    "mixtral_4x": (
        hf4_mixtral,
        {
            "attn": ["model.layers.0.self_attn"],
            "moe": ["model.layers.0.block_sparse_moe"],
            "moe_router": ["model.layers.0.block_sparse_moe.gate"],
            "layer": ["model.layers.0"],
        },
    ),
    "megatron": (
        megatron_gpt,
        {
            "attn": each("decoder.layers.{}.self_attention", range(2)),
            "mlp": ["decoder.layers.0.mlp"],
            "moe": ["decoder.layers.1.mlp"],
            "moe_router": ["decoder.layers.1.mlp.router"],
            "mamba": ["decoder.layers.2.mixer"],
            "layer": each("decoder.layers.{}", range(3)),
        },
    ),
    "bert": (
        lambda: on_meta("BertForMaskedLM", "BertConfig", vocab_size=64, **ENCODER),
        {
            "attn": each("bert.encoder.layer.{}.attention", range(2)),
            "mlp": [f"bert.encoder.layer.{i}.{part}" for i in range(2) for part in ("intermediate", "output")],
            "layer": each("bert.encoder.layer.{}", range(2)),
        },
    ),
    "roberta": (
        lambda: on_meta("RobertaModel", "RobertaConfig", vocab_size=64, **ENCODER),
        {
            "attn": each("encoder.layer.{}.attention", range(2)),
            "mlp": [f"encoder.layer.{i}.{part}" for i in range(2) for part in ("intermediate", "output")],
            "layer": each("encoder.layer.{}", range(2)),
        },
    ),
    "vit": (
        lambda: on_meta("ViTModel", "ViTConfig", image_size=16, patch_size=8, **ENCODER),
        {
            "attn": each("layers.{}.attention", range(2)),
            "mlp": each("layers.{}.mlp", range(2)),
            "layer": each("layers.{}", range(2)),
        },
    ),
    "vit_4x": (
        hf4_vit,
        {
            "attn": ["encoder.layer.0.attention"],
            "mlp": ["encoder.layer.0.intermediate", "encoder.layer.0.output"],
            "layer": ["encoder.layer.0"],
        },
    ),
    "timm_vit": (
        timm_vit,
        {
            "attn": each("blocks.{}.attn", range(2)),
            "mlp": each("blocks.{}.mlp", range(2)),
            "layer": ["blocks.0", "blocks.1"],
        },
    ),
    "mamba": (
        lambda: on_meta("MambaForCausalLM", "MambaConfig", state_size=4, **SSM),
        {"mamba": each("backbone.layers.{}.mixer", range(2)), "layer": each("backbone.layers.{}", range(2))},
    ),
    "mamba2": (
        lambda: on_meta("Mamba2ForCausalLM", "Mamba2Config", state_size=4, num_heads=4, head_dim=16, n_groups=1, **SSM),
        {"mamba": each("backbone.layers.{}.mixer", range(2)), "layer": each("backbone.layers.{}", range(2))},
    ),
    "falcon_mamba": (  # FalconMambaMixer under the attribute ``mixer``: found by its class name
        lambda: on_meta("FalconMambaForCausalLM", "FalconMambaConfig", state_size=4, **SSM),
        {"mamba": each("backbone.layers.{}.mixer", range(2)), "layer": each("backbone.layers.{}", range(2))},
    ),
    "jamba": (  # mamba layers 0, 2 with a dense feed_forward; attention layers 1, 3 with an MoE feed_forward
        lambda: on_meta(
            "JambaForCausalLM",
            "JambaConfig",
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=4,
            **DECODER,
        ),
        {
            "attn": each("model.layers.{}.self_attn", [1, 3]),
            "mlp": each("model.layers.{}.feed_forward", [0, 2]),
            "moe": each("model.layers.{}.feed_forward", [1, 3]),
            "moe_router": each("model.layers.{}.feed_forward.router", [1, 3]),
            "mamba": each("model.layers.{}.mamba", [0, 2]),
            "layer": each("model.layers.{}", range(4)),
        },
    ),
    "nemotron_h": (  # every layer's block is ``mixer``: Mamba2, attention, MLP, MoE, told apart by class
        lambda: on_meta(
            "NemotronHForCausalLM",
            "NemotronHConfig",
            num_hidden_layers=4,
            hybrid_override_pattern="M*-E",
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=4,
            n_groups=1,
            n_routed_experts=4,
            moe_shared_expert_intermediate_size=16,
            n_group=1,
            topk_group=1,
            **DECODER,
            **MOE,
        ),
        {
            "attn": ["model.layers.1.mixer"],
            "mlp": ["model.layers.2.mixer"],
            "moe": ["model.layers.3.mixer"],
            "moe_router": ["model.layers.3.mixer.gate"],
            "mamba": ["model.layers.0.mixer"],
            "layer": each("model.layers.{}", range(4)),
        },
    ),
}


@functools.cache
def build(layout: str) -> nn.Module:
    return LAYOUTS[layout][0]()


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_what_each_scope_finds(layout, scope):
    model = build(layout)
    expected = LAYOUTS[layout][1].get(scope)
    if expected is not None:
        assert names(resolve_scopes(model, [scope])) == expected
        return
    refusal = "is not supported" if scope == "moe_preprocess" else f"scope {scope!r} matches no module"
    with pytest.raises(ValueError, match=refusal):
        resolve_scopes(model, [scope])


def test_mlp_on_an_moe_model_is_refused_and_the_error_names_moe():
    with pytest.raises(ValueError, match="'mlp' matches no module of Qwen3MoeForCausalLM") as error:
        resolve_scopes(build("qwen3_moe"), ["attn", "mlp"])
    assert "built-in ones here: attn, moe, moe_router, layer" in str(error.value)
    assert "Fix: drop 'mlp' (its feed-forward blocks are MoE blocks: ask for 'moe')" in str(error.value)


@pytest.mark.parametrize("layout", ["qwen3_moe", "megatron"])
def test_moe_preprocess_is_refused_where_no_layout_has_one(layout):
    with pytest.raises(ValueError, match="moe_preprocess") as error:
        resolve_scopes(build(layout), ["moe_router", "moe_preprocess"], component="CUDAGraphStrategy")
    message = str(error.value)
    assert message.startswith("CUDAGraphStrategy: `scope=['moe_router', 'moe_preprocess']` is not supported.")
    assert "token dispatcher is not an nn.Module" in message
    assert "Fix: drop 'moe_preprocess' and keep 'moe_router' alone" in message
    assert "modules={'moe_preprocess':" in message


def test_moe_preprocess_override_is_the_escape_hatch():
    overrides = {"moe_preprocess": ["model.layers.*.mlp.experts"]}
    resolution = resolve_scopes(build("mixtral"), ["moe_router", "moe_preprocess"], overrides)
    assert [(t.name, t.scope) for t in resolution.targets] == [
        ("model.layers.0.mlp.gate", "moe_router"),
        ("model.layers.0.mlp.experts", "moe_preprocess"),
        ("model.layers.1.mlp.gate", "moe_router"),
        ("model.layers.1.mlp.experts", "moe_preprocess"),
    ]


def test_attn_and_moe_interleave_in_model_order_and_fold_into_layers():
    model = build("qwen3_moe")
    resolution = resolve_scopes(model, ["moe", "attn"])
    assert [(t.name, t.scope) for t in resolution.targets[:2]] == [
        ("model.layers.0.self_attn", "attn"),
        ("model.layers.0.mlp", "moe"),
    ]
    assert type(resolution.targets[1].module).__name__ == "Qwen3MoeSparseMoeBlock"
    folded = resolve_scopes(model, ["layer", "moe_router"])
    assert names(folded) == ["model.layers.0", "model.layers.1"]
    assert folded.nested == {"model.layers.0.mlp.gate": "model.layers.0", "model.layers.1.mlp.gate": "model.layers.1"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_auto_ladder_on_real_layouts(layout):
    model = build(layout)
    found, order = LAYOUTS[layout][1], [name for name, _ in model.named_modules()]
    levels = build_levels(model, {}, whole_step_problem=None)
    assert [level.name for level in levels] == [*LEVEL_SCOPES, "model", "full_iteration"]
    whole = levels[-2]
    if whole.unavailable is None:  # the model level holds every trainable parameter in its regions
        held = {id(p) for target in whole.targets for p in target.module.parameters()}
        assert all(id(p) in held for p in model.parameters() if p.requires_grad)
    else:
        known = ("trainable parameters outside", "the same modules as", "no submodule")
        assert whole.unavailable.startswith(known), whole
    previous = None
    for level in levels[:-2]:
        names = {name for scope in LEVEL_SCOPES[level.name] for name in found.get(scope, [])}
        expected = sorted(names, key=order.index)
        if not expected:
            assert level.unavailable.startswith("no "), level
        elif expected == previous:
            assert level.unavailable.startswith("the same modules as"), level
        else:
            assert [t.name for t in level.targets] == expected
            previous = expected


def _in_layers(**children: nn.Module) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([named_class("DecoderLayer", **children)])
    return model


@pytest.mark.parametrize(
    ("model", "scope", "expected"),
    [
        pytest.param(
            _in_layers(mixer=named_class("AcmeMoE", w_in=nn.Linear(4, 8))), "moe", ["layers.0.mixer"], id="moe-by-class"
        ),
        pytest.param(
            _in_layers(mlp=named_class("SwitchSparseMLP", router=nn.Linear(4, 2), experts=nn.ModuleList())),
            "moe",
            ["layers.0.mlp"],
            id="router-and-experts-are-moe",
        ),
        pytest.param(
            _in_layers(moe=named_class("Block", scorer=named_class("AcmeTop2Router"), experts=nn.Linear(4, 4))),
            "moe_router",
            ["layers.0.moe.scorer"],
            id="router-by-class-in-moe",
        ),
        pytest.param(
            _in_layers(token_mixer=named_class("ZambaMambaMixer")), "mamba", ["layers.0.token_mixer"], id="mamba-mixer"
        ),
        pytest.param(_in_layers(xattn=named_class("CrossAttention")), "attn", ["layers.0.xattn"], id="attn-class"),
    ],
)
def test_class_suffixes_find_model_prefixed_classes(model, scope, expected):
    assert names(resolve_scopes(model, [scope])) == expected


@pytest.mark.parametrize(
    ("model", "scope"),
    [
        pytest.param(_in_layers(token_mixer=named_class("RepMixer")), "mamba", id="non-mamba-mixer"),
        pytest.param(_in_layers(density_router=named_class("DensityRouter")), "moe_router", id="router-outside-moe"),
        pytest.param(
            _in_layers(mlp=named_class("SwitchSparseMLP", router=nn.Linear(4, 2), experts=nn.ModuleList())),
            "mlp",
            id="moe-named-mlp",
        ),
        pytest.param(_in_layers(adapter=nn.Sequential(named_class("AdapterMLP"))), "mlp", id="mlp-class-not-in-layer"),
        pytest.param(_in_layers(attention=named_class("A", output=nn.Linear(4, 4))), "mlp", id="attention-output"),
    ],
)
def test_class_suffixes_do_not_over_match(model, scope):
    with pytest.raises(ValueError, match=f"scope {scope!r} matches no module"):
        resolve_scopes(model, [scope])


def test_preprocess_is_moe_preprocess_only_inside_an_moe_block():
    model = _in_layers(preprocess=nn.Identity(), moe=named_class("AcmeMoE", preprocess=nn.Identity()))
    assert resolve_scopes(model, ["moe_preprocess"]).matched == {"moe_preprocess": ["layers.0.moe.preprocess"]}

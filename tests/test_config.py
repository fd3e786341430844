"""Options and their validation: each rule is a ValueError naming the component, the value, what is allowed, the fix."""

import importlib.util
import os

import pytest
import torch.nn as nn

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy
from lightning_cudagraph._options.config import SCOPES, CUDAGraphConfig


@pytest.fixture(autouse=True)
def _no_allocator_env(monkeypatch):
    """Keep the allocator rule out of the other rules' way; the package may set NCCL_GRAPH_REGISTER, undo that."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "placeholder")  # recorded by monkeypatch, so restored afterwards
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")


def assert_config_error(error: pytest.ExceptionInfo, component: str, *fragments: str) -> None:
    message = str(error.value)
    assert message.startswith(f"{component}:"), message
    assert "Allowed:" in message, message
    assert "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, message


class Attention(nn.Module):
    pass


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        pytest.param({"impl": "cuda"}, ["impl='cuda'", "'none', 'local', 'transformer_engine'"], id="impl-unknown"),
        pytest.param({"scope": "bogus"}, ["'bogus'", *(repr(s) for s in SCOPES)], id="scope-unknown-lists-allowed"),
        pytest.param(
            {"scope": ["attn", "bogus"]}, ["'bogus'", "'attn'", "'mlp'", "'layer'"], id="scope-unknown-in-list"
        ),
        pytest.param({"scope": ["auto", "attn"]}, ["['auto', 'attn']", "'auto' alone"], id="scope-auto-mixed"),
        pytest.param({"scope": 3}, ["scope=3"], id="scope-not-a-string"),
        pytest.param({"scope": []}, ["scope=[]"], id="scope-empty"),
        pytest.param(
            {"scope": ["full_iteration", "attn"]},
            ["['full_iteration', 'attn']", "alone"],
            id="full-iteration-not-alone",
        ),
        pytest.param(
            {"scope": ["full_iteration"], "impl": "none"}, ["impl='none'", "'local'"], id="full-iteration-impl-none"
        ),
        pytest.param(
            {"scope": ["full_iteration"], "impl": "transformer_engine"},
            ["impl='transformer_engine'", "'local'"],
            id="full-iteration-impl-te",
        ),
        pytest.param(
            {"scope": ["full_iteration"], "warmup_steps": 0},
            ["warmup_steps=0", "at least 1"],
            id="full-iteration-no-warmup",
        ),
        pytest.param({"scope": ["moe", "moe_router"]}, ["['moe', 'moe_router']", "not both"], id="moe-with-router"),
        pytest.param({"scope": ["moe_preprocess"]}, ["['moe_preprocess']", "'moe_router'"], id="preprocess-no-router"),
        pytest.param(
            {"scope": ["moe", "moe_preprocess"]},
            ["['moe', 'moe_preprocess']", "'moe_router'"],
            id="preprocess-with-moe",
        ),
        pytest.param({"warmup_steps": -1}, ["warmup_steps=-1", ">= 0"], id="warmup-negative"),
        pytest.param({"warmup_steps": True}, ["warmup_steps=True"], id="warmup-bool"),
        pytest.param({"warmup_steps": 2.0}, ["warmup_steps=2.0"], id="warmup-float"),
        pytest.param({"max_graphs": 0, "on_shape_change": "recapture"}, ["max_graphs=0", ">= 1"], id="max-graphs-zero"),
        pytest.param(
            {"max_graphs": 1, "on_shape_change": "recapture"},
            ["max_graphs=1", "at least 2", "on_shape_change='eager'"],
            id="recapture-with-one-graph-set",
        ),
        pytest.param(
            {"max_graphs": 8},
            ["max_graphs=8", "only with on_shape_change='recapture'"],
            id="max-graphs-without-recapture",
        ),
        pytest.param({"confirm_steps": 0}, ["confirm_steps=0", ">= 1"], id="confirm-steps-zero"),
        pytest.param({"parity_tol": 0.0}, ["parity_tol=0.0", "(0, 0.25]"], id="parity-tol-zero"),
        pytest.param({"parity_tol": -1e-3}, ["parity_tol=-0.001"], id="parity-tol-negative"),
        pytest.param({"parity_tol": float("inf")}, ["parity_tol=inf", "(0, 0.25]"], id="parity-tol-inf"),
        pytest.param({"parity_tol": float("nan")}, ["parity_tol=nan"], id="parity-tol-nan"),
        pytest.param({"parity_tol": 22.0}, ["parity_tol=22.0", "wrong graph"], id="parity-tol-too-loose"),
        pytest.param({"max_pool_mib": 0}, ["max_pool_mib=0", "positive"], id="max-pool-zero"),
        pytest.param({"max_pool_mib": -512.0}, ["max_pool_mib=-512.0"], id="max-pool-negative"),
        pytest.param(
            {"on_shape_change": "ignore"},
            ["on_shape_change='ignore'", "'eager', 'recapture', 'error'"],
            id="on-shape-change-unknown",
        ),
        pytest.param({"on_failure": "warn"}, ["on_failure='warn'", "'eager', 'raise'"], id="on-failure-unknown"),
        pytest.param(
            {"modules": ["blocks.*.attn"]}, ["modules=['blocks.*.attn']", "mapping"], id="modules-not-mapping"
        ),
        pytest.param({"modules": {"attn": int}}, ["modules['attn']", "<class 'int'>", "nn.Module"], id="modules-class"),
        pytest.param({"modules": {"attn": 3}}, ["modules['attn']=3"], id="modules-not-a-selector"),
        pytest.param({"modules": {"attn": []}}, ["'attn'"], id="modules-empty-selectors"),
        pytest.param({"modules": {"auto": "blocks.*"}}, ["modules='auto'", "'auto'"], id="modules-auto-key"),
        pytest.param(
            {"modules": {"full_iteration": "blocks.*"}}, ["modules='full_iteration'"], id="modules-full-iteration-key"
        ),
    ],
)
def test_invalid_option_raises_readable_error(options, fragments):
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        CUDAGraphConfig.from_options("CUDAGraphCallback", **options)
    assert_config_error(error, "CUDAGraphCallback", *fragments)


@pytest.mark.parametrize(
    ("build", "component", "fragments"),
    [
        pytest.param(lambda: CUDAGraphCallback(impl="cuda"), "CUDAGraphCallback", ["impl='cuda'"], id="callback-impl"),
        pytest.param(
            lambda: CUDAGraphCallback(scope=["attn", "bogus"]), "CUDAGraphCallback", ["'bogus'"], id="callback-scope"
        ),
        pytest.param(
            lambda: CUDAGraphStrategy(scope=["moe", "moe_router"]),
            "CUDAGraphStrategy",
            ["['moe', 'moe_router']"],
            id="strategy-moe-with-router",
        ),
        pytest.param(
            lambda: CUDAGraphStrategy(warmup_steps=-2), "CUDAGraphStrategy", ["warmup_steps=-2"], id="strategy-warmup"
        ),
        pytest.param(
            lambda: DDPCUDAGraphStrategy(scope=["full_iteration"], warmup_steps=3),
            "DDPCUDAGraphStrategy",
            ["warmup_steps=3", ">= 11", "warmup_steps=11"],
            id="ddp-full-iteration-short-warmup",
        ),
        pytest.param(
            lambda: DDPCUDAGraphStrategy(on_failure="warn"),
            "DDPCUDAGraphStrategy",
            ["on_failure='warn'"],
            id="ddp-on-failure",
        ),
    ],
)
def test_public_classes_name_themselves_in_errors(build, component, fragments):
    with pytest.raises(ValueError, match=component) as error:
        build()
    assert_config_error(error, component, *fragments)


def test_ddp_full_iteration_with_enough_warmup_is_accepted():
    strategy = DDPCUDAGraphStrategy(scope=["full_iteration"], warmup_steps=11)
    assert strategy.cudagraph_config.full_iteration


def test_transformer_engine_missing_names_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "transformer_engine" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr("lightning_cudagraph._options.validation.importlib.util.find_spec", find_spec)
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        CUDAGraphCallback(impl="transformer_engine", scope=["layer"])
    assert_config_error(error, "CUDAGraphCallback", "impl='transformer_engine'", "pip install", "impl='local'")


def test_expandable_segments_with_nccl_graph_register_is_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    with pytest.raises(ValueError, match="CUDAGraphCallback") as error:
        CUDAGraphCallback()
    assert_config_error(error, "CUDAGraphCallback", "NCCL_GRAPH_REGISTER='1'", "NCCL_GRAPH_REGISTER=0")


def test_expandable_segments_sets_nccl_graph_register_when_unset(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert "NCCL_GRAPH_REGISTER" not in os.environ
    CUDAGraphConfig.from_options("CUDAGraphCallback")
    assert "NCCL_GRAPH_REGISTER" not in os.environ, "validation alone must not write the environment"
    CUDAGraphCallback()
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"


def test_strategies_apply_the_allocator_rule_too(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    for build in (CUDAGraphStrategy, DDPCUDAGraphStrategy):
        with pytest.raises(ValueError, match="NCCL_GRAPH_REGISTER") as error:
            build()
        assert_config_error(error, build.__name__, "NCCL_GRAPH_REGISTER='1'")


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"}, id="fixed"),
        pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "NCCL_GRAPH_REGISTER": "1"}, id="off"),
    ],
)
def test_allocator_settings_that_are_safe_pass(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    CUDAGraphCallback()


def test_impl_none_skips_the_allocator_rule(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    config = CUDAGraphCallback(impl="none").config
    assert not config.enabled


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        pytest.param("auto", ("auto",), id="auto"),
        pytest.param("attn", ("attn",), id="single-string"),
        pytest.param("attn,mlp", ("attn", "mlp"), id="comma-string"),
        pytest.param("attn, mlp", ("attn", "mlp"), id="comma-string-spaces"),
        pytest.param(["mlp", "attn", "mlp"], ("mlp", "attn"), id="duplicates-removed-order-kept"),
        pytest.param(("layer",), ("layer",), id="tuple"),
        pytest.param(["full_iteration"], ("full_iteration",), id="full-iteration"),
        pytest.param(["moe_router", "moe_preprocess"], ("moe_router", "moe_preprocess"), id="router-preprocess"),
    ],
)
def test_scope_is_normalised_to_a_tuple(scope, expected):
    config = CUDAGraphConfig.from_options("CUDAGraphCallback", scope=scope)
    assert config.scope == expected
    assert config.auto_scope == (expected == ("auto",))
    assert config.full_iteration == (expected == ("full_iteration",))


def test_modules_values_become_tuples_and_define_new_scopes():
    def is_head(name, module):
        return name == "head"

    config = CUDAGraphConfig.from_options(
        "CUDAGraphCallback",
        scope=["attn", "head", "extra"],
        modules={"attn": "blocks.*.attn", "head": [is_head, nn.Linear], "extra": Attention},
    )
    assert config.modules == {"attn": ("blocks.*.attn",), "head": (is_head, nn.Linear), "extra": (Attention,)}
    assert config.scope == ("attn", "head", "extra")


def test_custom_scope_is_listed_as_allowed_when_another_is_unknown():
    with pytest.raises(ValueError, match="'head'") as error:
        CUDAGraphConfig.from_options("CUDAGraphCallback", scope=["head", "tail"], modules={"head": "head"})
    assert_config_error(error, "CUDAGraphCallback", "'tail'")


def test_defaults_and_options_round_trip():
    config = CUDAGraphConfig.from_options("CUDAGraphCallback")
    assert (config.impl, config.scope, config.warmup_steps) == ("local", ("auto",), 3)
    assert config.enabled
    assert config.eager_steps == 3
    assert CUDAGraphConfig.from_options("CUDAGraphCallback", warmup_steps=0).eager_steps == 1
    assert config.graph_set_limit == 1
    custom = CUDAGraphConfig.from_options(
        "CUDAGraphCallback",
        scope="attn,mlp",
        modules={"attn": "blocks.*.attn"},
        on_shape_change="recapture",
        max_graphs=2,
        parity_tol=1e-3,
    )
    assert custom.graph_set_limit == 2
    assert CUDAGraphConfig.from_options("CUDAGraphCallback", on_shape_change="recapture").graph_set_limit == 4
    assert CUDAGraphConfig.from_options("CUDAGraphCallback", **custom.options()) == custom
    assert CUDAGraphConfig.from_options("CUDAGraphCallback", **config.options()) == config


def test_public_classes_keep_the_normalised_config():
    assert CUDAGraphCallback(scope="attn,mlp", warmup_steps=5).config.scope == ("attn", "mlp")
    strategy = CUDAGraphStrategy(scope="layer", modules={"layer": ["blocks.*"]})
    assert strategy.cudagraph_config.scope == ("layer",)
    assert strategy.cudagraph_config.modules == {"layer": ("blocks.*",)}

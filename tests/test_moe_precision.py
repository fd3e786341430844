"""Hugging Face MoE experts under the Trainer's precision: the check before capture, and the autocast experts path.

transformers' ``grouped_mm`` experts run their grouped GEMMs in the weights' dtype. ``torch._grouped_mm`` keeps only
bfloat16 on the device, so under ``32-true``, ``bf16-mixed`` and ``16-mixed`` a capture of the experts fails. Preflight
names the precision, the experts module and the fix before any capture. ``use_autocast_experts`` runs the GEMMs in
autocast's dtype, so ``bf16-mixed`` captures the whole step. The CPU cannot show the host read itself: these tests
check the reasons, the planning, the path's arithmetic, and whole-step fits through the fake backend.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_cudagraph import CUDAGraphStrategy, Stage
from lightning_cudagraph._rollout.moe_precision import experts_precision_problem, find_experts_problem
from lightning_cudagraph._trust.capture_hints import capture_failure
from lightning_cudagraph.experts import AUTOCAST_GROUPED_MM, use_autocast_experts
from tests.fake_backend import FakeBackend
from tests.helpers import LossRecorder, assert_losses_close, graph_callback, trainer
from tests.models import TokenData

#: The transformers release these tests were written and run against (its experts registry and MoE layouts).
transformers = pytest.importorskip("transformers", minversion="5.25")

CPU = {"accelerator": "cpu", "devices": 1}
#: Config and model classes of each family, and its MoE fields (4 experts, top-2; Qwen2-MoE has a shared expert).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "intermediate_size": 32}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    ),
}
#: The CPU size: 2 layers, hidden 64, vocabulary 128, sequence 16, batch 4.
SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
}
SEQ_LEN, BATCH_SIZE = 16, 4
EXPERTS = "model.model.layers.0.mlp.experts"
PATH = "lightning_cudagraph.experts.use_autocast_experts(model)"
#: Whole step against eager, both with the path. Up to the capture they are equal to the bit (the fake replays the
#: recorded operations). The captured AdamW (capturable form, tensor lr) moves the float32 weights by ~1e-7 from
#: eager's, and a bfloat16 cast of a weight that lands on the other side of a rounding changes it by 2**-8 relative:
#: the losses then part by up to 7e-5 over 6 steps on the CPU.
TOLERANCE = 3e-4


class MoELM(pl.LightningModule):
    """A transformers MoE causal LM (``model``) trained on next-token prediction with AdamW.

    ``aux`` turns the router's auxiliary loss on (``output_router_logits``): the model adds it to ``.loss``.
    ``autocast_experts`` switches the experts to the package's autocast path.
    """

    def __init__(self, family: str, aux: bool = True, autocast_experts: bool = False, **sizes: Any) -> None:
        super().__init__()
        config_class, model_class, moe = FAMILIES[family]
        options = {**SIZES, "intermediate_size": 128, **moe, "num_experts_per_tok": 2, **sizes}
        config = getattr(transformers, config_class)(
            **options,
            output_router_logits=aux,
            router_aux_loss_coef=0.01,
            use_cache=False,
            attention_dropout=0.0,
            attn_implementation="sdpa",
        )
        self.model = getattr(transformers, model_class)(config)
        if autocast_experts:
            use_autocast_experts(self.model)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def moe_lm(family: str, seq_len: int = SEQ_LEN, batch_size: int = BATCH_SIZE, **options: Any) -> tuple[MoELM, Any]:
    """A model of ``family`` seeded with 0, and its data; ``options`` go to :class:`MoELM`."""
    pl.seed_everything(0, verbose=False)
    data = TokenData(vocab_size=SIZES["vocab_size"], seq_len=seq_len, batch_size=batch_size, train_samples=256)
    return MoELM(family, **options), data


# =================================================================== the check
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_grouped_mm_experts_in_float32_are_named_with_the_precision_and_the_fix(family, precision):
    model, _ = moe_lm(family)
    problem = find_experts_problem(model, precision)
    assert problem is not None
    assert problem.names == (EXPERTS, "model.model.layers.1.mlp.experts")
    assert (problem.implementation, problem.dtype) == ("grouped_mm", torch.float32)
    reason = problem.reason
    assert reason.startswith(
        f"moe_precision: {EXPERTS} (and 1 more experts modules) runs transformers' grouped_mm experts in float32"
        f" under precision={precision!r} (transformers casts the experts' input to the weights' dtype), and"
        " torch._grouped_mm's float32 path reads the group offsets on the host, which a graph cannot hold. Fix:"
        " precision='bf16-true', or "
    ), reason
    assert PATH in reason


def test_under_bf16_mixed_the_fix_says_the_path_changes_the_experts_arithmetic():
    model, _ = moe_lm("qwen3_moe")
    reason = experts_precision_problem(model, "bf16-mixed")
    assert reason is not None
    assert reason.endswith(
        f"Fix: precision='bf16-true', or {PATH} before the fit, which runs the grouped GEMMs in autocast's bfloat16"
        " (opt-in: eager training with it runs bfloat16 experts, where this run's eager training has float32)"
    ), reason


def test_float16_weights_are_named_too():
    model, _ = moe_lm("qwen3_moe")
    problem = find_experts_problem(model, "16-true")
    assert problem is not None and problem.dtype == torch.float16
    assert "runs transformers' grouped_mm experts in float16 under precision='16-true'" in problem.reason


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_true_and_the_path_under_bf16_mixed_pass(family):
    model, _ = moe_lm(family)
    assert experts_precision_problem(model, "bf16-true") is None
    use_autocast_experts(model)
    assert experts_precision_problem(model, "bf16-mixed") is None


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("32-true", torch.float32)], ids=["16-mixed", "32-true"]
)
def test_the_path_outside_bf16_autocast_is_named_with_its_fix(precision, dtype):
    model, _ = moe_lm("qwen3_moe", autocast_experts=True)
    problem = find_experts_problem(model, precision)
    assert problem is not None and (problem.implementation, problem.dtype) == (AUTOCAST_GROUPED_MM, dtype)
    assert (
        f"runs the package's autocast experts path in {str(dtype)[6:]} under precision={precision!r}" in problem.cause
    )
    assert problem.fix == (
        "precision='bf16-mixed' (the path then runs the grouped GEMMs in bfloat16), or precision='bf16-true'"
    )


@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
def test_experts_without_grouped_gemms_are_not_this_checks_concern(implementation):
    model, _ = moe_lm("qwen3_moe")
    model.model.set_experts_implementation(implementation)
    assert experts_precision_problem(model, "bf16-mixed") is None


def test_regions_without_the_experts_pass_and_a_layer_holding_them_does_not():
    model, _ = moe_lm("qwen3_moe")
    layers = model.model.model.layers
    attention = [layer.self_attn for layer in layers]
    routers = [layer.mlp.gate for layer in layers]
    assert experts_precision_problem(model, "bf16-mixed", attention + routers) is None
    problem = find_experts_problem(model, "bf16-mixed", [layers[1]])
    assert problem is not None and problem.names == ("model.model.layers.1.mlp.experts",)


def test_a_module_without_experts_passes():
    assert experts_precision_problem(torch.nn.Linear(4, 4), "bf16-mixed") is None


# =================================================================== the path
def test_use_autocast_experts_switches_every_experts_module_and_registers_the_name():
    model, _ = moe_lm("qwen3_moe")
    assert use_autocast_experts(model) == [EXPERTS, "model.model.layers.1.mlp.experts"]
    assert model.model.config._experts_implementation == AUTOCAST_GROUPED_MM
    model.model.set_experts_implementation("grouped_mm")
    model.model.set_experts_implementation(AUTOCAST_GROUPED_MM)  # transformers' own check accepts the name
    assert model.model.model.layers[0].mlp.experts.config._experts_implementation == AUTOCAST_GROUPED_MM


def test_use_autocast_experts_refuses_a_model_without_experts():
    with pytest.raises(ValueError, match=r"^lightning_cudagraph.experts.use_autocast_experts: Linear holds no"):
        use_autocast_experts(torch.nn.Linear(4, 4))


def routed(experts: torch.nn.Module, tokens: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, top-2 expert indices and weights for ``tokens`` tokens, every expert used."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, SIZES["hidden_size"], generator=generator)
    index = torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=-1)
    weights = torch.rand(tokens, 2, generator=generator).softmax(-1)
    return hidden, index, weights


@pytest.mark.parametrize("family", list(FAMILIES))
def test_under_autocast_the_path_is_grouped_mm_on_bfloat16_weights(family):
    """Bitwise: the path's experts equal transformers' grouped_mm on a bfloat16 copy (bf16-true's arithmetic)."""
    model, _ = moe_lm(family, autocast_experts=True)
    experts = model.model.model.layers[0].mlp.experts
    reference = copy.deepcopy(experts).to(torch.bfloat16)
    reference.config = copy.copy(experts.config)
    reference.config._experts_implementation = "grouped_mm"
    hidden, index, weights = routed(experts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(hidden, index, weights)
    assert out.dtype == torch.float32, "the output keeps the input's dtype, as grouped_mm's"
    torch.testing.assert_close(out, reference(hidden, index, weights), rtol=0, atol=0)


def test_under_autocast_the_path_matches_a_loop_over_the_experts_in_bfloat16():
    """Against a reference written out: each token's two experts, bfloat16 GEMMs, weighted sum in float32."""
    model, _ = moe_lm("qwen3_moe", autocast_experts=True)
    experts = model.model.model.layers[0].mlp.experts
    hidden, index, weights = routed(experts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(hidden, index, weights)
    expected = torch.zeros_like(hidden)
    gate_up, down = experts.gate_up_proj.detach().bfloat16(), experts.down_proj.detach().bfloat16()
    for token in range(hidden.size(0)):
        for k in range(2):
            e = int(index[token, k])
            gate, up = (hidden[token].bfloat16() @ gate_up[e].T).chunk(2, dim=-1)
            expected[token] += (experts.act_fn(gate) * up @ down[e].T).float() * weights[token, k]
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # bfloat16 rounds at 2**-8 relative


def test_without_autocast_the_path_is_grouped_mm_exactly():
    model, _ = moe_lm("qwen3_moe", autocast_experts=True)
    experts = model.model.model.layers[0].mlp.experts
    hidden, index, weights = routed(experts)
    out = experts(hidden, index, weights)
    experts.config._experts_implementation = "grouped_mm"
    assert torch.equal(out, experts(hidden, index, weights))


def test_gradients_reach_the_float32_weights_through_the_casts():
    model, _ = moe_lm("qwen3_moe", autocast_experts=True)
    experts = model.model.model.layers[0].mlp.experts
    hidden, index, weights = routed(experts)
    hidden.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts(hidden, index, weights).square().sum().backward()
    for parameter in (experts.gate_up_proj, experts.down_proj):
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32
        assert parameter.grad.abs().sum() > 0
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_a_failed_capture_of_grouped_mm_experts_names_them_and_the_bfloat16_fix():
    """What preflight cannot foresee (another GPU than sm_90 or sm_100) still gets the cause and the fix."""
    model, _ = moe_lm("qwen3_moe")
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor")
    reason = capture_failure(error, model)
    assert reason.startswith("capture_failed: RuntimeError: Cannot copy between CPU and CUDA tensors"), reason
    assert f"{EXPERTS} runs Hugging Face's grouped_mm MoE experts, and torch._grouped_mm keeps" in reason, reason
    assert reason.endswith(f"precision='bf16-true', or precision='bf16-mixed' with {PATH}"), reason


def test_a_host_sync_elsewhere_is_not_blamed_on_grouped_mm_experts():
    model, _ = moe_lm("qwen3_moe")
    error = RuntimeError("operation not permitted when stream is capturing: aten::_local_scalar_dense")
    assert capture_failure(error, model) == f"capture_failed: RuntimeError: {error}"


# =================================================================== fits (preflight, before any capture)
def whole_step(warmup_steps: int = 2) -> CUDAGraphStrategy:
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=warmup_steps)
    strategy.capture_backend = FakeBackend()
    return strategy


@pytest.fixture
def capture_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' path under a CUDA stream capture, for every step: no host checks, the same operations.

    While a stream captures, transformers skips a host check of the positions (a packed-sequence test) and builds the
    causal mask from them. The fake backend's capture is no stream capture, so every step, eager or captured, takes
    that path here: eager and graphed runs then run the same operations.
    """
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_fixed_whole_step_on_float32_experts_is_refused_before_any_capture(precision):
    model, data = moe_lm("qwen3_moe")
    strategy = whole_step()
    with pytest.raises(ValueError, match=r"^CUDAGraphStrategy: `Trainer\(precision=") as raised:
        trainer(4, strategy=strategy, precision=precision, **CPU).fit(model, data)
    message = str(raised.value)
    assert f"{EXPERTS} (and 1 more experts modules) runs transformers' grouped_mm experts in float32" in message
    assert "precision='bf16-true'" in message and PATH in message, message
    assert strategy.capture_backend.step_graphs == [] and not strategy.capture_backend.entered


def test_a_fixed_layer_scope_holding_float32_experts_is_warned_about_at_setup():
    """Regions are not refused: each is left out as its capture fails, with the cause (capture_hints)."""
    model, data = moe_lm("qwen3_moe")
    strategy = CUDAGraphStrategy(scope=["layer"], warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    runs = "runs transformers' grouped_mm experts in float32 under precision='bf16-mixed'"
    with pytest.warns(UserWarning, match=f"^CUDAGraphStrategy: the scope's regions hold MoE experts .*{runs}"):
        trainer(4, strategy=strategy, precision="bf16-mixed", **CPU).fit(model, data)


def test_a_fixed_scope_without_the_experts_trains_under_bf16_mixed():
    model, data = moe_lm("qwen3_moe")
    strategy = CUDAGraphStrategy(scope=["attn", "moe_router"], warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    trainer(4, strategy=strategy, precision="bf16-mixed", **CPU).fit(model, data)
    assert graph_callback(model.trainer).report.stage == Stage.REPLAYING


def test_auto_skips_the_levels_holding_float32_experts_with_the_reason():
    model, data = moe_lm("qwen3_moe")
    strategy = CUDAGraphStrategy(warmup_steps=2)
    strategy.capture_backend = FakeBackend()
    trainer(4, strategy=strategy, precision="bf16-mixed", **CPU).fit(model, data)
    ladder = {row.level: row for row in graph_callback(model.trainer).report.ladder}
    for level in ("layer", "model", "full_iteration"):
        assert ladder[level].status == "skipped", (level, ladder[level])
        assert ladder[level].reason.startswith(f"moe_precision: {EXPERTS}"), ladder[level].reason
    assert ladder["attn"].status != "skipped"


# =================================================================== whole-step fits with the path
def fit_losses(family: str, aux: bool, graphs: bool, steps: int = 6) -> tuple[list[float], Any]:
    """Losses of a ``bf16-mixed`` fit with the path: eager, or the whole step through the fake backend."""
    model, data = moe_lm(family, aux=aux, autocast_experts=True)
    recorder = LossRecorder()
    options: dict[str, Any] = {"strategy": whole_step()} if graphs else {}
    trainer(steps, [recorder], precision="bf16-mixed", **CPU, **options).fit(model, data)
    return recorder.losses, graph_callback(model.trainer).report if graphs else None


@pytest.mark.parametrize("aux", [True, False], ids=["aux_loss", "no_aux_loss"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.usefixtures("capture_path")
def test_the_whole_step_with_the_path_under_bf16_mixed_trains_as_eager_with_the_path(family, aux):
    eager, _ = fit_losses(family, aux, graphs=False)
    graphed, report = fit_losses(family, aux, graphs=True)
    assert report.stage == Stage.REPLAYING, report.reason
    assert report.captures == 1 and report.replays == 6 - 2 and report.rollbacks == 0
    assert_losses_close(eager, graphed, TOLERANCE)

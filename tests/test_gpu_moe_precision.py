"""Hugging Face MoE models under ``bf16-mixed`` on a GPU: the whole step with the autocast experts path, and the reason
given before any capture without it. Run with `pytest -m cuda`.

transformers' ``grouped_mm`` experts run in the weights' dtype: float32 under ``bf16-mixed``, where
``torch._grouped_mm`` reads the group offsets on the host. ``use_autocast_experts`` runs them in bfloat16, whose kernel
(sm_90, sm_100) stays on the device. The graphed runs are compared with eager training that uses the path too.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_cudagraph import CUDAGraphStrategy, Stage
from tests.helpers import assert_losses_close, fit_cuda, graph_callback, patched_forwards
from tests.test_moe_precision import EXPERTS, PATH, moe_lm

pytest.importorskip("transformers")
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

STEPS, WARMUP = 12, 3
SEQ_LEN, BATCH_SIZE = 64, 8
#: Eager and graphed runs do the same arithmetic (bfloat16 experts GEMMs, transformers' capture-path causal mask).
#: They part by AdamW's capturable form (~1e-7 on the float32 weights) and nondeterministic kernels (the embedding's
#: and the experts' gather backward): each flips the bfloat16 rounding (2**-8 relative) of a few activations, which
#: moves a mean loss of ~4.8 by 1e-4 to 1e-3 over 12 steps. One training step moves it by more than 1e-2.
TOLERANCE = 2e-3


@pytest.fixture(autouse=True)
def _sm90_or_sm100() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm keeps bfloat16 on the device on sm_90 and sm_100 only")


@pytest.fixture(autouse=True)
def _capture_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step, eager or captured, builds the causal mask as transformers does under a stream capture.

    While a stream captures, transformers skips a host check of the positions and builds the mask from them; eager
    steps otherwise let SDPA apply it (another kernel). With this, eager training runs the captured step's operations.
    """
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)


@functools.cache
def eager_losses(family: str, aux: bool) -> tuple[float, ...]:
    """Per-step losses of eager ``bf16-mixed`` training with the path (once per model and process)."""
    model, data = moe_lm(family, SEQ_LEN, BATCH_SIZE, aux=aux, autocast_experts=True)
    return tuple(fit_cuda(model, data, STEPS, precision="bf16-mixed").losses)


@pytest.mark.parametrize(
    ("family", "aux"),
    [
        pytest.param("qwen3_moe", True, id="qwen3_moe-aux_loss"),
        pytest.param("qwen3_moe", False, id="qwen3_moe-no_aux_loss"),
        pytest.param("olmoe", True, id="olmoe-aux_loss"),
        pytest.param("mixtral", True, id="mixtral-aux_loss"),
        pytest.param("qwen2_moe", True, id="qwen2_moe_shared_expert-aux_loss"),
    ],
)
def test_the_whole_step_with_the_path_under_bf16_mixed_matches_eager_with_the_path(family, aux):
    model, data = moe_lm(family, SEQ_LEN, BATCH_SIZE, aux=aux, autocast_experts=True)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
    graphed = fit_cuda(model, data, STEPS, strategy=strategy, precision="bf16-mixed")
    report = graph_callback(graphed.trainer).report
    assert report.stage == Stage.REPLAYING, report.reason
    assert (report.captures, report.replays, report.rollbacks, report.fallbacks) == (1, STEPS - WARMUP, 0, 0)
    assert_losses_close(list(eager_losses(family, aux)), graphed.losses, TOLERANCE)
    assert patched_forwards(graphed.model) == []


def test_without_the_path_a_fixed_whole_step_is_refused_before_any_capture():
    model, data = moe_lm("qwen3_moe", SEQ_LEN, BATCH_SIZE)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP)
    runs = "runs transformers' grouped_mm experts in float32 under precision='bf16-mixed'"
    with pytest.raises(ValueError, match=runs):  # from setup: no step ran, no capture was tried
        fit_cuda(model, data, STEPS, strategy=strategy, precision="bf16-mixed")


def test_without_the_path_auto_skips_the_levels_holding_the_experts_with_the_reason():
    model, data = moe_lm("qwen3_moe", SEQ_LEN, BATCH_SIZE)
    run = fit_cuda(model, data, STEPS, strategy=CUDAGraphStrategy(warmup_steps=WARMUP), precision="bf16-mixed")
    report = graph_callback(run.trainer).report
    ladder = {row.level: row for row in report.ladder}
    for level in ("layer", "model", "full_iteration"):
        assert ladder[level].status == "skipped", (level, ladder[level])
        assert ladder[level].reason.startswith(f"moe_precision: {EXPERTS}") and PATH in ladder[level].reason
    assert report.rollbacks == 0, report.rollback_reasons
    assert not any("Cannot copy" in reason for reason in report.exclusions.values()), report.exclusions


def capture_error(dtype: torch.dtype) -> str | None:
    """Capture one grouped GEMM in ``dtype`` (after an eager warmup): the error it raises, or ``None``."""
    a = torch.randn(64, 32, device="cuda", dtype=dtype)
    b = torch.randn(4, 32, 48, device="cuda", dtype=dtype)
    offs = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
    torch._grouped_mm(a, b, offs=offs)
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as error:
        return str(error)
    finally:
        torch.cuda.synchronize()
    return None


def test_grouped_mm_captures_in_bfloat16_and_reads_the_host_in_float32():
    """The premise of the check, on this GPU and torch: float32 grouped GEMMs fail a capture, bfloat16 ones do not.

    Last in the file: the failed capture is the last CUDA work of the module.
    """
    assert capture_error(torch.bfloat16) is None
    error = capture_error(torch.float32)
    assert error is not None and "Cannot copy between CPU and CUDA" in error, error

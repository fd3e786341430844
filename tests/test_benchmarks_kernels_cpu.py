"""``benchmarks/kernels.py``: kernel classes by name and the per-step summary a profiler window gives."""

from __future__ import annotations

import pytest

from benchmarks.kernels import FLOOR_CLASSES, kernel_class, kernel_summary


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_tst_64x48_64x15_2x4_h_bz_NNT", "gemm"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nt_align1>", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("fmha_cutlassB_f32_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", "attention"),
        ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", "optimizer"),
        ("triton_per_fused__to_copy_native_layer_norm_backward_view_3", "other"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>", "other"),
        ("Memset (Unknown)", "other"),
    ],
)
def test_kernels_are_classed_by_name(name, kind):
    assert kernel_class(name) == kind


def test_summary_per_step_with_the_floor_of_what_compile_leaves():
    kernels = [("nvjet_a", 400.0), ("fmha_b", 200.0), ("multi_tensor_apply_kernel", 100.0), ("triton_c", 300.0)] * 2
    summary = kernel_summary(kernels, steps=2)
    assert summary["kernels"] == 4.0
    assert summary["kernel_ms"] == pytest.approx(1.0)
    assert summary["by_class_ms"] == pytest.approx({"gemm": 0.4, "attention": 0.2, "optimizer": 0.1, "other": 0.3})
    assert summary["floor_ms"] == pytest.approx(sum(summary["by_class_ms"][kind] for kind in FLOOR_CLASSES))
    assert summary["floor_ms"] == pytest.approx(0.7)


def test_summary_of_no_step_is_refused():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        kernel_summary([], steps=0)

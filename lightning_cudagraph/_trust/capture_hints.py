"""What a failed capture means in a layout the package knows, and its fix.

A host sync fails a capture with an error that names the operation, not the module or the fix. For a known layout the
reason names both: Hugging Face's eager MoE experts, whose loop reads the routing on the host, and its ``grouped_mm``
experts outside bfloat16 on sm_90 or sm_100, where ``torch._grouped_mm`` reads the group offsets on the host.
"""

from __future__ import annotations

import torch

from lightning_cudagraph._options.experts_layout import (
    AUTOCAST_GROUPED_MM,
    expert_weights,
    experts_implementation,
    experts_modules,
)

__all__ = ["capture_failure", "known_cause"]

#: Words of the errors a host sync inside a capture raises (CUDA's, and the CPU test double's).
_HOST_SYNC = ("operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported")
#: Words of the error a copy to the host inside a capture raises (``torch._grouped_mm`` outside its bfloat16 kernel).
_HOST_COPY = "Cannot copy between CPU and CUDA tensors"


def capture_failure(error: BaseException, module: torch.nn.Module | None) -> str:
    """The reason of a failed capture of ``module``: the error, then the cause and the fix where the layout is known."""
    reason = f"capture_failed: {type(error).__name__}: {error}"
    if module is None:
        return reason
    text = str(error)
    known = known_cause(module) if any(words in text for words in _HOST_SYNC) else None
    if known is None and _HOST_COPY in text:
        known = _grouped_cause(module)
    return reason if known is None else f"{reason}. {known[0]}. Fix: {known[1]}"


def known_cause(module: torch.nn.Module) -> tuple[str, str] | None:
    """The module inside ``module`` whose layout syncs with the host, as ``(cause, fix)``, or ``None``."""
    eager = next((name for name, inner in experts_modules(module) if experts_implementation(inner) == "eager"), None)
    if eager is None:
        return None
    return (
        f"{eager or 'the module'} runs Hugging Face's eager MoE experts, whose loop over the experts reads the routing"
        " on the host",
        "model.set_experts_implementation('grouped_mm') (or 'batched_mm') before the fit: both route on the device",
    )


def _grouped_cause(module: torch.nn.Module) -> tuple[str, str] | None:
    """Experts inside ``module`` that run ``torch._grouped_mm``, as ``(cause, fix)``, or ``None``.

    Preflight refuses the precisions that run them outside bfloat16; this names the rest (a GPU other than sm_90 or
    sm_100, a dtype preflight could not foresee).
    """
    for name, experts in experts_modules(module):
        implementation = experts_implementation(experts)
        if implementation in ("grouped_mm", AUTOCAST_GROUPED_MM) and expert_weights(experts) is not None:
            return (
                f"{name or 'the module'} runs Hugging Face's {implementation} MoE experts, and"
                " torch._grouped_mm keeps the group offsets on the device only in bfloat16 on sm_90 or sm_100 (it"
                " reads them on the host otherwise)",
                "run the experts in bfloat16 on an sm_90 or sm_100 GPU: precision='bf16-true', or"
                " precision='bf16-mixed' with lightning_cudagraph.experts.use_autocast_experts(model)",
            )
    return None

"""What a failed capture means in a layout the package knows, and its fix.

A host sync fails a capture with an error that names the operation, not the module or the fix. For a known layout
(Hugging Face's eager MoE experts, whose loop reads the routing on the host) the reason names both.
"""

from __future__ import annotations

import torch

__all__ = ["capture_failure", "known_cause"]

#: Words of the errors a host sync inside a capture raises (CUDA's, and the CPU test double's).
_HOST_SYNC = ("operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported")


def capture_failure(error: BaseException, module: torch.nn.Module | None) -> str:
    """The reason of a failed capture of ``module``: the error, then the cause and the fix where the layout is known."""
    reason = f"capture_failed: {type(error).__name__}: {error}"
    if module is None or not any(words in str(error) for words in _HOST_SYNC):
        return reason
    known = known_cause(module)
    return reason if known is None else f"{reason}. {known[0]}. Fix: {known[1]}"


def known_cause(module: torch.nn.Module) -> tuple[str, str] | None:
    """The module inside ``module`` whose layout syncs with the host, as ``(cause, fix)``, or ``None``."""
    eager = next((name for name, inner in module.named_modules() if _eager_experts(inner)), None)
    if eager is None:
        return None
    return (
        f"{eager or 'the module'} runs Hugging Face's eager MoE experts, whose loop over the experts reads the routing"
        " on the host",
        "model.set_experts_implementation('grouped_mm') (or 'batched_mm') before the fit: both route on the device",
    )


def _eager_experts(module: torch.nn.Module) -> bool:
    """A Hugging Face experts module (``use_experts_implementation``) that runs its eager loop."""
    config = getattr(module, "config", None)
    return hasattr(module, "has_gate") and getattr(config, "_experts_implementation", None) == "eager"

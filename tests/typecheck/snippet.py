"""What a user writes, type-checked by scripts/typecheck.sh (mypy): every public class built with keyword options.

The last function passes a keyword no class takes, and a value an option does not take. Their ``type: ignore``
comments must be used: the check runs with
``--warn-unused-ignores``, so it fails if the checker stops seeing the options as the keywords they are.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy

from lightning_cudagraph import (
    CUDAGraphCallback,
    CUDAGraphReport,
    CUDAGraphStrategy,
    DDPCUDAGraphStrategy,
    Stage,
    __version__,
)


def build() -> list[Callback | Strategy]:
    """Each public class with keyword options, as a user's training script builds them."""
    callback = CUDAGraphCallback(
        impl="local",
        scope=["attn", "mlp"],
        warmup_steps=3,
        modules={"attn": "blocks.*.attn"},
        on_shape_change="recapture",
        on_failure="raise",
        max_graphs=4,
        confirm_steps=2,
        parity_tol=1e-3,
        max_pool_mib=512.0,
        seal_after_steps=100,
        audit_every_n_steps=500,
        compile=False,
    )
    strategy = CUDAGraphStrategy(scope="layer", compile={"mode": "max-autotune-no-cudagraphs"})
    ddp = DDPCUDAGraphStrategy(scope=["full_iteration"], warmup_steps=11, find_unused_parameters=False)
    report: CUDAGraphReport = callback.report
    replaying: bool = report.stage is Stage.REPLAYING
    version: str = __version__
    assert isinstance(replaying, bool) and version
    return [callback, strategy, ddp]


def mistaken() -> list[CUDAGraphCallback]:
    """A keyword that is not an option, and a value an option does not take: the checker must report both."""
    return [
        CUDAGraphCallback(scopes=["attn"]),  # type: ignore[call-arg]
        CUDAGraphCallback(impl="cuda"),  # type: ignore[arg-type]
    ]

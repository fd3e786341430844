"""The package's warnings: one category, shown on rank zero at the line of the user's code that led to them.

A warning raised with ``warnings.warn`` and a fixed ``stacklevel`` points at whichever frame sits that many levels up.
From inside a Lightning hook that is a line of the package or of Lightning, which tells the user nothing.
``warn_user`` walks the stack instead.
It names the first frame outside torch, Lightning, this package and the standard library: the user's script, test or
LightningModule.
When no such frame exists (a thread of the package's own), the warning names ``<lightning_cudagraph>`` at line 0.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["CUDAGraphWarning", "user_frame", "warn_user"]

#: Top-level modules whose frames are not the user's code: the libraries a fit runs through, and this package.
INTERNAL_MODULES = frozenset(
    {
        "jsonargparse",
        "lightning",
        "lightning_cudagraph",
        "lightning_fabric",
        "lightning_utilities",
        "pytorch_lightning",
        "torch",
    }
)

#: The location a warning names when no frame of the stack is the user's.
NO_USER_FILE = "<lightning_cudagraph>"

_registry: dict[tuple[str, type[Warning], int] | str, int | bool] = {}


class CUDAGraphWarning(UserWarning):
    """A warning of lightning_cudagraph: graphs off, a rollback, a region or a batch shape left eager.

    Training goes on after each of them.
    It is a ``UserWarning``, so filters on ``UserWarning`` still apply.
    To silence only the package's warnings: ``warnings.filterwarnings("ignore", category=CUDAGraphWarning)``.
    """


def _internal(frame: FrameType) -> bool:
    """Whether a frame runs torch, Lightning, this package, the standard library or frozen import code."""
    name = frame.f_globals.get("__name__")
    if not isinstance(name, str):
        return frame.f_code.co_filename.startswith("<frozen ")
    top = name.partition(".")[0]
    return top in INTERNAL_MODULES or top in sys.stdlib_module_names


def user_frame(frame: FrameType | None = None) -> FrameType | None:
    """The innermost frame outside torch, Lightning, this package and the standard library, or ``None``.

    Args:
        frame: Where the walk starts; the caller of this function when not given.

    Returns:
        The first frame of the user's code, walking outwards, or ``None`` when the whole stack is internal.
    """
    current: FrameType | None = frame if frame is not None else sys._getframe(1)
    while current is not None and _internal(current):
        current = current.f_back
    return current


def warn_user(message: str, category: type[Warning] = CUDAGraphWarning, all_ranks: bool = False) -> None:
    """Warn once per user line on rank zero, as a ``CUDAGraphWarning`` pointing at the user's code.

    Python's warning filters decide what "once" means, as for ``warnings.warn``: with the default filters, a message is
    shown once per line of user code that leads to it.

    Args:
        message: What happened, and what training does now.
        category: The warning's class.
        all_ranks: Warn on every rank, not on rank zero alone (what each rank measured for itself).
    """
    if not all_ranks and getattr(rank_zero_only, "rank", 0) != 0:
        return
    frame = user_frame(sys._getframe(1))
    if frame is None:
        warnings.warn_explicit(message, category, NO_USER_FILE, 0, module="lightning_cudagraph", registry=_registry)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "__main__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )  # no module_globals: its loader may not serve the source (a spawned process's __main__)

"""The keyword boundary of the callback and both strategies: unknown keywords refused, errors shown first.

Every option is an explicit keyword parameter, so type checkers, IDEs and LightningCLI see them; this adds what a
plain signature cannot: the closest option named for an unknown keyword, and a clean exit under LightningCLI.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.errors import config_error, did_you_mean
from lightning_cudagraph._options.options import OPTIONS

__all__ = ["checks_keywords", "config_from"]

_Init = TypeVar("_Init", bound=Callable[..., None])
_NAMES = tuple(option.name for option in OPTIONS)


def config_from(component: str, parameters: Mapping[str, Any]) -> CUDAGraphConfig:
    """The config of the options among ``parameters`` (an ``__init__``'s ``locals()``), validated."""
    return CUDAGraphConfig.from_options(component, **{name: parameters[name] for name in _NAMES if name in parameters})


def checks_keywords(init: _Init) -> _Init:
    """Refuse an unknown keyword to ``init`` in the package's format, and exit cleanly under LightningCLI.

    With ``**kwargs`` (DDP's arguments), only a keyword close to an option, or ``capture_backend``, is refused.
    Under jsonargparse, a configuration error exits with the package's message: jsonargparse would bury the
    ``ValueError`` inside its Union traceback.
    """
    parameters = list(inspect.signature(init).parameters.values())[1:]
    accepted = [p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        component = type(self).__name__
        try:
            _refuse_unknown_keywords(component, kwargs, accepted, _NAMES if takes_any else None)
            init(self, *args, **kwargs)
        except ValueError as error:
            if _built_by_jsonargparse():
                raise SystemExit(str(error)) from error
            raise

    return wrapper  # type: ignore[return-value]


def _refuse_unknown_keywords(
    component: str, kwargs: Mapping[str, Any], accepted: Sequence[str], options: Sequence[str] | None
) -> None:
    """A keyword that is not a parameter (``options``: only those close to an option, for ``**kwargs`` classes)."""
    for name, value in kwargs.items():
        if name in accepted:
            continue
        close = did_you_mean(name, options if options is not None else accepted, cutoff=0.75)
        if options is not None and close is None and name != "capture_backend":
            continue  # passed on to the base class (DDP's arguments)
        if name == "capture_backend":
            instance = "strategy" if component.endswith("Strategy") else "callback"
            fix = (
                f"set it on the instance after construction: `{instance}.capture_backend = backend`"
                " (a CaptureBackend instance); it is not an option, so it stays out of LightningCLI and checkpoints"
            )
        else:
            fix = f"did you mean {close!r}?" if close is not None else "drop it, or pass one of the options above"
        raise config_error(component, name, value, f"the options {', '.join(accepted)}", fix)


def _built_by_jsonargparse() -> bool:
    """Whether jsonargparse (LightningCLI) is instantiating the class: it wraps every error in its Union message."""
    frame = sys._getframe(1)
    while True:
        module = frame.f_globals.get("__name__", "")
        if module == "jsonargparse" or module.startswith("jsonargparse."):
            return True
        if frame.f_back is None:
            return False
        frame = frame.f_back

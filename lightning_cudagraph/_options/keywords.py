"""The keyword boundary of the callback and both strategies: unknown keywords refused, errors shown first.

Every option is an explicit keyword parameter, so type checkers, IDEs and LightningCLI see them; this adds what a
plain signature cannot: the closest option named for an unknown keyword, and a clean exit under LightningCLI.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.errors import config_error, did_you_mean
from lightning_cudagraph._options.options import OPTIONS

__all__ = ["checks_keywords", "config_from"]

_Init = TypeVar("_Init", bound=Callable[..., None])
_NAMES = tuple(option.name for option in OPTIONS)


def config_from(component: str, parameters: Mapping[str, Any]) -> CUDAGraphConfig:
    """The config of the options among ``parameters`` (an ``__init__``'s ``locals()``), validated."""
    return CUDAGraphConfig.from_options(component, **{name: parameters[name] for name in _NAMES if name in parameters})


@overload
def checks_keywords(init: _Init) -> _Init: ...


@overload
def checks_keywords(
    init: None = None, *, passes_on: Sequence[type] = (), reserved: Mapping[str, str] | None = None
) -> Callable[[_Init], _Init]: ...


def checks_keywords(
    init: _Init | None = None, *, passes_on: Sequence[type] = (), reserved: Mapping[str, str] | None = None
) -> Any:
    """Refuse an unknown keyword to ``init`` in the package's format, and exit cleanly under LightningCLI.

    Used bare (``@checks_keywords``) or with arguments, for an ``__init__`` that takes ``**kwargs``:

    Args:
        init: The ``__init__`` to wrap.
        passes_on: The classes the ``**kwargs`` go to, in turn (``DDPStrategy``, whose own ``**kwargs`` go to
            ``DistributedDataParallel``): a keyword none of them takes is refused at construction, with the closest
            name, instead of a ``TypeError`` when the fit builds them. Without them (or when the last takes
            ``**kwargs`` too), only a keyword close to an option, or ``capture_backend``, is refused.
        reserved: Keywords of those classes that Lightning passes itself, with the fix (e.g. ``device_ids``).

    Under jsonargparse, a configuration error exits with the package's message: jsonargparse would bury the
    ``ValueError`` inside its Union traceback.
    """
    if init is None:
        return functools.partial(checks_keywords, passes_on=passes_on, reserved=reserved)
    parameters = list(inspect.signature(init).parameters.values())[1:]
    accepted = [p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    rules = _Keywords(accepted, takes_any, tuple(passes_on), dict(reserved or {}))

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        component = type(self).__name__
        try:
            rules.check(component, kwargs)
            init(self, *args, **kwargs)
        except ValueError as error:
            if _built_by_jsonargparse():
                raise SystemExit(str(error)) from error
            raise

    return wrapper


class _Keywords:
    """The keywords an ``__init__`` takes: its own, and those its ``**kwargs`` pass on to other classes."""

    def __init__(
        self, accepted: list[str], takes_any: bool, passes_on: tuple[type, ...], reserved: dict[str, str]
    ) -> None:
        self.accepted, self.reserved = accepted, reserved
        self.passed: dict[str, list[str]] = {}
        open_ended = takes_any
        for cls in passes_on:
            parameters = inspect.signature(cls).parameters.values()
            self.passed[cls.__name__] = [
                p.name
                for p in parameters
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in (*reserved, *accepted)
            ]
            open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters)
        #: Whether a keyword no class names may still be taken (then only one close to an option is refused).
        self.open_ended = open_ended
        self.known = [*accepted, *(name for names in self.passed.values() for name in names)]

    def check(self, component: str, kwargs: Mapping[str, Any]) -> None:
        """Raise the package's ``ValueError`` for the first keyword in ``kwargs`` that nothing takes."""
        for name, value in kwargs.items():
            if name in self.known:
                continue
            allowed = self._allowed()
            if name == "capture_backend":
                instance = "strategy" if component.endswith("Strategy") else "callback"
                fix = (
                    f"set it on the instance after construction: `{instance}.capture_backend = backend`"
                    " (a CaptureBackend instance); it is not an option, so it stays out of LightningCLI and checkpoints"
                )
                raise config_error(component, name, value, allowed, fix)
            if name in self.reserved:
                raise config_error(component, name, value, allowed, self.reserved[name])
            if self.open_ended:
                close = did_you_mean(name, _NAMES, cutoff=0.75)
                if close is None:
                    continue  # passed on to the base class, which takes any keyword
            else:
                close = did_you_mean(name, self.known)
            fix = f"did you mean {close!r}?" if close is not None else "drop it, or pass one of the keywords above"
            raise config_error(component, name, value, allowed, fix)

    def _allowed(self) -> str:
        passed = "".join(f"; {owner}'s {', '.join(names)}" for owner, names in self.passed.items())
        return f"the options {', '.join(self.accepted)}{passed}"


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

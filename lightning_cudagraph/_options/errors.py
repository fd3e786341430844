"""The one error format of the package: the component, the offending value, the allowed values, and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = ["Verbatim", "config_error", "did_you_mean"]


def config_error(component: str, option: str, value: Any, allowed: str, fix: str) -> ValueError:
    """Build the one error format of the package: component, value, allowed values, fix.

    A Trainer argument, named ``"Trainer(devices=...)"``, is shown as the user wrote it: ``Trainer(devices=2)``.

    Example:
        >>> str(config_error("CUDAGraphStrategy", "Trainer(devices=...)", 2, "one device", "pass devices=1"))
        'CUDAGraphStrategy: `Trainer(devices=2)` is not supported. Allowed: one device. Fix: pass devices=1'
    """
    shown = f"{option[: -len('...)')]}{value!r})" if option.endswith("=...)") else f"{option}={value!r}"
    return ValueError(f"{component}: `{shown}` is not supported. Allowed: {allowed}. Fix: {fix}")


class Verbatim(str):
    """A value shown in a message as written (no quotes), e.g. ``[CUDAGraphCallback(...), CUDAGraphCallback(...)]``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def did_you_mean(name: str, choices: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``name`` (case-insensitive), or ``None`` when none is close."""
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[close[0]] if close else None

"""Writes to watched module attributes, noted as they happen, so a check before a replay costs nothing until one.

Comparing every guarded attribute of a large model before every replay would walk its modules each step. Instead,
``nn.Module.__setattr__`` is wrapped while a :class:`WriteLog` is open: a write to a watched ``(module, name)`` is
noted with the line that wrote it, and any other write costs one dictionary lookup. The wrapper is removed when the
last log closes, so nothing of it outlives the graphs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from lightning_cudagraph._trust.reads import framework_file, line_of

__all__ = ["WriteLog"]

#: The logs open now; the wrapper is installed while there is one.
_OPEN: list[WriteLog] = []
_ORIGINAL = torch.nn.Module.__setattr__


def _noting_setattr(module: torch.nn.Module, name: str, value: Any) -> None:
    _ORIGINAL(module, name, value)
    for log in _OPEN:
        names = log.watched.get(id(module))
        if names is not None and name in names:
            log.written[(id(module), name)] = (module, name, _writer(sys._getframe(1)))


def _writer(frame: Any) -> str:
    """The first line outside torch, Lightning and this package on the writer's stack."""
    while frame is not None and framework_file(frame.f_code.co_filename):
        frame = frame.f_back
    return line_of(frame.f_code.co_filename, frame.f_lineno) if frame is not None else "torch or Lightning"


class WriteLog:
    """The writes to some modules' watched attributes since the last :meth:`clear`.

    Example:
        >>> import torch
        >>> drop = torch.nn.Dropout(0.1)
        >>> log = WriteLog({id(drop): {"p"}})
        >>> drop.p = 0.2
        >>> [(name, where.split(":")[0]) for _, name, where in log.written.values()]
        [('p', '<doctest lightning_cudagraph._trust.module_writes.WriteLog[3]>')]
        >>> log.close()
    """

    def __init__(self, watched: dict[int, set[str]]) -> None:
        #: Attribute names watched, by ``id`` of their module.
        self.watched = watched
        #: ``(module, name, line that wrote it)`` of the last write to each watched attribute since the last clear.
        self.written: dict[tuple[int, str], tuple[torch.nn.Module, str, str]] = {}
        if not _OPEN:
            torch.nn.Module.__setattr__ = _noting_setattr  # type: ignore[method-assign, assignment]
        _OPEN.append(self)

    def clear(self) -> None:
        """Forget the writes seen so far."""
        self.written.clear()

    def close(self) -> None:
        """Stop noting writes; the last log open puts ``nn.Module.__setattr__`` back (idempotent)."""
        if self in _OPEN:
            _OPEN.remove(self)
        if not _OPEN and torch.nn.Module.__setattr__ is _noting_setattr:
            torch.nn.Module.__setattr__ = _ORIGINAL  # type: ignore[method-assign]

"""Where user code reads the per-step values a graph would freeze: ``global_step``, ``current_epoch``, ``batch_idx``.

The counters are read through patched class properties of the LightningModule and the Trainer; ``batch_idx`` is an
``int`` that notes what user code does with it. Reads by torch, Lightning or this package are not noted.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["framework_file", "line_of", "reads_watched", "watched_index"]

#: Frames of torch, Lightning and this package are not the user's.
_PACKAGE_FILE = sys.modules[__name__.partition(".")[0]].__file__
_FRAMEWORK_DIRS = tuple(
    os.path.dirname(path) + os.sep
    for path in (torch.__file__, sys.modules[pl.__name__.partition(".")[0]].__file__, _PACKAGE_FILE)
    if path is not None
)
#: The per-step values of Lightning a graph would freeze, by the class attribute they are read through.
_PER_STEP = ("global_step", "current_epoch")


def framework_file(filename: str) -> bool:
    """Whether code in ``filename`` is torch's, Lightning's or this package's (not the user's)."""
    return filename.startswith(_FRAMEWORK_DIRS)


def line_of(filename: str, line: int) -> str:
    """``file:line: `source``` as messages name a line of code.

    Example:
        >>> line_of("no_such_file.py", 3)
        'no_such_file.py:3'
    """
    source = linecache.getline(filename, line).strip()
    return f"{os.path.basename(filename)}:{line}: `{source}`" if source else f"{os.path.basename(filename)}:{line}"


def _user_line(frame: FrameType | None) -> str | None:
    """``file:line: source`` of the first frame outside the framework, or ``None`` when the framework reads."""
    if frame is None or framework_file(frame.f_code.co_filename):
        return None
    return line_of(frame.f_code.co_filename, frame.f_lineno)


@contextlib.contextmanager
def reads_watched(module: pl.LightningModule | None, reads: dict[str, str]) -> Iterator[None]:
    """Note where user code reads ``global_step`` or ``current_epoch``, through the module or its Trainer."""
    if module is None:
        yield
        return
    trainer = module._trainer
    owners = [(type(module), "self"), *([(type(trainer), "trainer")] if trainer is not None else [])]
    patched: list[tuple[type, str, Any]] = []
    try:
        for owner, prefix in owners:
            for name in _PER_STEP:
                original = owner.__dict__.get(name)
                getter = getattr(owner, name, None)
                if not isinstance(getter, property) or getter.fget is None:
                    continue
                setattr(owner, name, property(_noting(getter.fget, f"{prefix}.{name}", reads)))
                patched.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _noting(fget: Callable[[Any], Any], name: str, reads: dict[str, str]) -> Callable[[Any], Any]:
    def read(instance: Any) -> Any:
        where = _user_line(sys._getframe(1))
        if where is not None:
            reads.setdefault(name, where)
        return fget(instance)

    return read


class _WatchedIndex(int):
    """An ``int`` that notes where user code first used it (``batch_idx`` of an observed step)."""

    _reads: dict[str, str]
    _name: str

    def __reduce__(self) -> Any:
        return (int, (int(self),))


def _watching(name: str) -> Callable[..., Any]:
    base = getattr(int, name)

    def method(self: _WatchedIndex, *args: Any) -> Any:
        where = _user_line(sys._getframe(1))
        if where is not None:
            self._reads.setdefault(self._name, where)
        return base(self, *args)

    return method


#: The ``int`` methods a watched index notes: comparisons, conversions, and arithmetic (reflected too).
_METHODS = "eq ne lt le gt ge hash bool index int float str repr format neg pos abs round"
_OPERATORS = "add sub mul truediv floordiv mod divmod pow and or xor lshift rshift"
for _name in [*_METHODS.split(), *(f"{side}{op}" for op in _OPERATORS.split() for side in ("", "r"))]:
    setattr(_WatchedIndex, f"__{_name}__", _watching(f"__{_name}__"))


def watched_index(value: int, reads: dict[str, str], name: str = "batch_idx") -> int:
    """``value`` as an ``int`` that notes in ``reads`` where user code first used it.

    Example:
        >>> reads = {}
        >>> index = watched_index(7, reads)
        >>> index % 2, index + 1
        (1, 8)
        >>> sorted(reads)
        ['batch_idx']
    """
    watched = _WatchedIndex(value)
    watched._reads, watched._name = reads, name
    return watched

"""What a graph's Python code can read: the names its bytecode loads, found once per function.

A replay runs none of the Python that launched its kernels, so every plain value that code read is frozen into the
graph. The guards (:mod:`~lightning_cudagraph._trust.guards`) hold those values; this module finds their names. It reads
code objects, not runs: the attribute names and string keys a function loads, the module-level names and closure cells
it reads, and the same for the methods of its own object that it calls. Each name keeps the line of its first load.
"""

from __future__ import annotations

import dis
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_cudagraph._trust.reads import framework_file, line_of

__all__ = ["CodeReads", "class_reads"]

#: Instructions that load an attribute (or a method) by the name in their argument.
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
#: Instructions that load a module-level name.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
#: Instructions that load a closure cell.
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
#: Methods a replay runs again: the whole step re-issues its ``self.log`` calls, so an override of them stays live.
_LIVE = frozenset({"log", "log_dict"})
#: Files whose methods are not followed: the base classes' own machinery (``self.log``, ``__call__``).
_BASE_FILES = frozenset(inspect.getfile(cls) for cls in (torch.nn.Module, pl.LightningModule))


@dataclass
class CodeReads:
    """The names some code loads, each with the line of its first load (``file:line: `source```).

    Attributes:
        names: Attribute names and string constants (``self.scale``, ``self.hparams["lr"]``).
        globals: Module-level names of user code, by ``(module globals, name)``.
        cells: Closure cells of user code, by ``(cell, name)``.
    """

    names: dict[str, str] = field(default_factory=dict)
    globals: dict[tuple[int, str], tuple[dict[str, Any], str, str]] = field(default_factory=dict)
    cells: dict[int, tuple[types.CellType, str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, functions: Iterable[Callable[..., Any]], owner: type | None = None) -> CodeReads:
        """What ``functions`` load, following the methods of ``owner`` they call (user code's, not the bases').

        Example:
            >>> SCALE = 2.0
            >>> class Net:
            ...     def forward(self, x):
            ...         return self.helper(x) * SCALE
            ...     def helper(self, x):
            ...         return x + self.shift
            >>> reads = CodeReads.of([Net.forward], owner=Net)
            >>> sorted(name for name in reads.names if name in ("helper", "shift"))
            ['helper', 'shift']
        """
        reads = cls()
        queue = [function for function in map(_unwrap, functions) if function is not None]
        seen: set[types.CodeType] = set()
        while queue:
            function = queue.pop()
            code = function.__code__
            if code in seen:
                continue
            seen.add(code)
            user = not framework_file(code.co_filename)
            loaded = reads._read(function, code, user)
            if owner is not None:
                queue.extend(_methods(owner, loaded))
        return reads

    def _read(self, function: types.FunctionType, code: types.CodeType, user: bool) -> list[str]:
        """Note what ``code`` (and the code nested in it) loads; the attribute names it loads, in order."""
        cells = dict(zip(code.co_freevars, function.__closure__ or (), strict=False))
        attributes: list[str] = []
        for inner in _codes(code):
            line = inner.co_firstlineno
            for instruction in dis.get_instructions(inner):
                line = _line(instruction) or line
                name, opname = instruction.argval, instruction.opname
                if opname in _ATTRIBUTE_LOADS and isinstance(name, str):
                    attributes.append(name)
                    self.names.setdefault(name, line_of(inner.co_filename, line))
                elif opname == "LOAD_CONST" and isinstance(name, str) and name.isidentifier():
                    self.names.setdefault(name, line_of(inner.co_filename, line))
                elif not user:
                    continue  # torch's and Lightning's module-level names are theirs
                elif opname in _GLOBAL_LOADS and isinstance(name, str) and name in function.__globals__:
                    where = line_of(inner.co_filename, line)
                    self.globals.setdefault((id(function.__globals__), name), (function.__globals__, name, where))
                elif opname in _CELL_LOADS and inner is code and name in cells:
                    cell = cells[name]
                    self.cells.setdefault(id(cell), (cell, name, line_of(inner.co_filename, line)))
        return attributes


#: What each class's code reads, by class and the methods it starts from (code does not change during a fit).
_CLASS_READS: dict[tuple[type, tuple[str, ...]], CodeReads] = {}


def class_reads(owner: type, starts: tuple[str, ...] = ("forward",)) -> CodeReads:
    """What the methods ``starts`` of ``owner`` (and the methods of it they call) load, once per class.

    Example:
        >>> import torch
        >>> "p" in class_reads(torch.nn.Dropout).names
        True
    """
    key = (owner, starts)
    if key not in _CLASS_READS:
        functions = [getattr(owner, name, None) for name in starts]
        _CLASS_READS[key] = CodeReads.of([function for function in functions if callable(function)], owner=owner)
    return _CLASS_READS[key]


def _unwrap(function: Any) -> types.FunctionType | None:
    """The plain function behind a method, a decorated function or a property (``None``: no Python code)."""
    if isinstance(function, property):
        function = function.fget
    function = getattr(function, "__func__", function)
    try:
        function = inspect.unwrap(function)
    except ValueError:  # pragma: no cover (a cycle of __wrapped__)
        return None
    return function if isinstance(function, types.FunctionType) else None


def _methods(owner: type, names: Iterable[str]) -> Iterator[types.FunctionType]:
    """The methods (and properties) of ``owner`` by these names: user code's, and a torch class's own file's.

    Lightning's and torch's machinery (``self.log``, ``self.hparams``, ``__call__``) is not followed: what it reads is
    the framework's, and guarded where it matters (``hparams`` by its entries).
    """
    own = _file_of(owner)
    for name in names:
        if name in _LIVE:
            continue
        try:
            found = inspect.getattr_static(owner, name)
        except AttributeError:
            continue
        function = _unwrap(found)
        if function is None:
            continue
        path = function.__code__.co_filename
        if path not in _BASE_FILES and (not framework_file(path) or path == own):
            yield function


def _file_of(owner: type) -> str | None:
    try:
        return inspect.getfile(owner)
    except TypeError:  # a class built in C
        return None


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects nested in it (comprehensions, lambdas, inner functions)."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)


def _line(instruction: dis.Instruction) -> int | None:
    """The source line an instruction starts, where the interpreter says (3.10 to 3.13 differ)."""
    if sys.version_info >= (3, 13):
        return instruction.line_number if instruction.starts_line else None  # type: ignore[attr-defined]
    start = instruction.starts_line
    return start if isinstance(start, int) and not isinstance(start, bool) else None

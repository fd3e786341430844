"""Guards before every replay: the plain Python values a graph's code read when it was captured, held to them.

A graph bakes in each Python value its code read at capture: a module's ``temperature``, ``self.hparams["alpha"]``, a
module-level dict of settings, the Trainer's clipping value. A callback that changes one between steps would be
ignored by every replay. A :class:`GuardSet` is built at capture from the code the graph holds
(:mod:`~lightning_cudagraph._trust.code_reads`) and checked before each replay:

- module attributes by the writes to them (:class:`~lightning_cudagraph._trust.module_writes.WriteLog`), so a large
  model costs nothing until one is written; mutable containers held by modules are compared;
- ``hparams`` entries, module-level names and closure cells of user code, compared by value;
- for a graph that holds Lightning's clipping, the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``.

A value that differs from capture is a ``step_python`` reason, given before the replay. The learning rate needs no
guard: it is a fed value, copied into the device tensor the graph reads before each replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_cudagraph._trust.code_reads import CodeReads, class_reads
from lightning_cudagraph._trust.fingerprints import framework_keys
from lightning_cudagraph._trust.module_writes import WriteLog

__all__ = ["EVAL_METHODS", "STEP_METHODS", "GuardSet"]

#: The LightningModule's methods that run inside a whole-step graph: what a replay of it has read.
STEP_METHODS = (
    "training_step",
    "forward",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
)
#: The LightningModule's methods that run inside an evaluation step's graph.
EVAL_METHODS = ("validation_step", "test_step", "predict_step", "forward")
#: The Trainer's settings that a graph holding Lightning's clipping bakes in.
TRAINER_SETTINGS = ("gradient_clip_val", "gradient_clip_algorithm")
#: Values held by value; a container of them too, up to this many items (a larger one is left to the audits).
_SCALARS = (bool, int, float, complex, str, bytes, type(None), enum.Enum)
_MUTABLE = (list, dict, set, bytearray, types.SimpleNamespace, argparse.Namespace)
_MAX_ITEMS = 64
_UNHELD = object()


def frozen(value: Any, depth: int = 0) -> Any:
    """``value`` as a comparable snapshot, or ``_UNHELD`` when it is not a plain value a guard can hold.

    Example:
        >>> frozen({"scale": 2.0, "names": ["a", "b"]})
        ('dict', (('scale', 2.0), ('names', ('list', ('a', 'b')))))
        >>> frozen(object()) is _UNHELD
        True
    """
    if isinstance(value, _SCALARS):
        return value
    if depth > 2:
        return _UNHELD
    if isinstance(value, (types.SimpleNamespace, argparse.Namespace)) or _is_dataclass_instance(value):
        value = dict(vars(value))
    if isinstance(value, dict):
        items = [(key, frozen(item, depth + 1)) for key, item in list(value.items())[: _MAX_ITEMS + 1]]
        if len(items) > _MAX_ITEMS or any(item is _UNHELD for _, item in items):
            return _UNHELD
        return ("dict", tuple(items))
    if isinstance(value, (list, tuple, set, frozenset)):
        members = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        if len(members) > _MAX_ITEMS:
            return _UNHELD
        inner = tuple(frozen(item, depth + 1) for item in members)
        return _UNHELD if any(item is _UNHELD for item in inner) else (type(value).__name__, inner)
    return _UNHELD


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__dict__")


def _shown(snapshot: Any) -> str:
    """A snapshot as a message shows it (containers by their items, cut short)."""
    text = repr(snapshot)
    return text if len(text) <= 80 else f"{text[:77]}..."


class _Compared:
    """A value compared before each replay: how to read it, its snapshot, what it is and where the code reads it."""

    __slots__ = ("read", "then", "what", "where")

    def __init__(self, read: Callable[[], Any], what: str, where: str) -> None:
        self.read, self.what, self.where = read, what, where
        self.then = frozen(read())


class GuardSet:
    """The plain values a graph's code read at capture, checked before each replay; see the module docstring.

    Args:
        graph: The graph the guards serve, as messages name it ("the whole step", "the regions").
        modules: ``(qualified name, module)`` of every module the graph holds; each is guarded on the attributes its
            class's ``forward`` (and the methods it calls) reads.
        step: The LightningModule, when the graph holds one of its steps: the code of its ``methods`` and the
            ``hparams`` entries that code names are guarded too.
        fix: What a user can do instead, as the reason gives it.
        methods: The LightningModule's methods the graph holds (:data:`STEP_METHODS`, :data:`EVAL_METHODS`).
        clipping: The graph holds Lightning's gradient clipping: the Trainer's clipping settings are guarded.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        >>> guards = GuardSet("the regions", list(net.named_modules()), fix="set it before the fit")
        >>> guards.problem() is None
        True
        >>> net[1].p = 0.5
        >>> guards.problem().split(" (set at")[0]
        'step_python: 1.p changed from 0.1 to 0.5'
        >>> guards.release()
    """

    def __init__(
        self,
        graph: str,
        modules: Sequence[tuple[str, torch.nn.Module]],
        step: pl.LightningModule | None = None,
        fix: str = "",
        methods: tuple[str, ...] = STEP_METHODS,
        clipping: bool = False,
    ) -> None:
        self.graph, self.fix = graph, fix
        self._attributes: dict[tuple[int, str], tuple[str, str, Any]] = {}
        self._compared: list[_Compared] = []
        watched: dict[int, set[str]] = {}
        step_reads = class_reads(type(step), methods) if step is not None else None
        code: list[CodeReads] = [step_reads] if step_reads is not None else []
        for name, module in modules:
            if isinstance(module, Metric):
                continue  # metrics are watched by their update counts
            reads = step_reads if module is step else class_reads(type(module))
            if reads is None:
                continue
            code.append(reads)
            names = self._module_guards(name, module, reads)
            if names:
                watched[id(module)] = names
        if step is not None and step_reads is not None:
            self._guard_step(step, step_reads, clipping)
        self._guard_user_code(code)
        self._log = WriteLog(watched)

    @property
    def size(self) -> int:
        """How many values are guarded (module attributes and compared values)."""
        return len(self._attributes) + len(self._compared)

    def _module_guards(self, name: str, module: torch.nn.Module, reads: CodeReads) -> set[str]:
        """The plain attributes of ``module`` that its code reads: noted on write, containers also compared."""
        skip, names = framework_keys(), set()
        for attribute, value in vars(module).items():
            where = reads.names.get(attribute)
            if where is None or attribute in skip or "hook" in attribute or attribute.startswith("_hparams"):
                continue
            snapshot = frozen(value)
            if snapshot is _UNHELD:
                continue
            qualified = f"{name}.{attribute}" if name else attribute
            self._attributes[(id(module), attribute)] = (qualified, where, snapshot)
            if isinstance(value, _MUTABLE):  # changed in place, which no write shows
                self._compared.append(_Compared(_attribute_reader(module, attribute), qualified, where))
            names.add(attribute)
        return names

    def _guard_step(self, step: pl.LightningModule, reads: CodeReads, clipping: bool) -> None:
        """The step's ``hparams`` entries its code names, and (``clipping``) the Trainer's clipping settings."""
        hparams = step.__dict__.get("_hparams")
        if isinstance(hparams, dict):
            for key in hparams:
                where = reads.names.get(key) if isinstance(key, str) else None
                if where is not None and frozen(hparams[key]) is not _UNHELD:
                    self._compared.append(_Compared(_item_reader(hparams, key), f"hparams[{key!r}]", where))
        trainer = step._trainer
        if trainer is not None and clipping:
            for setting in TRAINER_SETTINGS:
                what = f"Trainer.{setting}"
                self._compared.append(_Compared(_attribute_reader(trainer, setting), what, "Lightning's clipping"))

    def _guard_user_code(self, code: Iterable[CodeReads]) -> None:
        """Module-level names and closure cells of user code that hold plain values."""
        seen: set[tuple[int, str]] = set()
        for reads in code:
            for key, (namespace, name, where) in reads.globals.items():
                if key not in seen and frozen(namespace.get(name, _UNHELD)) is not _UNHELD:
                    seen.add(key)
                    module = namespace.get("__name__", "?")
                    self._compared.append(_Compared(_item_reader(namespace, name), f"{module}.{name}", where))
            for cell, name, where in reads.cells.values():
                if (id(cell), name) not in seen and frozen(_cell_value(cell)) is not _UNHELD:
                    seen.add((id(cell), name))
                    self._compared.append(_Compared(_cell_reader(cell), f"closure {name}", where))

    def problem(self) -> str | None:
        """A ``step_python`` reason if a guarded value differs from capture, else ``None`` (before each replay)."""
        change = self.change()
        if change is None:
            return None
        return f"step_python: {change}, and a replay keeps the value it was captured with. Fix: {self.fix}"

    def change(self) -> str | None:
        """The first guarded value that differs from capture, with the lines that wrote and read it, or ``None``."""
        log = self._log
        if log.written:
            for module, attribute, writer in log.written.values():
                qualified, where, then = self._attributes[(id(module), attribute)]
                now = frozen(module.__dict__.get(attribute, _UNHELD))
                if now is not then and now != then:
                    return self._described(qualified, then, now, where, f" (set at {writer})")
            log.clear()
        for value in self._compared:
            now = frozen(value.read())
            if now is not value.then and now != value.then:
                return self._described(value.what, value.then, now, value.where, "")
        return None

    def _described(self, what: str, then: Any, now: Any, where: str, writer: str) -> str:
        shown = "a value it cannot hold" if now is _UNHELD else _shown(now)
        return (
            f"{what} changed from {_shown(then)} to {shown}{writer} since the capture of {self.graph};"
            f" the graph read it at {where}"
        )

    def release(self) -> None:
        """Stop noting writes (idempotent)."""
        self._log.close()


def _attribute_reader(owner: Any, name: str) -> Callable[[], Any]:
    if isinstance(owner, torch.nn.Module):
        return lambda: owner.__dict__.get(name, _UNHELD)
    return lambda: getattr(owner, name, _UNHELD)


def _item_reader(mapping: dict[Any, Any], key: Any) -> Callable[[], Any]:
    return lambda: mapping.get(key, _UNHELD)


def _cell_reader(cell: types.CellType) -> Callable[[], Any]:
    return lambda: _cell_value(cell)


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _UNHELD

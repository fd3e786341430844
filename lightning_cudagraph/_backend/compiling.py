"""Compiled kernels inside the graphs: ``compile=`` compiles what is about to be captured, then the graphs hold it.

Graphs remove the host from the step; only fewer, faster kernels cut the GPU time left. Compilation happens during
the eager warmup steps: for the whole step the modules the LightningModule calls, for scoped graphs each target's
forward. A replay runs no dynamo guard; the package checks what those guards check (shapes, dtypes, modes,
parameters) before every replay instead.

Scoped regions smaller than the whole forward are left uncompiled unless ``compile={"regions": True}``: each is a
small graph, too small for fused kernels to pay for what compiling costs inside it (:data:`SMALL_REGIONS`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.nn as nn

from lightning_cudagraph._options.compile_options import CompileOptions
from lightning_cudagraph._warnings import warn_user

__all__ = [
    "SMALL_REGIONS",
    "CompileWatch",
    "CompiledForwards",
    "CompiledModules",
    "called_modules",
    "holds_the_forward",
]

#: Why ``compile=`` leaves a scoped level's regions uncompiled, with the figures measured held-out on an H100
#: (issue 50): ``scope=["layer"]`` on a decoder, with ``compile=True`` against without it.
SMALL_REGIONS = (
    "each region is a small graph whose compiled kernels lose to the plain graph (measured on an H100 with"
    " scope=['layer'] on a decoder: 7.76 ms per step compiled against 6.04 ms plain in fp32, 6.56 against 6.45 ms"
    " in bf16-mixed, where compiling the whole step gained 1.36x and 1.84x)"
)


def holds_the_forward(regions: Sequence[nn.Module], module: nn.Module) -> bool:
    """Whether a single region holds every trainable parameter of ``module``: its whole forward, worth compiling.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Module()
        >>> model.net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> holds_the_forward([model.net], model), holds_the_forward([model.net[0]], model)
        (True, False)
    """
    if len(regions) != 1:
        return False
    held = {id(parameter) for parameter in regions[0].parameters()}
    return all(id(parameter) in held for parameter in module.parameters() if parameter.requires_grad)


def called_modules(module: nn.Module) -> list[nn.Module]:
    """The outermost modules a LightningModule calls: its children, with containers opened and parameterless skipped.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Module()
        >>> model.embed, model.blocks, model.act = nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2)] * 2), nn.ReLU()
        >>> [type(m).__name__ for m in called_modules(model)]
        ['Embedding', 'Linear']
    """
    found: dict[int, nn.Module] = {}
    pending = list(module.children())
    while pending:
        child = pending.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            pending[:0] = list(child.children())
        elif any(True for _ in child.parameters()):
            found.setdefault(id(child), child)
    return list(found.values())


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a compiled module runs: its call, hooks included (not ``__call__``, which would find the compiled one)."""
    return module._call_impl(*args, **kwargs)


def _call_forward(forward: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a compiled target runs: its class's forward on the module."""
    return forward(module, *args, **kwargs)


def _entry_point(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of ``function`` with code of its own, so dynamo keeps its compiled entries apart from the others'.

    Dynamo's cache and recompile limit belong to a code object, and it starts no frame in ``torch.nn`` (it inlines
    those from a frame of ours).
    """
    if sys.version_info >= (3, 11):  # co_qualname is new in 3.11
        code = function.__code__.replace(co_name=name, co_qualname=name)
    else:
        code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name)


class CompiledModules:
    """Modules compiled in place for one fit (their ``_compiled_call_impl``); :meth:`restore` gives them back.

    Each class gets its own compiled entry point; a module the user already compiled is left as it is.

    Example:
        >>> import torch, torch.nn as nn
        >>> layer = nn.Linear(2, 2)
        >>> compiled = CompiledModules(CompileOptions(backend="eager"))
        >>> compiled.compile([layer])
        >>> compiled.active = True  # as during a training step
        >>> layer(torch.ones(1, 2)).shape
        torch.Size([1, 2])
        >>> compiled.restore()
        >>> layer._compiled_call_impl is None
        True
    """

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self._compiled: list[tuple[nn.Module, Callable[..., Any]]] = []
        self._active = False

    def compile(self, modules: Iterable[nn.Module]) -> None:
        """Compile each module that is not compiled yet (active from the next training step on)."""
        by_class: dict[type, Callable[..., Any]] = {}
        for module in modules:
            if _is_compiled(module):
                continue
            cls = type(module)
            if cls not in by_class:
                by_class[cls] = self.options.compile(_entry_point(_call_module, f"compiled_{cls.__name__}"))
            self._compiled.append((module, functools.partial(by_class[cls], module)))

    @property
    def active(self) -> bool:
        """Whether calls of the modules run compiled (during training steps; evaluation runs them as built)."""
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        if on != self._active:
            self._active = on
            for module, compiled in self._compiled:
                module._compiled_call_impl = compiled if on else None

    def restore(self) -> None:
        """Give every module its own call back and drop the compiled ones (idempotent)."""
        self.active = False
        self._compiled = []


class CompiledForwards:
    """One compiled function per forward implementation, called with the module as its first argument.

    Instances of a class share it, so dynamo compiles once and guards on the module's structure, not its identity.
    """

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self._by_function: dict[Any, Callable[..., Any]] = {}

    def for_module(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        """A compiled stand-in for ``forward`` (the module's own forward, bound to it)."""
        function = getattr(forward, "__func__", None)
        if function is None or getattr(forward, "__self__", None) is not module or _is_compiled(module):
            return forward  # not a plain bound forward (or compiled by the user): left as it is
        compiled = self._by_function.get(function)
        if compiled is None:
            name = f"compiled_{type(module).__name__}_forward"
            compiled = self._by_function[function] = self.options.compile(_entry_point(_call_forward, name))
        return functools.partial(compiled, function, module)

    def clear(self) -> None:
        """Drop the compiled functions."""
        self._by_function.clear()


def _is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


class CompileWatch:
    """Dynamo's compilations during one fit: their time, and the ones after the first capture (recompiles).

    Args:
        report: ``compile_s`` and ``recompiles`` are written there.
    """

    def __init__(self, report: Any, component: str) -> None:
        self.report, self.component = report, component
        #: Set once the first graph is captured: a compilation after it is a recompile.
        self.captured = False
        self._started: dict[str, float] = {}
        self._installed = False

    def install(self) -> None:
        """Start watching (idempotent)."""
        if self._installed:
            return
        from torch._dynamo.callback import callback_handler

        if math.isnan(self.report.compile_s):
            self.report.compile_s = 0.0
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        self._installed = True

    def remove(self) -> None:
        """Stop watching (idempotent)."""
        if not self._installed:
            return
        from torch._dynamo.callback import callback_handler

        self._installed = False
        with contextlib.suppress(ValueError):  # torch._dynamo.reset() during the fit already dropped them
            callback_handler.remove_start_callback(self._on_start)
            callback_handler.remove_end_callback(self._on_end)

    def _on_start(self, args: Any = None) -> None:
        self._started[_compile_id(args)] = time.perf_counter()

    def _on_end(self, args: Any = None) -> None:
        started = self._started.pop(_compile_id(args), None)
        if started is not None:
            self.report.compile_s += time.perf_counter() - started
        if not self.captured:
            return
        self.report.recompiles += 1
        if self.report.recompiles == 1:
            warn_user(
                f"{self.component}: torch.compile compiled again after the capture ({_compile_id(args)}): a guard of"
                " the compiled code failed on an eager path (another batch shape, a fallback, evaluation). Graphs"
                " keep the kernels compiled before. Run with TORCH_LOGS=recompiles to see which guard."
            )


def _compile_id(args: Any) -> str:
    return str(getattr(args, "compile_id", "?")) + ":" + str(getattr(args, "callback_trigger", ""))

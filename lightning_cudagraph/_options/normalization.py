"""The options in the forms a user passes them, normalized into the forms the config stores.

A value of the wrong kind is refused here; the rules between options live in :mod:`.validation`.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from lightning_cudagraph._options.compile_options import CompileOptions
from lightning_cudagraph._options.errors import config_error
from lightning_cudagraph._options.options import AUTO, FULL_ITERATION, Selector

__all__ = ["compile_options", "normalize_modules", "normalize_scope", "plain"]


def plain(value: Any) -> Any:
    """A NumPy scalar or array as the Python number, bool, string or list it holds; any other value unchanged.

    ``np.int64(2)``, ``np.float32(600)`` and ``np.array([8, 16])`` are accepted wherever ``2``, ``600.0`` and
    ``[8, 16]`` are, and stored as those. NumPy is not imported for this: a NumPy value means it already is.

    Example:
        >>> import numpy as np
        >>> plain(np.int64(2)), plain(np.array([8, 16])), plain("attn")
        (2, [8, 16], 'attn')
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tolist()
    return value


def compile_options(component: str, value: Any, scope: tuple[str, ...], impl: Any) -> CompileOptions | None:
    """``compile=`` checked for what :class:`CompileOptions` cannot name: its type, and inductor option names."""
    if value is not None and not isinstance(value, (bool, Mapping)):
        fixed = "scope=['layer']" if scope == (AUTO,) else f"scope={list(scope)!r}"
        fixed += ", impl='local'" if impl == "transformer_engine" else ""
        raise config_error(
            component,
            "compile",
            value,
            "False, True, or a dict of torch.compile arguments (backend, fullgraph, mode, options) and regions",
            f"pass compile=True with a fixed scope, e.g. {fixed}, compile=True (compile= does not run under"
            " scope='auto'), or compile=False",
        )
    if isinstance(value, Mapping) and isinstance(value.get("options"), Mapping) and value["options"]:
        _check_inductor_options(component, value)
    return CompileOptions.from_option(component, value)


def _check_inductor_options(component: str, value: Mapping[str, Any]) -> None:
    """Refuse unknown inductor options, and values of another type than inductor's, before the fit.

    Either would fail inside torch.compile at the first step, without naming ``compile=``.
    """
    import torch._inductor  # imported only for a dict of options: it takes seconds
    import torch._inductor.config as inductor_config

    known = torch._inductor.list_options()
    defaults = inductor_config.get_config_copy()
    for name, given in value["options"].items():
        default = defaults.get(name)
        if isinstance(default, (bool, int, float, str)) and not _same_kind(given, default):
            expected = type(default).__name__
            raise config_error(
                component,
                "compile",
                dict(value),
                f"options[{name!r}] of inductor's type {expected} (its default is {default!r})",
                f"pass e.g. options={{{name!r}: {(not default) if isinstance(default, bool) else default!r}}}",
            )
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "drop it"
            raise config_error(
                component,
                "compile",
                dict(value),
                f"options= names of inductor's config (torch._inductor.list_options(); {name!r} is not one)",
                f"{hint} (e.g. options={{'max_autotune': True}})",
            )


def _same_kind(given: Any, default: bool | int | float | str) -> bool:
    """Whether ``given`` has the type of inductor's ``default`` (an int passes for a float; a bool only for a bool)."""
    if isinstance(default, bool) or isinstance(given, bool):
        return isinstance(given, bool) and isinstance(default, bool)
    return isinstance(given, (int, float) if isinstance(default, float) else type(default))


def normalize_scope(component: str, scope: Any) -> tuple[str, ...]:
    """``scope=`` as a tuple of names, without repeats (a comma-separated string split)."""
    if isinstance(scope, str):
        names = [part.strip() for part in scope.split(",")] if "," in scope else [scope]
    elif isinstance(scope, Sequence) and all(isinstance(s, str) for s in scope):
        names = list(scope)
    else:
        raise config_error(
            component, "scope", scope, "'auto', a scope name or a list of names", "pass e.g. scope=['attn', 'mlp']"
        )
    if not names:
        raise config_error(component, "scope", scope, "a non-empty list", "pass scope='auto' or a list of scopes")
    return tuple(dict.fromkeys(names))


def normalize_modules(component: str, modules: Any) -> dict[str, tuple[Selector, ...]]:
    """``modules=`` as a dict from scope name to a tuple of selectors, each checked for its kind."""
    if modules is None:
        return {}
    if not isinstance(modules, Mapping):
        raise config_error(
            component,
            "modules",
            modules,
            "a mapping from scope name to selectors",
            "pass e.g. modules={'attn': 'blocks.*.attn'}",
        )
    normalized = {}
    for name, selectors in modules.items():
        if not isinstance(name, str) or not name or name in (AUTO, FULL_ITERATION):
            raise config_error(
                component, "modules", name, "scope names other than 'auto' and 'full_iteration'", "rename the key"
            )
        items = tuple(selectors) if isinstance(selectors, (list, tuple)) else (selectors,)
        for item in items or (None,):
            valid = isinstance(item, str) or callable(item)
            if isinstance(item, type):
                valid = issubclass(item, nn.Module)
            if not valid:
                raise config_error(
                    component,
                    f"modules[{name!r}]",
                    item,
                    "a glob on qualified module names, an nn.Module subclass, or a predicate (name, module) -> bool",
                    "pass e.g. 'blocks.*.attn', MyAttention, or lambda name, module: ...",
                )
        normalized[name] = items
    return normalized

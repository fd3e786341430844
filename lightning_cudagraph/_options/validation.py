"""The rules the options must meet together, checked once they are normalized and before any GPU work.

Rules that need the Trainer live in :mod:`lightning_cudagraph._rollout.preflight`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_cudagraph._options.errors import Verbatim, config_error, did_you_mean
from lightning_cudagraph._options.options import (
    AUTO,
    FAILURE_POLICIES,
    FULL_ITERATION,
    IMPLS,
    MAX_CONFIRM_STEPS,
    MAX_PARITY_TOL,
    SCOPES,
    SHAPE_CHANGE_POLICIES,
    TE_INSTALL,
    Selector,
)

#: A :class:`~lightning_cudagraph._options.config.CUDAGraphConfig`, typed loosely: the config imports these rules.
Config = Any

__all__ = ["validate"]


def validate(config: Config) -> None:
    """Raise ``ValueError`` naming ``component`` on the first option or combination that cannot work."""
    _check_choice(config.component, "impl", config.impl, IMPLS, "pass impl='local' (PyTorch graphs)")
    _check_choice(
        config.component, "on_shape_change", config.on_shape_change, SHAPE_CHANGE_POLICIES, "pick one of them"
    )
    _check_choice(config.component, "on_failure", config.on_failure, FAILURE_POLICIES, "pick one of them")
    _check_int(config.component, "warmup_steps", config.warmup_steps, 0, "pass a count of eager steps, e.g. 3")
    _check_int(config.component, "confirm_steps", config.confirm_steps, 1, "pass at least 1")
    if config.confirm_steps > MAX_CONFIRM_STEPS:
        raise config_error(
            config.component,
            "confirm_steps",
            config.confirm_steps,
            f"1 to {MAX_CONFIRM_STEPS}",
            "pass e.g. confirm_steps=2 (the default): each confirmation step runs the eager forward beside the"
            " graphs, and under scope='auto' every level confirms before the next is tried, so"
            f" {config.confirm_steps} steps would keep the fit in confirmation",
        )
    _check_positive(config.component, "max_pool_mib", config.max_pool_mib, "pass a budget in MiB, or None for no limit")
    if config.seal_after_steps is not None:
        _check_int(config.component, "seal_after_steps", config.seal_after_steps, 1, "pass an optimizer step, or None")
    if config.audit_every_n_steps is not None:
        _check_int(
            config.component, "audit_every_n_steps", config.audit_every_n_steps, 0, "pass a number of steps, or None"
        )
    _check_bool(config.component, "eval_graphs", config.eval_graphs, "pass eval_graphs=False for eager evaluation")
    _check_bool(
        config.component,
        "optimizer_graph",
        config.optimizer_graph,
        "pass optimizer_graph=False for an eager optimizer step",
    )
    _validate_parity_tol(config)
    _validate_max_graphs(config)
    _validate_scope(config)
    _validate_compile(config)
    if config.impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise config_error(
            config.component,
            "impl",
            config.impl,
            "'local' without Transformer Engine; 'transformer_engine' once it is installed",
            f"install it (`{TE_INSTALL}`) or pass impl='local'",
        )


def _validate_compile(config: Config) -> None:
    if config.compile is None:
        return
    if config.auto_scope:
        raise config_error(
            config.component,
            "compile",
            config.compile.as_option(),
            "compile with a fixed scope (scope=['layer'], ['attn', 'mlp'], ... or strategy='cudagraph_full')",
            "pick the scope: under scope='auto' each level of the ladder would compile its regions anew (a"
            " compile per level)",
        )
    if config.impl == "transformer_engine":
        raise config_error(
            config.component,
            "compile",
            config.compile.as_option(),
            "compile with impl='local' (or impl='none', which captures and compiles nothing)",
            "drop compile (Transformer Engine's fused modules are not compiled here), or pass impl='local'",
        )


def _validate_parity_tol(config: Config) -> None:
    value = config.parity_tol
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= MAX_PARITY_TOL:
        raise config_error(
            config.component,
            "parity_tol",
            value,
            f"a relative tolerance in (0, {MAX_PARITY_TOL}], or None for the precision's default",
            f"pass e.g. 1e-3; a larger tolerance would let a wrong graph pass confirmation (above"
            f" {MAX_PARITY_TOL}, a forward off by a factor of two is indistinguishable)",
        )


def _validate_max_graphs(config: Config) -> None:
    if config.max_graphs is None:
        return
    _check_int(config.component, "max_graphs", config.max_graphs, 1, "pass at least 2 with on_shape_change='recapture'")
    if config.on_shape_change != "recapture":
        raise config_error(
            config.component,
            "max_graphs",
            config.max_graphs,
            "max_graphs only with on_shape_change='recapture' (the other policies keep one graph set)",
            "pass on_shape_change='recapture' as well, or drop max_graphs",
        )
    if config.max_graphs < 2:
        raise config_error(
            config.component,
            "max_graphs",
            config.max_graphs,
            "at least 2 with on_shape_change='recapture' (the first shape already holds one graph set)",
            "pass max_graphs=2 or more, or on_shape_change='eager' to run other shapes eagerly",
        )


def _validate_scope(config: Config) -> None:
    known = (*SCOPES, *(k for k in config.modules if k not in SCOPES))
    allowed = f"'auto', or a list from {', '.join(repr(s) for s in known)}"
    if AUTO in config.scope and len(config.scope) > 1:
        raise config_error(
            config.component, "scope", list(config.scope), allowed, "pass 'auto' alone or a list of scopes"
        )
    for name in config.scope:
        if name != AUTO and name not in known:
            close = did_you_mean(name, known)
            hint = f"did you mean {close!r}? Otherwise " if close is not None else ""
            raise config_error(
                config.component,
                "scope",
                list(config.scope),
                allowed,
                f"{hint}remove {name!r} or define it with modules={{{name!r}: 'a.glob.*.name'}}",
            )
    _validate_modules_keys(config)
    if FULL_ITERATION in config.scope:
        _validate_full_iteration(config)
    if "moe" in config.scope and "moe_router" in config.scope:
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "'moe' (the whole MoE layer) or 'moe_router' (its router), not both",
            "drop one of them",
        )
    if "moe_preprocess" in config.scope and "moe_router" not in config.scope:
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "'moe_preprocess' together with 'moe_router'",
            "add 'moe_router' (the preprocess consumes the router's output)",
        )


def _validate_modules_keys(config: Config) -> None:
    """A ``modules=`` key must take effect: used by a fixed scope, and under ``auto`` not a misspelt built-in."""
    builtin = [s for s in SCOPES if s != FULL_ITERATION]
    if config.modules and config.full_iteration:
        raise config_error(
            config.component,
            "modules",
            _shown_modules(config.modules),
            "no modules= with scope=['full_iteration'] (the whole step is captured, not modules)",
            "drop modules=, or pass the scopes it defines instead of full_iteration, e.g."
            f" scope={list(config.modules)!r}",
        )
    for name in config.modules:
        if name in SCOPES:
            if not config.auto_scope and name not in config.scope:
                raise config_error(
                    config.component,
                    "modules",
                    _shown_modules(config.modules, name),
                    f"keys that name a scope in scope={list(config.scope)!r}",
                    f"the {name!r} selectors would be unused: add {name!r} to scope= (e.g."
                    f" scope={[*config.scope, name]!r}), or drop the key",
                )
            continue
        close = did_you_mean(name, builtin)
        if config.auto_scope and close is not None:
            raise config_error(
                config.component,
                "modules",
                _shown_modules(config.modules, name),
                f"built-in scope names ({', '.join(builtin)}) to override them, or a new scope name unlike any"
                " of them (under scope='auto' a new scope joins every level)",
                f"did you mean {close!r}? Rename the key to {close!r} to override its patterns (as written, a new"
                f" scope {name!r} would be captured beside the built-in {close!r}), or pick a distinct name for a"
                " new scope",
            )
        if not config.auto_scope and name not in config.scope:
            hint = f"; or did you mean {close!r}?" if close is not None else ""
            raise config_error(
                config.component,
                "modules",
                _shown_modules(config.modules, name),
                f"keys that name a scope in scope={list(config.scope)!r}",
                f"the new scope {name!r} is not asked for: add it to scope= (e.g."
                f" scope={[*config.scope, name]!r}), or drop the key{hint}",
            )


def _validate_full_iteration(config: Config) -> None:
    if len(config.scope) > 1:
        raise config_error(
            config.component,
            "scope",
            list(config.scope),
            "'full_iteration' alone, or scoped names without it",
            "full_iteration captures the whole step; pass scope=['full_iteration'] alone",
        )
    if config.impl == "none":
        raise config_error(
            config.component,
            "impl",
            config.impl,
            "'local' with scope=['full_iteration']; impl='none' with any other scope",
            "to train without graphs, drop scope=['full_iteration'] (or strategy='cudagraph_full') and keep"
            " impl='none'; to capture the whole step, pass impl='local'",
        )
    if config.impl != "local":
        raise config_error(
            config.component,
            "impl",
            config.impl,
            "'local' with scope=['full_iteration']",
            "pass impl='local', or a scoped capture such as scope=['layer'] for Transformer Engine",
        )
    if config.warmup_steps < 1:
        raise config_error(
            config.component,
            "warmup_steps",
            config.warmup_steps,
            "at least 1 with full_iteration",
            "the optimizer creates its state in an eager step; pass warmup_steps=3",
        )


def _shown_modules(modules: Mapping[str, tuple[Selector, ...]], only: str | None = None) -> Verbatim:
    """``modules=`` as a user writes it (one selector bare, several as a list), or only its key ``only``."""
    shown = {only: modules[only]} if only is not None else modules
    items = (f"{name!r}: {sel[0] if len(sel) == 1 else list(sel)!r}" for name, sel in shown.items())
    return Verbatim("{" + ", ".join(items) + "}")


def _check_choice(component: str, option: str, value: Any, allowed: Sequence[str], fix: str) -> None:
    if value not in allowed:
        raise config_error(component, option, value, ", ".join(repr(a) for a in allowed), fix)


def _check_int(component: str, option: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise config_error(component, option, value, f"an integer >= {minimum}", fix)


def _check_bool(component: str, option: str, value: Any, fix: str) -> None:
    if not isinstance(value, bool):
        raise config_error(component, option, value, "True or False", fix)


def _check_positive(component: str, option: str, value: Any, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise config_error(component, option, value, "a positive number or None", fix)

"""Options of the staged rollout, declared once, and their validation before any GPU work.

:class:`CUDAGraphConfig` is the one declaration of the options: their names, accepted types and defaults.
:func:`takes_graph_options` gives the callback and both strategies explicit, typed signatures built from it, so
LightningCLI and ``help()`` see every option. Every rule raises ``ValueError`` with four parts: the component, the
offending value, the allowed values, and the fix. Rules that need the Trainer live in
:mod:`lightning_cudagraph.preflight`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_type_hints

import torch.nn as nn

from lightning_cudagraph.compiling import CompileOptions

#: A way to find modules: a glob on the qualified name, a module class, or a predicate ``(name, module) -> bool``.
Selector = str | type | Callable[[str, nn.Module], bool]

FULL_ITERATION = "full_iteration"
AUTO = "auto"
SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "layer")
IMPLS = ("none", "local", "transformer_engine")
SHAPE_CHANGE_POLICIES = ("eager", "recapture", "error")
FAILURE_POLICIES = ("eager", "raise")
TE_INSTALL = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
#: Graph sets kept with ``on_shape_change="recapture"`` when ``max_graphs`` is not given.
DEFAULT_MAX_GRAPHS = 4
#: Largest ``parity_tol``: the check compares ``max|graphed - eager| / max|eager|``, and above this a forward that
#: is off by a sign or a factor of two could pass. FP8 (3 mantissa bits) needs 0.125.
MAX_PARITY_TOL = 0.25


def config_error(component: str, option: str, value: Any, allowed: str, fix: str) -> ValueError:
    """Build the one error format of the package: component, value, allowed values, fix."""
    return ValueError(f"{component}: `{option}={value!r}` is not supported. Allowed: {allowed}. Fix: {fix}")


def _accepts(annotation: Any) -> dict[str, Any]:
    """Field metadata: the type a user passes, when the stored (normalized) type differs."""
    return {"accepts": annotation}


@dataclass(frozen=True)
class CUDAGraphConfig:
    """The options of :class:`~lightning_cudagraph.CUDAGraphCallback` and the strategies, validated.

    The fields are the options, documented on the callback. Build it with :meth:`from_options`, which normalizes
    (``scope`` to a tuple, ``modules`` to tuples of selectors) and validates.

    Example:
        >>> CUDAGraphConfig.from_options("CUDAGraphCallback", scope="attn,mlp").scope
        ('attn', 'mlp')
    """

    impl: Literal["none", "local", "transformer_engine"] = "local"
    scope: tuple[str, ...] = field(default=(AUTO,), metadata=_accepts(str | Sequence[str]))
    warmup_steps: int = 3
    modules: Mapping[str, tuple[Selector, ...]] = field(
        default_factory=dict, metadata=_accepts(Mapping[str, Any] | None)
    )
    on_shape_change: Literal["eager", "recapture", "error"] = "eager"
    on_failure: Literal["eager", "raise"] = "eager"
    max_graphs: int | None = None
    confirm_steps: int = 2
    parity_tol: float | None = None
    max_pool_mib: float | None = None
    seal_after_steps: int | None = None
    compile: CompileOptions | None = field(default=None, metadata=_accepts(bool | Mapping[str, Any]))

    @classmethod
    def from_options(cls, component: str, **options: Any) -> CUDAGraphConfig:
        """Normalize and validate options; raise ``ValueError`` naming ``component`` on the first bad one."""
        compiled = CompileOptions.from_option(component, options.pop("compile", False))
        modules = _normalize_modules(component, options.pop("modules", None))
        scope = _normalize_scope(component, options.pop("scope", AUTO))
        config = cls(scope=scope, modules=modules, compile=compiled, **options)
        config._validate(component)
        return config

    @property
    def enabled(self) -> bool:
        """Whether any graph may be captured at all."""
        return self.impl != "none"

    @property
    def full_iteration(self) -> bool:
        """Whether the whole training step is captured (an exclusive mode)."""
        return self.scope == (FULL_ITERATION,)

    @property
    def auto_scope(self) -> bool:
        """Whether the scope is chosen from the model (``scope="auto"``)."""
        return self.scope == (AUTO,)

    @property
    def eager_steps(self) -> int:
        """Optimizer steps that run eagerly before capture (at least one, to record input signatures)."""
        return max(self.warmup_steps, 1)

    @property
    def graph_set_limit(self) -> int:
        """Most graph sets (one per batch shape) held at once."""
        if self.on_shape_change != "recapture":
            return 1
        return self.max_graphs if self.max_graphs is not None else DEFAULT_MAX_GRAPHS

    def options(self) -> dict[str, Any]:
        """The options as keyword arguments, in the form a user passes them (to build a callback from a strategy)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["scope"] = AUTO if self.auto_scope else list(self.scope)
        values["modules"] = {name: list(selectors) for name, selectors in self.modules.items()} or None
        values["compile"] = False if self.compile is None else self.compile.as_option()
        return values

    def _validate(self, component: str) -> None:
        _check_choice(component, "impl", self.impl, IMPLS, "pass impl='local' (PyTorch graphs)")
        _check_choice(component, "on_shape_change", self.on_shape_change, SHAPE_CHANGE_POLICIES, "pick one of them")
        _check_choice(component, "on_failure", self.on_failure, FAILURE_POLICIES, "pick one of them")
        _check_int(component, "warmup_steps", self.warmup_steps, 0, "pass a count of eager steps, e.g. 3")
        _check_int(component, "confirm_steps", self.confirm_steps, 1, "pass at least 1")
        _check_positive(component, "max_pool_mib", self.max_pool_mib, "pass a budget in MiB, or None for no limit")
        if self.seal_after_steps is not None:
            _check_int(component, "seal_after_steps", self.seal_after_steps, 1, "pass an optimizer step, or None")
        self._validate_parity_tol(component)
        self._validate_max_graphs(component)
        self._validate_scope(component)
        self._validate_compile(component)
        if self.impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise config_error(
                component,
                "impl",
                self.impl,
                "'local' without Transformer Engine; 'transformer_engine' once it is installed",
                f"install it (`{TE_INSTALL}`, or `pip install lightning-cudagraph[transformer-engine]`)"
                " or pass impl='local'",
            )

    def _validate_compile(self, component: str) -> None:
        if self.compile is None:
            return
        if self.auto_scope:
            raise config_error(
                component,
                "compile",
                self.compile.as_option(),
                "compile with a fixed scope (scope=['layer'], ['attn', 'mlp'], ... or strategy='cudagraph_full')",
                "pick the scope: under scope='auto' each level of the ladder would compile its regions anew (a"
                " compile per level)",
            )
        if self.impl == "transformer_engine":
            raise config_error(
                component,
                "compile",
                self.compile.as_option(),
                "compile with impl='local' (or impl='none', which captures and compiles nothing)",
                "drop compile (Transformer Engine's fused modules are not compiled here), or pass impl='local'",
            )

    def _validate_parity_tol(self, component: str) -> None:
        value = self.parity_tol
        if value is None:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not 0 < value <= MAX_PARITY_TOL:
            raise config_error(
                component,
                "parity_tol",
                value,
                f"a relative tolerance in (0, {MAX_PARITY_TOL}], or None for the precision's default",
                f"pass e.g. 1e-3; a larger tolerance would let a wrong graph pass confirmation (above"
                f" {MAX_PARITY_TOL}, a forward off by a factor of two is indistinguishable)",
            )

    def _validate_max_graphs(self, component: str) -> None:
        if self.max_graphs is None:
            return
        _check_int(component, "max_graphs", self.max_graphs, 1, "pass at least 2 with on_shape_change='recapture'")
        if self.on_shape_change != "recapture":
            raise config_error(
                component,
                "max_graphs",
                self.max_graphs,
                "max_graphs only with on_shape_change='recapture' (the other policies keep one graph set)",
                "pass on_shape_change='recapture' as well, or drop max_graphs",
            )
        if self.max_graphs < 2:
            raise config_error(
                component,
                "max_graphs",
                self.max_graphs,
                "at least 2 with on_shape_change='recapture' (the first shape already holds one graph set)",
                "pass max_graphs=2 or more, or on_shape_change='eager' to run other shapes eagerly",
            )

    def _validate_scope(self, component: str) -> None:
        known = (*SCOPES, *(k for k in self.modules if k not in SCOPES))
        allowed = f"'auto', or a list from {', '.join(repr(s) for s in known)}"
        if AUTO in self.scope and len(self.scope) > 1:
            raise config_error(component, "scope", list(self.scope), allowed, "pass 'auto' alone or a list of scopes")
        for name in self.scope:
            if name != AUTO and name not in known:
                raise config_error(
                    component, "scope", list(self.scope), allowed, f"remove {name!r} or define it with modules=..."
                )
        if FULL_ITERATION in self.scope:
            self._validate_full_iteration(component)
        if "moe" in self.scope and "moe_router" in self.scope:
            raise config_error(
                component,
                "scope",
                list(self.scope),
                "'moe' (the whole MoE layer) or 'moe_router' (its router), not both",
                "drop one of them",
            )
        if "moe_preprocess" in self.scope and "moe_router" not in self.scope:
            raise config_error(
                component,
                "scope",
                list(self.scope),
                "'moe_preprocess' together with 'moe_router'",
                "add 'moe_router' (the preprocess consumes the router's output)",
            )

    def _validate_full_iteration(self, component: str) -> None:
        if len(self.scope) > 1:
            raise config_error(
                component,
                "scope",
                list(self.scope),
                "'full_iteration' alone, or scoped names without it",
                "full_iteration captures the whole step; pass scope=['full_iteration'] alone",
            )
        if self.impl != "local":
            raise config_error(
                component,
                "impl",
                self.impl,
                "'local' with scope=['full_iteration']",
                "pass impl='local', or a scoped capture such as scope=['layer'] for Transformer Engine",
            )
        if self.warmup_steps < 1:
            raise config_error(
                component,
                "warmup_steps",
                self.warmup_steps,
                "at least 1 with full_iteration",
                "the optimizer creates its state in an eager step; pass warmup_steps=3",
            )


_Init = TypeVar("_Init", bound=Callable[..., None])
#: Defaults in the form a user passes them, where the stored (normalized) form differs.
PUBLIC_DEFAULTS: dict[str, Any] = {"scope": AUTO, "modules": None, "compile": False}


def takes_graph_options(init: _Init) -> _Init:
    """Give ``__init__(self, config, **own)`` a signature that lists every option of :class:`CUDAGraphConfig`.

    The decorated ``__init__`` accepts the options (positionally first, or by keyword) followed by its own
    parameters, validates the options into a :class:`CUDAGraphConfig` named after the class, and receives that.
    The signature is a real one (``inspect.signature``, LightningCLI, jsonargparse), with types and defaults.
    """
    hints = get_type_hints(CUDAGraphConfig)
    options = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=PUBLIC_DEFAULTS.get(f.name, f.default),
            annotation=f.metadata.get("accepts", hints[f.name]),
        )
        for f in fields(CUDAGraphConfig)
    ]
    own_hints = get_type_hints(init)
    own = [
        parameter.replace(annotation=own_hints.get(parameter.name, parameter.annotation))
        for parameter in inspect.signature(init).parameters.values()
    ]
    self_parameter, own = own[0], own[2:]  # drop ``config``: the options stand in its place
    signature = inspect.Signature([self_parameter, *options, *own], return_annotation=None)
    names = [option.name for option in options]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop(self_parameter.name)
        config = CUDAGraphConfig.from_options(type(self).__name__, **{n: values.pop(n) for n in names})
        extra = {p.name: values.pop(p.name) for p in own if p.kind is inspect.Parameter.VAR_KEYWORD}
        init(self, config, **values, **next(iter(extra.values()), {}))

    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values() if p is not self_parameter}
    del wrapper.__wrapped__  # the signature above, not the inner one, is the public one
    return wrapper  # type: ignore[return-value]


def _normalize_scope(component: str, scope: Any) -> tuple[str, ...]:
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


def _normalize_modules(component: str, modules: Any) -> dict[str, tuple[Selector, ...]]:
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


def _check_choice(component: str, option: str, value: Any, allowed: Sequence[str], fix: str) -> None:
    if value not in allowed:
        raise config_error(component, option, value, ", ".join(repr(a) for a in allowed), fix)


def _check_int(component: str, option: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise config_error(component, option, value, f"an integer >= {minimum}", fix)


def _check_positive(component: str, option: str, value: Any, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise config_error(component, option, value, "a positive number or None", fix)

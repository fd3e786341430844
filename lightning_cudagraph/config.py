"""Options of the staged rollout, and their validation before any GPU work.

Every rule raises ``ValueError`` with four parts: the component, the offending value, the allowed values, and
the fix. Rules that need the Trainer live in :mod:`lightning_cudagraph.preflight`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

#: A way to find modules: a glob on the qualified name, a module class, or a predicate ``(name, module) -> bool``.
Selector = str | type | Callable[[str, nn.Module], bool]

FULL_ITERATION = "full_iteration"
AUTO = "auto"
SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "layer")
IMPLS = ("none", "local", "transformer_engine")
SHAPE_CHANGE_POLICIES = ("eager", "recapture", "error")
FAILURE_POLICIES = ("eager", "raise")
TE_INSTALL = 'pip install --no-build-isolation "transformer_engine[pytorch]"'


def config_error(component: str, option: str, value: Any, allowed: str, fix: str) -> ValueError:
    """Build the one error format of the package: component, value, allowed values, fix."""
    return ValueError(f"{component}: `{option}={value!r}` is not supported. Allowed: {allowed}. Fix: {fix}")


@dataclass(frozen=True)
class CUDAGraphConfig:
    """Validated options shared by :class:`~lightning_cudagraph.CUDAGraphCallback` and the strategies.

    Build it with :meth:`from_options`, which normalizes and validates; the fields mirror the callback's
    arguments (see its docstring).
    """

    impl: str = "local"
    scope: tuple[str, ...] = (AUTO,)
    warmup_steps: int = 3
    modules: Mapping[str, tuple[Selector, ...]] = field(default_factory=dict)
    on_shape_change: str = "eager"
    on_failure: str = "eager"
    max_graphs: int = 4
    confirm_steps: int = 2
    parity_tol: float | None = None
    max_pool_mib: float | None = None

    @classmethod
    def from_options(cls, component: str, **options: Any) -> CUDAGraphConfig:
        """Normalize and validate options; raise ``ValueError`` naming ``component`` on the first bad one."""
        modules = _normalize_modules(component, options.pop("modules", None))
        scope = _normalize_scope(component, options.pop("scope", AUTO))
        config = cls(scope=scope, modules=modules, **options)
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
        """Whether the narrowest scope that finds modules is chosen at setup."""
        return self.scope == (AUTO,)

    @property
    def capture_after(self) -> int:
        """Optimizer steps that run eagerly before capture (at least one, to record input signatures)."""
        return max(self.warmup_steps, 1)

    def options(self) -> dict[str, Any]:
        """The options as keyword arguments, for building a callback from a strategy."""
        return {
            "impl": self.impl,
            "scope": list(self.scope) if not self.auto_scope else AUTO,
            "warmup_steps": self.warmup_steps,
            "modules": {k: list(v) for k, v in self.modules.items()} or None,
            "on_shape_change": self.on_shape_change,
            "on_failure": self.on_failure,
            "max_graphs": self.max_graphs,
            "confirm_steps": self.confirm_steps,
            "parity_tol": self.parity_tol,
            "max_pool_mib": self.max_pool_mib,
        }

    def _validate(self, component: str) -> None:
        _check_choice(component, "impl", self.impl, IMPLS, "pass impl='local' (PyTorch graphs)")
        _check_choice(component, "on_shape_change", self.on_shape_change, SHAPE_CHANGE_POLICIES, "pick one of them")
        _check_choice(component, "on_failure", self.on_failure, FAILURE_POLICIES, "pick one of them")
        _check_int(component, "warmup_steps", self.warmup_steps, 0, "pass a count of eager steps, e.g. 3")
        _check_int(component, "max_graphs", self.max_graphs, 1, "pass at least 1")
        _check_int(component, "confirm_steps", self.confirm_steps, 1, "pass at least 1")
        _check_positive(component, "parity_tol", self.parity_tol, "pass a relative tolerance such as 1e-3, or None")
        _check_positive(component, "max_pool_mib", self.max_pool_mib, "pass a budget in MiB, or None for no limit")
        self._validate_scope(component)
        if self.impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise config_error(
                component,
                "impl",
                self.impl,
                "'local' without Transformer Engine; 'transformer_engine' once it is installed",
                f"install it (`{TE_INSTALL}`, or `pip install lightning-cudagraph[transformer-engine]`)"
                " or pass impl='local'",
            )
        if self.enabled:
            ensure_graph_safe_allocator(component)

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


def ensure_graph_safe_allocator(component: str) -> None:
    """Guard the allocator setting that makes NCCL and CUDA graphs fault: set the fix, or refuse a conflicting one.

    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` with NCCL buffer registration in graphs causes illegal
    memory accesses; ``NCCL_GRAPH_REGISTER=0`` avoids them. Unset, it is set here (before any process group
    starts); explicitly set to anything else, it is an error.
    """
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if "expandable_segments:true" not in alloc_conf:
        return
    register = os.environ.get("NCCL_GRAPH_REGISTER")
    if register is None:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"
        rank_zero_info(
            f"{component}: set NCCL_GRAPH_REGISTER=0 because PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True"
            " (NCCL's graph buffer registration faults on expandable segments)."
        )
    elif register != "0":
        raise config_error(
            component,
            "NCCL_GRAPH_REGISTER",
            register,
            "'0' while PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True",
            "export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF",
        )


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

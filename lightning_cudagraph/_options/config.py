"""The options once normalized and validated: :class:`CUDAGraphConfig`, and what follows from them.

The options are declared once, in :mod:`lightning_cudagraph._options.options`; validation runs before any GPU work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from lightning_cudagraph._options.compile_options import CompileOptions
from lightning_cudagraph._options.errors import Verbatim, config_error
from lightning_cudagraph._options.normalization import compile_options, normalize_modules, normalize_scope, plain
from lightning_cudagraph._options.options import AUTO, DEFAULT_MAX_GRAPHS, FULL_ITERATION, OPTIONS, SCOPES, Selector
from lightning_cudagraph._options.validation import validate

# FULL_ITERATION, SCOPES, Selector, Verbatim and config_error are read from here by the rooms below the callback.
__all__ = ["FULL_ITERATION", "SCOPES", "CUDAGraphConfig", "Selector", "Verbatim", "config_error"]


@dataclass(frozen=True)
class CUDAGraphConfig:
    """The options of :class:`~lightning_cudagraph.CUDAGraphCallback` and the strategies, validated.

    The fields are the options of :data:`~lightning_cudagraph._options.options.OPTIONS`, in their stored forms
    (``scope`` a tuple, ``modules`` tuples of selectors); :meth:`from_options` builds it.
    """

    impl: Literal["none", "local", "transformer_engine"] = "local"
    scope: tuple[str, ...] = (AUTO,)
    warmup_steps: int = 3
    modules: Mapping[str, tuple[Selector, ...]] = field(default_factory=dict)
    on_shape_change: Literal["eager", "recapture", "error"] = "eager"
    on_failure: Literal["eager", "raise"] = "eager"
    max_graphs: int | None = None
    confirm_steps: int = 2
    parity_tol: float | None = None
    max_pool_mib: float | None = None
    seal_after_steps: int | None = None
    audit_every_n_steps: int | None = 1000
    eval_graphs: bool = True
    optimizer_graph: bool = True
    compile: CompileOptions | None = None
    #: Named in messages and errors: the class the options were given to (not an option; configs compare without it).
    component: str = field(default="CUDAGraphCallback", compare=False)

    @classmethod
    def from_options(cls, component: str, **options: Any) -> CUDAGraphConfig:
        """Normalize and validate options; raise ``ValueError`` naming ``component`` on the first bad one.

        NumPy scalars and arrays are taken as the Python numbers and lists they hold.
        """
        options = {name: plain(value) for name, value in options.items()}
        scope = normalize_scope(component, options.pop("scope", AUTO))
        compiled = compile_options(component, options.pop("compile", False), scope, options.get("impl"))
        modules = normalize_modules(component, options.pop("modules", None))
        config = cls(scope=scope, modules=modules, compile=compiled, component=component, **options)
        validate(config)
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
        values = {option.name: getattr(self, option.name) for option in OPTIONS}
        values["scope"] = AUTO if self.auto_scope else list(self.scope)
        values["modules"] = {name: list(selectors) for name, selectors in self.modules.items()} or None
        values["compile"] = False if self.compile is None else self.compile.as_option()
        return values


if [f.name for f in fields(CUDAGraphConfig)] != [*(option.name for option in OPTIONS), "component"]:
    raise TypeError("lightning_cudagraph: CUDAGraphConfig's fields and the declared OPTIONS differ")

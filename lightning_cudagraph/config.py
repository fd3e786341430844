"""Options of the staged rollout, declared once, and their validation before any GPU work.

:class:`CUDAGraphConfig` is the one declaration of the options: their names, accepted types and defaults.
:func:`takes_graph_options` gives the callback and both strategies explicit, typed signatures built from it, so
LightningCLI and ``help()`` see every option. Every rule raises ``ValueError`` with four parts: the component, the
offending value, the allowed values, and the fix. Rules that need the Trainer live in
:mod:`lightning_cudagraph.preflight`.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import math
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_type_hints

import torch.nn as nn

from lightning_cudagraph.compile_options import CompileOptions

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
#: Largest ``confirm_steps``: each confirmation step runs an extra eager forward per region, and under
#: ``scope="auto"`` every level confirms before the next is tried; beyond this a fit would stay in confirmation.
MAX_CONFIRM_STEPS = 100

#: The description of every option, written once: the ``Args:`` of the callback and both strategies are built from
#: it (:func:`documents_graph_options`), which is what ``help()``, the API reference and LightningCLI show.
OPTION_DOCS: dict[str, str] = {
    "impl": '``"local"`` (PyTorch graphs), ``"transformer_engine"`` (Transformer Engine graphs, FP8-aware) or'
    ' ``"none"`` (everything off: the fit trains eagerly, whatever the other options say).',
    "scope": '``"auto"`` (try the levels ``attn``, ``attn+mlp``, ``layer`` and, with one of the package\'s'
    " strategies, the whole step; keep the fastest: :mod:`lightning_cudagraph.ladder`), or a list from"
    " ``full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba, layer`` and the keys of ``modules``"
    ' (a comma-separated string works too: ``"attn,mlp"``). ``full_iteration`` captures the whole training step'
    " and needs :class:`~lightning_cudagraph.CUDAGraphStrategy` or"
    " :class:`~lightning_cudagraph.DDPCUDAGraphStrategy`.",
    "warmup_steps": "Eager optimizer steps before capture (at least one step always runs eagerly; at least 11 for"
    " ``full_iteration`` under DDP).",
    "modules": "Per-scope selectors that override the built-in patterns, or define new scopes: a glob on qualified"
    ' module names (``"blocks.*.attn"``), an ``nn.Module`` subclass, or a predicate ``(name, module) -> bool``;'
    ' or a list of these. With a fixed ``scope``, every key must be one of its names; under ``scope="auto"`` a'
    " new key joins every level, and a key that looks like a misspelt built-in scope is refused.",
    "on_shape_change": 'What a batch of another shape does once graphs exist: ``"eager"`` (that step runs'
    ' eagerly, counted), ``"recapture"`` (the shape gets its own eager step, capture and confirmation; the'
    " ``max_graphs`` least recently used graph sets are kept, others evicted and captured again when their shape"
    ' returns) or ``"error"``. Pad batches to a few lengths (:mod:`lightning_cudagraph.bucketing`).',
    "on_failure": '``"eager"`` (roll back and keep training eagerly, with a warning) or ``"raise"``.',
    "max_graphs": 'Most graph sets (batch shapes) held with ``on_shape_change="recapture"`` (at least 2; 4 when'
    ' not given). Only with ``"recapture"``: the other policies keep one graph set.',
    "confirm_steps": f"Steps after capture that are checked before the graphs are trusted (1 to {MAX_CONFIRM_STEPS}).",
    "parity_tol": f"Largest relative difference allowed between graphed and eager forwards, at most {MAX_PARITY_TOL}"
    " (above that the check could not tell a wrong graph from a right one); by default 1e-4 in float32, 2e-2 under"
    " autocast and 0.125 under FP8.",
    "max_pool_mib": "Memory budget of the graphs' pool in MiB (``None``: no limit).",
    "seal_after_steps": "From this optimizer step on (at most ``Trainer(max_steps=...)``), the set of batch shapes"
    " is closed: a shape without graphs raises, naming it and the captured shapes (``None``: never;"
    " :meth:`~lightning_cudagraph.CUDAGraphCallback.seal` closes it by hand). A seal taken before the first"
    " capture (during the eager warmup steps) closes the set to the shape that warmup captures: that shape is"
    " still captured when warmup ends, and any other shape raises.",
    "audit_every_n_steps": "The numerics guard: every this many replayed steps, the graphs are checked against"
    " eager on a real batch. The whole step runs a shadow step (the graph replays, the state is put back, the step"
    " runs eagerly and is kept; loss and parameter update must agree); scoped graphs check one region's forward"
    ' against eager (round-robin). A failure rolls back (or raises with ``on_failure="raise"``); a region that'
    " fails is left eager. Every captured whole step is also shadow-checked on its capture step. ``None`` or 0:"
    " confirmation only. Each audit costs about one eager step.",
    "compile": "``False`` (no compilation), ``True`` (``torch.compile`` with inductor's defaults on what is about"
    " to be captured, compiled during the eager warmup steps, then held by the graphs) or a dict of"
    ' ``torch.compile`` arguments: ``backend``, ``fullgraph``, ``mode`` (``"default"`` or'
    ' ``"max-autotune-no-cudagraphs"``) or ``options`` (inductor options, e.g. ``{"max_autotune": True}``).'
    ' Shapes are static. Needs a fixed ``scope`` (not ``"auto"``), ``impl="local"`` and one device; inductor\'s'
    ' own CUDA graphs (``mode="reduce-overhead"``, ``options={"triton.cudagraphs": True}``) are refused: graphs'
    " in graphs. See :mod:`lightning_cudagraph.compiling`.",
}


def config_error(component: str, option: str, value: Any, allowed: str, fix: str) -> ValueError:
    """Build the one error format of the package: component, value, allowed values, fix.

    A Trainer argument, named ``"Trainer(devices=...)"``, is shown as the user wrote it: ``Trainer(devices=2)``.

    Example:
        >>> str(config_error("CUDAGraphStrategy", "Trainer(devices=...)", 2, "one device", "pass devices=1"))
        'CUDAGraphStrategy: `Trainer(devices=2)` is not supported. Allowed: one device. Fix: pass devices=1'
    """
    shown = f"{option[: -len('...)')]}{value!r})" if option.endswith("=...)") else f"{option}={value!r}"
    return ValueError(f"{component}: `{shown}` is not supported. Allowed: {allowed}. Fix: {fix}")


class Verbatim(str):
    """A value shown in a message as written (no quotes), e.g. ``[CUDAGraphCallback(...), CUDAGraphCallback(...)]``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def did_you_mean(name: str, choices: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``name`` (case-insensitive), or ``None`` when none is close.

    Example:
        >>> did_you_mean("atn", SCOPES), did_you_mean("head", SCOPES)
        ('attn', None)
    """
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[close[0]] if close else None


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
    audit_every_n_steps: int | None = 1000
    compile: CompileOptions | None = field(default=None, metadata=_accepts(bool | Mapping[str, Any]))

    @classmethod
    def from_options(cls, component: str, **options: Any) -> CUDAGraphConfig:
        """Normalize and validate options; raise ``ValueError`` naming ``component`` on the first bad one."""
        scope = _normalize_scope(component, options.pop("scope", AUTO))
        compiled = _compile_options(component, options.pop("compile", False), scope, options.get("impl"))
        modules = _normalize_modules(component, options.pop("modules", None))
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
        if self.confirm_steps > MAX_CONFIRM_STEPS:
            raise config_error(
                component,
                "confirm_steps",
                self.confirm_steps,
                f"1 to {MAX_CONFIRM_STEPS}",
                "pass e.g. confirm_steps=2 (the default): each confirmation step runs the eager forward beside the"
                " graphs, and under scope='auto' every level confirms before the next is tried, so"
                f" {self.confirm_steps} steps would keep the fit in confirmation",
            )
        _check_positive(component, "max_pool_mib", self.max_pool_mib, "pass a budget in MiB, or None for no limit")
        if self.seal_after_steps is not None:
            _check_int(component, "seal_after_steps", self.seal_after_steps, 1, "pass an optimizer step, or None")
        if self.audit_every_n_steps is not None:
            _check_int(component, "audit_every_n_steps", self.audit_every_n_steps, 0, "pass a number of steps, or None")
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
                f"install it (`{TE_INSTALL}`) or pass impl='local'",
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
                close = did_you_mean(name, known)
                hint = f"did you mean {close!r}? Otherwise " if close is not None else ""
                raise config_error(
                    component,
                    "scope",
                    list(self.scope),
                    allowed,
                    f"{hint}remove {name!r} or define it with modules={{{name!r}: 'a.glob.*.name'}}",
                )
        self._validate_modules_keys(component)
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

    def _validate_modules_keys(self, component: str) -> None:
        """A ``modules=`` key must take effect: used by a fixed scope, and under ``auto`` not a misspelt built-in."""
        builtin = [s for s in SCOPES if s != FULL_ITERATION]
        if self.modules and self.full_iteration:
            raise config_error(
                component,
                "modules",
                _shown_modules(self.modules),
                "no modules= with scope=['full_iteration'] (the whole step is captured, not modules)",
                "drop modules=, or pass the scopes it defines instead of full_iteration, e.g."
                f" scope={list(self.modules)!r}",
            )
        for name in self.modules:
            if name in SCOPES:
                if not self.auto_scope and name not in self.scope:
                    raise config_error(
                        component,
                        "modules",
                        _shown_modules(self.modules, name),
                        f"keys that name a scope in scope={list(self.scope)!r}",
                        f"the {name!r} selectors would be unused: add {name!r} to scope= (e.g."
                        f" scope={[*self.scope, name]!r}), or drop the key",
                    )
                continue
            close = did_you_mean(name, builtin)
            if self.auto_scope and close is not None:
                raise config_error(
                    component,
                    "modules",
                    _shown_modules(self.modules, name),
                    f"built-in scope names ({', '.join(builtin)}) to override them, or a new scope name unlike any"
                    " of them (under scope='auto' a new scope joins every level)",
                    f"did you mean {close!r}? Rename the key to {close!r} to override its patterns (as written, a new"
                    f" scope {name!r} would be captured beside the built-in {close!r}), or pick a distinct name for a"
                    " new scope",
                )
            if not self.auto_scope and name not in self.scope:
                hint = f"; or did you mean {close!r}?" if close is not None else ""
                raise config_error(
                    component,
                    "modules",
                    _shown_modules(self.modules, name),
                    f"keys that name a scope in scope={list(self.scope)!r}",
                    f"the new scope {name!r} is not asked for: add it to scope= (e.g."
                    f" scope={[*self.scope, name]!r}), or drop the key{hint}",
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
        if self.impl == "none":
            raise config_error(
                component,
                "impl",
                self.impl,
                "'local' with scope=['full_iteration']; impl='none' with any other scope",
                "to train without graphs, drop scope=['full_iteration'] (or strategy='cudagraph_full') and keep"
                " impl='none'; to capture the whole step, pass impl='local'",
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
_T = TypeVar("_T")
#: Defaults in the form a user passes them, where the stored (normalized) form differs.
PUBLIC_DEFAULTS: dict[str, Any] = {"scope": AUTO, "modules": None, "compile": False}


def takes_graph_options(init: _Init) -> _Init:
    """Give ``__init__(self, config, **own)`` a signature that lists every option of :class:`CUDAGraphConfig`.

    The decorated ``__init__`` accepts the options (positionally first, or by keyword) followed by its own
    parameters, validates the options into a :class:`CUDAGraphConfig` named after the class, and receives that.
    The signature is a real one (``inspect.signature``, LightningCLI, jsonargparse), with types and defaults.

    A keyword that is not an option is refused with the closest option named. When jsonargparse builds the class
    (LightningCLI), a configuration error ends the program with the package's message as its first line, as a
    command-line error does: jsonargparse would otherwise bury the ``ValueError`` inside its Union traceback.
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
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own)
    accepted = [p.name for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD][1:]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        component = type(self).__name__
        try:
            _refuse_unknown_keywords(component, kwargs, accepted, names if takes_any else None)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            values.pop(self_parameter.name)
            config = CUDAGraphConfig.from_options(component, **{n: values.pop(n) for n in names})
            extra = {p.name: values.pop(p.name) for p in own if p.kind is inspect.Parameter.VAR_KEYWORD}
            init(self, config, **values, **next(iter(extra.values()), {}))
        except ValueError as error:
            if _built_by_jsonargparse():
                raise SystemExit(str(error)) from error
            raise

    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values() if p is not self_parameter}
    del wrapper.__wrapped__  # the signature above, not the inner one, is the public one
    return wrapper  # type: ignore[return-value]


def documents_graph_options(cls: type[_T]) -> type[_T]:
    """Write :data:`OPTION_DOCS` into the ``Args:`` of ``cls``, in place of its ``**options:`` entry.

    The class docstring keeps one ``**options:`` line where the options belong; this replaces it with one entry per
    option (in :class:`CUDAGraphConfig` order), so ``help()``, the API reference and LightningCLI's ``--help``
    (jsonargparse reads ``Args:`` with docstring_parser) describe every option, from one text.
    """
    missing = [f.name for f in fields(CUDAGraphConfig) if not OPTION_DOCS.get(f.name)]
    if missing:
        raise TypeError(f"lightning_cudagraph: options without a description in OPTION_DOCS: {missing}")
    lines = (cls.__doc__ or "").splitlines()
    marker = next((i for i, line in enumerate(lines) if line.lstrip().startswith("**options:")), None)
    if marker is None:
        raise TypeError(f"{cls.__name__}: its docstring has no `**options:` entry in Args: to document the options")
    indent = lines[marker][: len(lines[marker]) - len(lines[marker].lstrip())]
    end = marker + 1
    while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > len(indent):
        end += 1  # the marker's own continuation lines
    entries = [
        textwrap.fill(
            OPTION_DOCS[f.name],
            width=120,
            initial_indent=f"{indent}{f.name}: ",
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for f in fields(CUDAGraphConfig)
    ]
    cls.__doc__ = "\n".join([*lines[:marker], *entries, *lines[end:]])
    return cls


def _refuse_unknown_keywords(
    component: str, kwargs: Mapping[str, Any], accepted: Sequence[str], options: Sequence[str] | None
) -> None:
    """A keyword that is not a parameter (``options``: only those close to an option, for ``**kwargs`` classes)."""
    for name, value in kwargs.items():
        if name in accepted:
            continue
        close = did_you_mean(name, options if options is not None else accepted, cutoff=0.75)
        if options is not None and close is None and name != "capture_backend":
            continue  # passed on to the base class (DDP's arguments)
        if name == "capture_backend":
            instance = "strategy" if component.endswith("Strategy") else "callback"
            fix = (
                f"set it on the instance after construction: `{instance}.capture_backend = backend`"
                " (a CaptureBackend instance); it is not an option, so it stays out of LightningCLI and checkpoints"
            )
        else:
            fix = f"did you mean {close!r}?" if close is not None else "drop it, or pass one of the options above"
        raise config_error(component, name, value, f"the options {', '.join(accepted)}", fix)


def _built_by_jsonargparse() -> bool:
    """Whether jsonargparse (LightningCLI) is instantiating the class: it wraps every error in its Union message."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "jsonargparse" or module.startswith("jsonargparse."):
            return True
        frame = frame.f_back
    return False


def _shown_modules(modules: Mapping[str, tuple[Selector, ...]], only: str | None = None) -> Verbatim:
    """``modules=`` as a user writes it (one selector bare, several as a list), or only its key ``only``."""
    shown = {only: modules[only]} if only is not None else modules
    items = (f"{name!r}: {sel[0] if len(sel) == 1 else list(sel)!r}" for name, sel in shown.items())
    return Verbatim("{" + ", ".join(items) + "}")


def _compile_options(component: str, value: Any, scope: tuple[str, ...], impl: Any) -> CompileOptions | None:
    """``compile=`` checked for what :class:`CompileOptions` cannot name: its type, and inductor option names."""
    if value is not None and not isinstance(value, (bool, Mapping)):
        fixed = "scope=['layer']" if scope == (AUTO,) else f"scope={list(scope)!r}"
        fixed += ", impl='local'" if impl == "transformer_engine" else ""
        raise config_error(
            component,
            "compile",
            value,
            "False, True, or a dict of torch.compile arguments (backend, fullgraph, mode, options)",
            f"pass compile=True with a fixed scope, e.g. {fixed}, compile=True (compile= does not run under"
            " scope='auto'), or compile=False",
        )
    if isinstance(value, Mapping) and isinstance(value.get("options"), Mapping) and value["options"]:
        _check_inductor_options(component, value)
    return CompileOptions.from_option(component, value)


def _check_inductor_options(component: str, value: Mapping[str, Any]) -> None:
    """Unknown inductor options fail inside torch.compile at the first step, listing ~600 names: refuse them now."""
    import torch._inductor  # imported only for a dict of options: it takes seconds

    known = torch._inductor.list_options()
    for name in value["options"]:
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

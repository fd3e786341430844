"""Scope names to the modules they capture: built-in name and class patterns, overridable per scope.

A match nested inside another match (``blocks.0.attn`` inside ``blocks.0`` when both ``attn`` and ``layer`` are
asked for) resolves to the outer one, so every region of the model is captured by one graph.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from lightning_cudagraph.config import AUTO, FULL_ITERATION, Selector

_LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks", "block", "decoder_layers", "encoder_layers"})
_MOE_NAMES = frozenset({"moe", "block_sparse_moe", "sparse_moe", "moe_layer", "moe_block", "mlp_moe"})


@dataclass(frozen=True)
class _Rule:
    """A built-in scope: attribute names, class names (matched without importing the library), parent names."""

    names: frozenset[str] = frozenset()
    class_names: frozenset[str] = frozenset()
    classes: tuple[type, ...] = ()
    names_under_moe: frozenset[str] = frozenset()
    layer_children: bool = False

    def matches(self, qualified_name: str, module: nn.Module) -> bool:
        parts = qualified_name.split(".")
        attr, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
        if attr in self.names or type(module).__name__ in self.class_names or isinstance(module, self.classes):
            return True
        if attr in self.names_under_moe and parent in _MOE_NAMES:
            return True
        return self.layer_children and attr.isdigit() and parent in _LAYER_CONTAINERS


BUILTIN_RULES: dict[str, _Rule] = {
    "attn": _Rule(
        names=frozenset({"attn", "attention", "self_attn", "self_attention", "mha", "multihead_attn"}),
        class_names=frozenset({"MultiheadAttention", "DotProductAttention"}),
        classes=(nn.MultiheadAttention,),
    ),
    "mlp": _Rule(
        names=frozenset({"mlp", "ffn", "feed_forward", "feedforward"}),
        class_names=frozenset({"LayerNormMLP"}),
    ),
    "moe": _Rule(names=_MOE_NAMES, class_names=frozenset({"MoELayer", "SparseMoeBlock"})),
    "moe_router": _Rule(
        names=frozenset({"router", "moe_router"}),
        class_names=frozenset({"TopKRouter", "Router"}),
        names_under_moe=frozenset({"gate"}),
    ),
    "moe_preprocess": _Rule(
        names=frozenset({"preprocess", "moe_preprocess", "dispatcher", "token_dispatcher"}),
        class_names=frozenset({"MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"}),
    ),
    "mamba": _Rule(
        names=frozenset({"mamba", "mamba_mixer"}),
        class_names=frozenset({"MambaMixer", "Mamba2Mixer", "Mamba", "Mamba2", "MambaLayer"}),
    ),
    "layer": _Rule(
        class_names=frozenset({"TransformerLayer"}),
        classes=(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
        layer_children=True,
    ),
}

#: The order in which ``scope="auto"`` tries scopes: the narrowest one that finds modules wins.
AUTO_ORDER = ("attn", "mlp", "layer")


@dataclass(frozen=True)
class Target:
    """A module that is captured as one region, and the scope that selected it."""

    name: str
    module: nn.Module
    scope: str


@dataclass
class ScopeResolution:
    """What the scopes found: the targets in model order, and what each scope matched before nesting."""

    targets: list[Target] = field(default_factory=list)
    matched: dict[str, list[str]] = field(default_factory=dict)
    nested: dict[str, str] = field(default_factory=dict)
    chosen_by_auto: str | None = None

    def summary(self) -> str:
        """One line a user can read: modules per scope, and the regions folded into an enclosing one."""
        parts = [f"{scope}: {len(names)} ({_abbreviate(names)})" for scope, names in self.matched.items()]
        text = "; ".join(parts) if parts else "no modules"
        if self.chosen_by_auto:
            text = f"auto chose {self.chosen_by_auto!r}; {text}"
        if self.nested:
            text += f"; {len(self.nested)} nested match(es) folded into their enclosing region"
        return text


def resolve_scopes(
    model: nn.Module,
    scope: Sequence[str],
    overrides: Mapping[str, Sequence[Selector]] | None = None,
    component: str = "CUDAGraphCallback",
) -> ScopeResolution:
    """Find the modules each scope names; raise ``ValueError`` for a scope that matches nothing.

    Args:
        model: The LightningModule (never captured itself).
        scope: Scope names, or ``("auto",)``.
        overrides: Per-scope selectors that replace the built-in patterns (or define new scopes).
        component: Named in error messages.

    Example:
        >>> import torch.nn as nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)
        >>> model = nn.Module()
        >>> model.blocks = nn.ModuleList([Block(), Block()])
        >>> [t.name for t in resolve_scopes(model, ["attn", "mlp"]).targets]
        ['blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp']
        >>> [t.name for t in resolve_scopes(model, ["layer", "attn"]).targets]
        ['blocks.0', 'blocks.1']
    """
    overrides = overrides or {}
    named = [(name, module) for name, module in model.named_modules() if name]
    if tuple(scope) == (AUTO,):
        for candidate in AUTO_ORDER:
            resolution = _resolve(named, [candidate], overrides)
            if resolution.targets:
                resolution.chosen_by_auto = candidate
                return resolution
        return ScopeResolution()
    requested = [s for s in scope if s != FULL_ITERATION]
    resolution = _resolve(named, requested, overrides)
    for name in requested:
        if not resolution.matched.get(name):
            raise ValueError(
                f"{component}: scope {name!r} matches no module of {type(model).__name__}. Allowed: scopes that"
                f" match modules of this model; its modules include {candidate_names(model)}. Fix: drop {name!r},"
                f" or pass modules={{{name!r}: 'a.glob.*.name'}} (a glob, an nn.Module class or a predicate)."
            )
    return resolution


def candidate_names(model: nn.Module, limit: int = 24) -> str:
    """Distinct module name patterns with their classes, indices folded to ``*``, for error messages."""
    seen: dict[str, str] = {}
    for name, module in model.named_modules():
        if name:
            seen.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name), type(module).__name__)
    items = [f"{pattern} ({cls})" for pattern, cls in seen.items()]
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _resolve(
    named: list[tuple[str, nn.Module]], scopes: Sequence[str], overrides: Mapping[str, Sequence[Selector]]
) -> ScopeResolution:
    resolution = ScopeResolution()
    owner: dict[str, str] = {}
    for scope in scopes:
        matches = [name for name, module in named if _selected(scope, name, module, overrides)]
        resolution.matched[scope] = matches
        for name in matches:
            owner.setdefault(name, scope)
    modules = dict(named)
    for name in owner:
        enclosing = next((other for other in owner if name.startswith(other + ".")), None)
        if enclosing is not None:
            resolution.nested[name] = enclosing
    resolution.targets = [
        Target(name, modules[name], owner[name]) for name, _ in named if name in owner and name not in resolution.nested
    ]
    return resolution


def _selected(scope: str, name: str, module: nn.Module, overrides: Mapping[str, Sequence[Selector]]) -> bool:
    if scope in overrides:
        return any(_selector_matches(selector, name, module) for selector in overrides[scope])
    return BUILTIN_RULES[scope].matches(name, module)


def _selector_matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))


def _abbreviate(names: Sequence[str], keep: int = 3) -> str:
    shown = ", ".join(names[:keep])
    return shown + (f", ... {names[-1]}" if len(names) > keep else "")

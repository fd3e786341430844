"""Scope names to the modules they capture: built-in rules per scope, overridable per scope.

The built-in rules live in :mod:`.layouts`; ``modules=`` replaces them with selectors or defines a new scope. A match
nested inside another (``blocks.0.attn`` in ``blocks.0``) resolves to the outer one, so each region of the model is
captured by one graph.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from lightning_cudagraph._options.config import FULL_ITERATION, Selector, config_error
from lightning_cudagraph._options.layouts import BUILTIN_RULES, Site, sites_of

__all__ = ["ScopeResolution", "Target", "candidate_names", "resolve_present", "resolve_scopes"]


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

    def summary(self) -> str:
        """One line a user can read: modules per scope, and the regions folded into an enclosing one."""
        parts = [f"{scope}: {len(names)} ({_abbreviate(names)})" for scope, names in self.matched.items()]
        text = "; ".join(parts) if parts else "no modules"
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

    ``overrides`` (``modules=``) replace the built-in patterns or define new scopes; the model root is never a target.
    """
    overrides = overrides or {}
    sites = sites_of(model)
    requested = [s for s in scope if s != FULL_ITERATION]
    resolution = _resolve(sites, requested, overrides, component)
    for name in requested:
        if resolution.matched.get(name):
            continue
        if name in overrides:
            raise _override_matches_nothing(component, model, sites, name, overrides[name])
        if name == "moe_preprocess" and name not in overrides:
            raise config_error(
                component,
                "scope",
                list(scope),
                "'moe_preprocess' only on MoE blocks with their own `preprocess` submodule (as in examples/moe.py);"
                f" {type(model).__name__} has none. Hugging Face MoE blocks route inside their router and experts,"
                " and Megatron's token dispatcher is not an nn.Module, so neither layout has a region to capture",
                "drop 'moe_preprocess' and keep 'moe_router' alone, or take 'moe' or 'layer' instead; or point it"
                " at a module of yours: modules={'moe_preprocess': 'model.layers.*.mlp.<name>'}",
            )
        found = [s for s in BUILTIN_RULES if s != name and any(BUILTIN_RULES[s](site) for site in sites)]
        hint = " (its feed-forward blocks are MoE blocks: ask for 'moe')" if name == "mlp" and "moe" in found else ""
        raise ValueError(
            f"{component}: scope {name!r} matches no module of {type(model).__name__}. Allowed: scopes that"
            f" match modules of this model (built-in ones here: {', '.join(found) or 'none'}); its modules include"
            f" {candidate_names(model)}. Fix: drop {name!r}{hint}, or pass modules={{{name!r}: 'a.glob.*.name'}}"
            " (a glob, an nn.Module class or a predicate)."
        )
    return resolution


def resolve_present(
    model: nn.Module, scope: Sequence[str], overrides: Mapping[str, Sequence[Selector]] | None = None
) -> ScopeResolution:
    """Like :func:`resolve_scopes`, for the scopes that match modules; the others are left out, not an error."""
    resolution = _resolve(sites_of(model), scope, overrides or {}, "CUDAGraphCallback")
    resolution.matched = {name: found for name, found in resolution.matched.items() if found}
    return resolution


def candidate_names(model: nn.Module, limit: int = 24) -> str:
    """Distinct module name patterns with their classes, indices folded to ``*``, for error messages."""
    items = [f"{pattern} ({cls})" for pattern, cls in _name_patterns(model).items()]
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _name_patterns(model: nn.Module) -> dict[str, str]:
    """Each distinct qualified-name pattern (indices folded to ``*``) with the class of its first module."""
    seen: dict[str, str] = {}
    for name, module in model.named_modules():
        if name:
            seen.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name), type(module).__name__)
    return seen


def _override_matches_nothing(
    component: str, model: nn.Module, sites: list[Site], name: str, selectors: Sequence[Selector]
) -> ValueError:
    """The error for a ``modules=`` entry that finds no module: it names the entry, close names, and the fix."""
    shown = selectors[0] if len(selectors) == 1 else list(selectors)
    globs = [s for s in selectors if isinstance(s, str)]
    close = [m for g in globs for m in difflib.get_close_matches(g, list(_name_patterns(model)), n=3, cutoff=0.5)]
    suggestion = "correct the selector"
    if close:
        suggestion += f" (close names: {', '.join(repr(c) for c in dict.fromkeys(close))})"
    builtin = BUILTIN_RULES.get(name)
    found = sum(1 for site in sites if builtin(site)) if builtin is not None else 0
    drop = (
        f", or drop the {name!r} key to use the built-in patterns (they find {found} module(s) here)"
        if builtin is not None
        else f", or drop {name!r} from scope= and modules="
    )
    return ValueError(
        f"{component}: scope {name!r} matches no module of {type(model).__name__}: its override"
        f" `modules={{{name!r}: {shown!r}}}` replaces the built-in patterns and finds nothing. Allowed: selectors that"
        f" match modules of this model; its modules include {candidate_names(model)}. Fix: {suggestion}{drop}."
    )


def _resolve(
    sites: list[Site], scopes: Sequence[str], overrides: Mapping[str, Sequence[Selector]], component: str
) -> ScopeResolution:
    resolution = ScopeResolution()
    owner: dict[str, str] = {}
    for scope in scopes:
        matches = [site.name for site in sites if _selected(scope, site, overrides, component)]
        if matches and len(overrides.get(scope, ())) > 1:
            _refuse_dead_selectors(sites, scope, overrides[scope], component)
        resolution.matched[scope] = matches
        for name in matches:
            owner.setdefault(name, scope)
    for name in owner:
        enclosing = next((other for other in owner if name.startswith(other + ".")), None)
        if enclosing is not None:
            resolution.nested[name] = enclosing
    resolution.targets = [
        Target(site.name, site.module, owner[site.name])
        for site in sites
        if site.name in owner and site.name not in resolution.nested
    ]
    return resolution


def _refuse_dead_selectors(sites: list[Site], scope: str, selectors: Sequence[Selector], component: str) -> None:
    """One selector of a list that matches nothing is a misspelling: its modules would be silently left out."""
    for selector in selectors:
        if any(_selector_matches(selector, site.name, site.module) for site in sites):
            continue
        names = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", site.name) for site in sites})
        close = difflib.get_close_matches(selector, names, n=3, cutoff=0.5) if isinstance(selector, str) else []
        hint = f" (close names: {', '.join(map(repr, close))})" if close else ""
        raise config_error(
            component,
            f"modules[{scope!r}]",
            list(selectors),
            "selectors that each match at least one module (the others in the list do)",
            f"correct or drop {selector!r}{hint}; as it is, what it was meant to select stays out of the graphs",
        )


def _selected(scope: str, site: Site, overrides: Mapping[str, Sequence[Selector]], component: str) -> bool:
    if scope not in overrides:
        return BUILTIN_RULES[scope](site)
    for selector in overrides[scope]:
        try:
            if _selector_matches(selector, site.name, site.module):
                return True
        except Exception as error:  # a user's predicate: name it, the scope and the module it failed on
            raise config_error(
                component,
                f"modules[{scope!r}]",
                selector,
                "a predicate (name, module) -> bool that answers for every module of the model",
                f"it raised {type(error).__name__}: {error} on module {site.name!r} ({site.cls}); make it return"
                " False for modules it does not select (e.g. check isinstance(module, ...) first)",
            ) from error
    return False


def _selector_matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))


def _abbreviate(names: Sequence[str], keep: int = 3) -> str:
    shown = ", ".join(names[:keep])
    return shown + (f", ... {names[-1]}" if len(names) > keep else "")

"""The levels of a fit: what each captures, found once at setup for a fixed scope and for ``scope="auto"`` alike.

A fixed scope is a one-level ladder. Under ``scope="auto"`` the levels, in order, are ``attn`` (attention and
Mamba mixers), ``attn+mlp`` (plus dense feed-forward blocks and MoE routers: the dense parts of a layer),
``layer`` (whole layers) and ``full_iteration`` (the whole step, when the Trainer's strategy is one of the
package's: only a strategy owns the step). Custom scopes of ``modules=`` join every scoped level; overrides of
built-in scopes apply to the levels that use them. A level that finds no modules, or the same modules as the level
before, is skipped. How the levels are walked is :mod:`lightning_cudagraph.ladder`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from lightning_cudagraph.config import FULL_ITERATION, SCOPES, Selector
from lightning_cudagraph.scopes import Target, resolve_present

__all__ = ["LEVEL_SCOPES", "Level", "Plan", "build_levels", "replacement_parts", "scoped_targets", "walk_order"]

#: The scoped levels of ``scope="auto"`` and the scopes each captures, narrowest first.
LEVEL_SCOPES: dict[str, tuple[str, ...]] = {
    "attn": ("attn", "mamba"),
    "attn+mlp": ("attn", "mamba", "mlp", "moe_router"),
    "layer": ("layer",),
}
#: What stands in for a layer whose capture fails: its dense parts (MoE experts stay eager).
PART_SCOPES = LEVEL_SCOPES["attn+mlp"]


@dataclass(frozen=True)
class Level:
    """An entry of the ladder: the regions it captures (none for the whole step), or why it is not tried.

    Example:
        >>> Level("full_iteration").whole_step, Level("attn", unavailable="no attn or mamba modules").unavailable
        (True, 'no attn or mamba modules')
    """

    name: str
    targets: tuple[Target, ...] = ()
    unavailable: str | None = None

    @property
    def whole_step(self) -> bool:
        """Whether this level captures the whole step."""
        return self.name == FULL_ITERATION

    @property
    def target_names(self) -> list[str]:
        """The qualified names of its targets, in model order."""
        return [target.name for target in self.targets]


@dataclass(frozen=True)
class Plan:
    """What preflight planned for a fit: its levels, and what the scoped drivers patch for all of them.

    Attributes:
        levels: In climbing order, skipped ones included (with their reason); a fixed scope has one.
        climbs: Whether the levels are walked and timed (``scope="auto"``); a fixed scope's level is kept as it is.
        patched: Every target a scoped driver patches for the fit, parents before the parts that may replace them.
        parts: For each layer, the dense parts captured instead when the layer cannot be (``scope="auto"``).
        scopes: What each scope (or level) found, for the report.
        summary: One line said at setup, what will be captured; with no level to try, why graphs are off.

    Example:
        >>> plan = Plan((Level("full_iteration"),), climbs=False)  # scope=["full_iteration"]: a one-level ladder
        >>> [level.name for level in plan.levels], plan.patched
        (['full_iteration'], ())
    """

    levels: tuple[Level, ...]
    climbs: bool
    patched: tuple[Target, ...] = ()
    parts: Mapping[str, tuple[Target, ...]] = field(default_factory=dict)
    scopes: Mapping[str, list[str]] = field(default_factory=dict)
    summary: str = ""


def build_levels(
    model: nn.Module, overrides: Mapping[str, Sequence[Selector]], whole_step_problem: str | None
) -> list[Level]:
    """The levels of ``scope="auto"`` for ``model``, in climbing order (skipped ones included, with their reason).

    Args:
        model: The LightningModule.
        overrides: The ``modules=`` option: overrides of built-in scopes, and custom scopes (in every scoped level).
        whole_step_problem: Why the whole step cannot be captured in this fit, or ``None`` if it can.

    Example:
        >>> import torch.nn as nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)
        >>> model = nn.Module()
        >>> model.layers = nn.ModuleList([Block(), Block()])
        >>> [(l.name, len(l.targets), l.unavailable) for l in build_levels(model, {}, "needs the strategy")]
        [('attn', 2, None), ('attn+mlp', 4, None), ('layer', 2, None), ('full_iteration', 0, 'needs the strategy')]
    """
    custom = tuple(name for name in overrides if name not in SCOPES)
    levels: list[Level] = []
    previous: tuple[str, tuple[str, ...]] | None = None
    for name, scopes in LEVEL_SCOPES.items():
        targets = tuple(resolve_present(model, (*scopes, *custom), overrides).targets)
        names = tuple(target.name for target in targets)
        if not targets:
            levels.append(Level(name, unavailable=f"no {' or '.join(scopes)} modules"))
        elif previous is not None and names == previous[1]:
            levels.append(Level(name, unavailable=f"the same modules as {previous[0]!r}"))
        else:
            levels.append(Level(name, targets))
            previous = (name, names)
    levels.append(Level(FULL_ITERATION, unavailable=whole_step_problem))
    return levels


def scoped_targets(levels: Sequence[Level]) -> list[Target]:
    """Every target of the levels that may be tried, each once, by name."""
    seen: dict[str, Target] = {}
    for level in levels:
        if level.unavailable is None:
            for target in level.targets:
                seen.setdefault(target.name, target)
    return list(seen.values())


def walk_order(levels: Sequence[Level]) -> list[Level]:
    """The levels that may be tried, in the order the ladder tries them: the narrowest, then from the widest down."""
    tried = [level for level in levels if level.unavailable is None]
    return [*tried[:1], *reversed(tried[1:])]


def replacement_parts(
    model: nn.Module, targets: Sequence[Target], overrides: Mapping[str, Sequence[Selector]]
) -> dict[str, tuple[Target, ...]]:
    """For each layer among ``targets``, the dense parts that are captured instead when the layer cannot be."""
    layers = [target for target in targets if target.scope == "layer"]
    if not layers:
        return {}
    custom = tuple(name for name in overrides if name not in SCOPES)
    parts = resolve_present(model, (*PART_SCOPES, *custom), overrides).targets
    found = {layer.name: tuple(p for p in parts if p.name.startswith(layer.name + ".")) for layer in layers}
    return {name: inside for name, inside in found.items() if inside}
